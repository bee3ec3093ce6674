"""Checkpoints and output directories: complete or not loaded (the reason names the file),
retention by step within the run, earlier runs never overwritten, one run per directory."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridpar.config import ConfigError, load_config
from hybridpar.models.hybrid import HybridConfig
from hybridpar.train.run.checkpoint import (RUN_INFO, CheckpointError, _write_json, _write_manifest, checkpoint_path,
                                        incomplete_reason, list_checkpoints, prune)
from hybridpar.train.run.directory import LOCK_FILE, OutputDirLock, check_lock_free
from hybridpar.train.run.resume import model_signature, plan_resume

DEFAULT = "configs/tiny-hybrid.yaml"
SHAPE = model_signature(HybridConfig())


def fake_checkpoint(directory, step: int, run_id: str = "run-a", model=None, data=None) -> Path:
    """A checkpoint folder with the real layout and manifest (small stand-in shards)."""
    path = checkpoint_path(directory, step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"metadata")
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (path / "trainer.pt").write_bytes(b"trainer state")
    _write_json(path / RUN_INFO, {"step": step, "run_id": run_id, "model": model or SHAPE, "data": data or {}})
    _write_manifest(path)
    return path


RECORDED_BATCHES = ["data.pack_size=256", "data.packs_per_step=4", "data.task_options.vocab_size=32"]


def config(tmp_path, *overrides):
    """The default job in one process, with the batches the fake checkpoints below record."""
    return load_config(DEFAULT, [f"output_dir={tmp_path}", "parallel.cp=1", "parallel.tp=1", *RECORDED_BATCHES,
                                 *overrides])


def test_checkpoints_are_ordered_and_pruned_by_step_number_within_their_run(tmp_path):
    directory = tmp_path / "checkpoints"
    for step in (99_999_999, 100_000_000, 7):  # by name, step_100000000 would sort before step_99999999
        fake_checkpoint(directory, step, "mine")
    for step in (50, 200_000_000):
        fake_checkpoint(directory, step, "someone else's")
    assert [p.name for p in list_checkpoints(directory)][-3:] == ["step_99999999", "step_100000000", "step_200000000"]
    removed = prune(directory, "mine", keep=2)
    assert [p.name for p in removed] == ["step_00000007"]
    assert {p.name for p in list_checkpoints(directory)} == {"step_00000050", "step_99999999", "step_100000000",
                                                               "step_200000000"}


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: (p / "trainer.pt").unlink(), r"trainer.pt is missing"),
        (lambda p: (p / "__0_0.distcp").write_bytes(b"short"), r"__0_0.distcp has 5 bytes but the manifest records 1024"),
        (lambda p: (p / "__0_0.distcp").write_bytes(bytes(1024)), r"__0_0.distcp does not match the sha256"),
        (lambda p: (p / "manifest.json").unlink(), r"manifest.json is missing \(the save did not finish\)"),
        (lambda p: (p / "manifest.json").write_text("{"), r"manifest.json is unreadable"),
    ],
)
def test_an_incomplete_checkpoint_names_the_file_and_auto_resume_falls_back_loudly(tmp_path, damage, reason):
    directory = tmp_path / "checkpoints"
    fake_checkpoint(directory, 2)
    damage(fake_checkpoint(directory, 4))
    assert incomplete_reason(checkpoint_path(directory, 2)) is None
    plan = plan_resume(config(tmp_path), SHAPE)
    assert plan.checkpoint.endswith("step_00000002") and plan.start_step == 2
    assert len(plan.notes) == 1 and "skipping checkpoint" in plan.notes[0] and "step_00000004" in plan.notes[0]
    assert __import__("re").search(reason, plan.notes[0]), plan.notes
    with pytest.raises(CheckpointError, match=reason):  # asked for by path: no fallback
        plan_resume(config(tmp_path, f"checkpoint.resume={checkpoint_path(directory, 4)}"), SHAPE)


def test_a_fresh_run_into_a_directory_of_an_earlier_run_is_refused_unless_asked(tmp_path):
    fake_checkpoint(tmp_path / "checkpoints", 5)
    fake_checkpoint(tmp_path / "checkpoints", 10)
    with pytest.raises(ConfigError, match=r"holds outputs of an earlier run \(step_00000005, step_00000010\).*"
                                          r"checkpoint.if_exists=overwrite.*checkpoint.if_exists=new_subdir"):
        plan_resume(config(tmp_path, "checkpoint.resume=null"), SHAPE)
    plan = plan_resume(config(tmp_path, "checkpoint.resume=null", "checkpoint.if_exists=overwrite"), SHAPE)
    assert sorted(Path(p).name for p in plan.remove) == ["step_00000005", "step_00000010"] and plan.checkpoint is None
    (tmp_path / "run-001").mkdir()
    plan = plan_resume(config(tmp_path, "checkpoint.resume=null", "checkpoint.if_exists=new_subdir"), SHAPE)
    assert plan.output_dir == str(tmp_path / "run-002") and not plan.remove
    assert plan_resume(config(tmp_path), SHAPE).start_step == 10  # auto: simply resumes


def test_metrics_of_an_earlier_run_are_not_overwritten_and_foreign_checkpoints_are_not_mixed(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    with pytest.raises(ConfigError, match=r"earlier run \(metrics.jsonl\)"):
        plan_resume(config(tmp_path), SHAPE)  # auto, but nothing to resume: a fresh start
    other = fake_checkpoint(tmp_path / "elsewhere", 3, "run-b")
    fake_checkpoint(tmp_path / "checkpoints", 8, "run-a")
    with pytest.raises(ConfigError, match=r"step_00000008, metrics.jsonl\) that a run resumed from step 3"):
        plan_resume(config(tmp_path, f"checkpoint.resume={other}"), SHAPE)


def test_resume_is_refused_for_another_model_shape_or_data_stream(tmp_path):
    recorded = {"task": "mqar", "path": None, "seed": 0, "pack_size": 256, "packs_per_step": 4,
                "task_options": {"vocab_size": 32, "num_kv_pairs": [2, 4], "min_len": 16, "max_len": 48},
                "pad_to_multiple_of": 4, "file_bytes": None}  # RECORDED_BATCHES
    fake_checkpoint(tmp_path / "checkpoints", 3, model=SHAPE, data=recorded)
    smaller = model_signature(HybridConfig(pattern="M*-M"))
    with pytest.raises(CheckpointError, match=r'another model shape \(pattern "M\*-M-" -> "M\*-M"'):
        plan_resume(config(tmp_path), smaller)
    with pytest.raises(CheckpointError, match=r"change the training batches \(data.pack_size 256 -> 128; data.seed 0 -> 7"):
        plan_resume(config(tmp_path, "data.seed=7", "data.pack_size=128"), SHAPE)
    assert plan_resume(config(tmp_path), SHAPE).pad_to_multiple_of == 4  # no option given: the recorded padding
    with pytest.raises(CheckpointError, match=r"data.pad_to_multiple_of=8 differs from the 4"):
        plan_resume(config(tmp_path, "data.pad_to_multiple_of=8"), SHAPE)
    with pytest.raises(CheckpointError, match=r"padded to multiples of 4; at parallel.cp=4 .* 2\*cp=8"):
        plan_resume(config(tmp_path, "parallel.cp=4"), SHAPE)


def test_a_field_that_keeps_every_parameter_resumes_with_a_warning(tmp_path):
    """chunk_size (rounding) or rope_theta (the function) change no parameter: the checkpoint loads
    whole, so resuming goes on and says the losses differ; a field that moves a parameter refuses."""
    recorded = json.loads(json.dumps(model_signature(HybridConfig(pattern="M*-M-"))))  # as run.json holds it
    fake_checkpoint(tmp_path / "checkpoints", 3, model=recorded)
    plan = plan_resume(config(tmp_path), model_signature(HybridConfig(chunk_size=32, rope_theta=5e5)))
    assert plan.start_step == 3 and [n[:90] for n in plan.notes if "model." in n] == [
        f"warning: checkpoint {tmp_path}/checkpoints/step_00000003 was trained with model.chunk_size=16; resuming"[:90],
        f"warning: checkpoint {tmp_path}/checkpoints/step_00000003 was trained with model.rope_theta=10000.0; resumi"[:90]]
    with pytest.raises(CheckpointError, match=r"another model shape \(conv_kernel 4 -> 3; rope_theta"):
        plan_resume(config(tmp_path), model_signature(HybridConfig(conv_kernel=3, rope_theta=5e5)))


def test_a_transformers_field_that_keeps_every_parameter_resumes_with_a_warning(tmp_path):
    import transformers

    base = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, architectures=["LlamaForCausalLM"])
    fake_checkpoint(tmp_path / "checkpoints", 3, model=json.loads(json.dumps(model_signature(base))))
    theta = transformers.LlamaConfig(**{**base.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    notes = plan_resume(config(tmp_path), model_signature(theta)).notes
    assert any("model.rope_parameters=" in n and "loads every parameter" in n for n in notes), notes
    wider = transformers.LlamaConfig(**{**base.to_dict(), "intermediate_size": 48})
    with pytest.raises(CheckpointError, match=r"another model shape \(intermediate_size 32 -> 48"):
        plan_resume(config(tmp_path), model_signature(wider))


HOLDER = """
import sys, time
from hybridpar.train.run.directory import OutputDirLock
OutputDirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_one_run_per_output_dir_and_a_dead_holder_is_taken_over(tmp_path, capsys):
    """A real process holds the lock: the CLI refuses (exit 2, naming it); once it is
    killed, the next run takes the lock over with a warning."""
    from hybridpar.cli import main

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3] / "src")})
    try:
        assert holder.stdout.readline().strip() == "locked"
        args = ["train", "--config", DEFAULT, f"output_dir={tmp_path}", "parallel.cp=1", "parallel.tp=1"]
        assert main(args) == 2
        assert f"is in use by process {holder.pid}" in capsys.readouterr().err
        with pytest.raises(ConfigError, match=f"process {holder.pid}"):
            OutputDirLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    check_lock_free(tmp_path)  # the kernel dropped the dead process's lock
    lock = OutputDirLock(tmp_path)
    warning = lock.acquire()
    assert f"locked by process {holder.pid}" in warning and "no longer running" in warning
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # a clean exit leaves no holder: no warning next time
    again = OutputDirLock(tmp_path)
    assert again.acquire() is None
    again.release()
