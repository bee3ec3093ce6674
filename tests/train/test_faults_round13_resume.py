"""Round 13 of fault hunting (docs/reliability.md, "Round 13"): what a resume, generate and the dry run say
of an output directory's checkpoints, its lock and its unfinished saves. Runs train in harness children
(real processes: the lock is about them); the dry runs and generate run in this process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.train.fault_probes import cli, cli_in_child, cli_streams

TINY = ["--config", "configs/tiny-hybrid.yaml", "model.preset=tiny", "parallel.cp=1", "parallel.tp=1",
        "data.pack_size=64", "train.steps=2", "train.eval_every=0", "train.warmup_steps=0", "plot=false",
        "tensorboard=false"]


def _train(*overrides: str) -> subprocess.CompletedProcess:
    return cli_in_child("train", *TINY, *overrides)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny run with a checkpoint after each of its 2 steps, and a LoRA run of 2 steps (seed 0)."""
    folder = tmp_path_factory.mktemp("round13_resume")
    for name, extra in (("run", ["checkpoint.every=1"]), ("lora", ["peft.method=lora"])):
        done = _train(f"output_dir={folder / name}", *extra)
        assert done.returncode == 0, done.stderr
    return folder


def _damaged_copy(saved, tmp_path, *steps: int):
    """A copy of the run whose checkpoints of ``steps`` have a byte appended to trainer.pt."""
    run = tmp_path / "run"
    shutil.copytree(saved / "run", run)
    for step in steps:
        with open(run / "checkpoints" / f"step_{step:08d}" / "trainer.pt", "ab") as handle:
            handle.write(b"x")
    return run


def test_generate_names_the_damaged_checkpoint_it_skips_and_the_one_it_uses(saved, tmp_path):
    """``generate --checkpoint RUN_DIR`` used step 1 without a word when step 2 was damaged; with every checkpoint
    damaged it said only that the folder "holds no complete training checkpoint"."""
    run = _damaged_copy(saved, tmp_path, 2)
    size = (run / "checkpoints/step_00000002/trainer.pt").stat().st_size
    ask = ["generate", "--checkpoint", str(run), "--prompt", "k", "--max-new-tokens", "3", "--json"]
    code, out, err = cli_streams(*ask)
    assert code == 0 and json.loads(out)["new_ids"], err
    assert err.strip() == (f"hybridpar: warning: skipping checkpoint {run}/checkpoints/step_00000002: {run}/checkpoints/"
                           f"step_00000002/trainer.pt has {size} bytes but the manifest records {size - 1} (truncated or "
                           "overwritten); generating from step_00000001 (step 1), the newest complete one"), err
    run = _damaged_copy(saved, tmp_path / "all", 1, 2)
    code, output = cli(*ask[:2], str(run), *ask[3:])
    assert code == 2 and (f"--checkpoint {run} holds no complete training checkpoint: none of its 2 step_* folder(s) "
                          f"can be loaded (newest: {run}/checkpoints/step_00000002: {run}/checkpoints/step_00000002/"
                          "trainer.pt has") in output, output


def test_a_dry_run_prints_the_checkpoints_the_resume_would_skip(saved, tmp_path):
    """``train --dry-run`` said only "config and layout valid" where the run then printed that it skipped the
    damaged newest checkpoint and fell back to an older one."""
    run = _damaged_copy(saved, tmp_path, 2)
    size = (run / "checkpoints/step_00000002/trainer.pt").stat().st_size
    code, output = cli("train", *TINY, f"output_dir={run}", "train.steps=3", "--dry-run")
    assert code == 0 and (f"skipping checkpoint {run}/checkpoints/step_00000002: {run}/checkpoints/step_00000002/"
                          f"trainer.pt has {size} bytes but the manifest records {size - 1}") in output, output
    ran = _train(f"output_dir={run}", "train.steps=3")  # the run prints the same line
    assert ran.returncode == 0 and f"skipping checkpoint {run}/checkpoints/step_00000002: " in ran.stdout, ran.stderr


def test_the_preflight_compares_a_lora_checkpoints_preset_base(saved, tmp_path):
    """A LoRA resume on another seed's preset base passed ``--dry-run`` and was refused only by the run, after the
    model was built and the output directory locked; the dry run and the launcher now refuse it."""
    run = tmp_path / "lora"
    shutil.copytree(saved / "lora", run)
    said = ("holds LoRA adapters trained on preset tiny (seed 0) (sha256 ", "but this run's base is preset tiny (seed 5)")
    for dry in (["--dry-run"], []):
        code, output = cli("train", *TINY, "peft.method=lora", f"output_dir={run}", "train.steps=3", "train.seed=5", *dry)
        assert code == 2 and all(part in output for part in said) and "building the model" not in output, output
    code, output = cli("train", *TINY, "peft.method=lora", f"output_dir={run}", "train.steps=3", "--dry-run")
    assert code == 0, output


def _tiny_llama(folder, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(folder)


def test_a_refusal_while_resuming_releases_the_lock_and_the_dry_run_hashes_an_hf_base(tmp_path):
    """LoRA adapters resumed on a ``model.hf_path`` whose weights changed: the run refused them after taking the
    output directory's lock and left its pid in the lock file, so the next run was told the last one "did not
    finish cleanly"; ``--dry-run`` passed. The dry run now hashes the base as the run does."""
    base, run = tmp_path / "base", tmp_path / "run"
    _tiny_llama(base, 0)
    lora = ["peft.method=lora", f"model.hf_path={base}", f"output_dir={run}"]
    assert _train(*lora).returncode == 0
    _tiny_llama(base, 1)  # other weights at the same path
    said = f"holds LoRA adapters trained on {base} (sha256 "
    code, output = cli("train", *TINY, *lora, "train.steps=3", "--dry-run")
    assert code == 2 and said in output and f"but this run's base is {base} (sha256 " in output, output
    for _ in range(2):
        refused = _train(*lora, "train.steps=3")
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
        assert "did not finish cleanly" not in refused.stderr, refused.stderr
        assert (run / ".hybridpar.lock").read_bytes() == b""


def test_an_unfinished_save_is_removed_at_start_but_never_under_a_live_lock(saved, tmp_path):
    """The ``step_*.tmp`` folder of a save killed mid-write stayed for good (550 MB seen): a later save removed only
    those of earlier steps. It is removed at start, with a notice, once this run holds the output directory's lock;
    while another process holds it (it may be writing) the run is refused and the folder kept."""
    run = tmp_path / "run"
    stale = run / "checkpoints" / "step_00000004.tmp"
    shutil.copytree(saved / "run" / "checkpoints" / "step_00000001", stale)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | "
                               "os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
                               str(run / ".hybridpar.lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        for dry in (["--dry-run"], []):
            code, output = cli("train", *TINY, f"output_dir={run}", "checkpoint.every=-1", *dry)
            assert code == 2 and "is in use by another process" in output and stale.is_dir(), output
    finally:
        holder.communicate("")
    mib = sum(p.stat().st_size for p in stale.iterdir()) / 2**20
    ran = _train(f"output_dir={run}", "checkpoint.every=-1")
    assert ran.returncode == 0 and not stale.exists(), ran.stderr
    assert (f"hybridpar: warning: removed {stale} ({mib:,.1f} MiB), a checkpoint save that did not finish (its process "
            "was stopped while writing it)") in ran.stderr, ran.stderr
