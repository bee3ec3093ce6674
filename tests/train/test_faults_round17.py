"""Round 17 of fault hunting (docs/reliability.md, "Round 17"): checkpoints and resume as operations, and
the torchrun environment; every case in this process (dry runs, a one-process run, the worker's entry)."""

from __future__ import annotations

import argparse
import os
import shutil

import pytest

from tests.train.fault_probes import cli, one_line

TINY = ["model.preset=tiny", "parallel.cp=1", "parallel.tp=1", "data.pack_size=64", "train.warmup_steps=0",
        "train.eval_every=0", "plot=false", "tensorboard=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny MQAR run of 2 steps, a checkpoint after each."""
    folder = tmp_path_factory.mktemp("round17")
    code, output = cli("train", *TINY, "train.steps=2", "checkpoint.every=1", f"output_dir={folder / 'run'}")
    assert code == 0, output
    return folder / "run"


def _kinds(run, tmp_path):
    step = run / "checkpoints" / "step_00000002"
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    return [(step / "run.json", f"is a file, not a folder (a file of the checkpoint {step}: point at that folder)"),
            (run / "metrics.jsonl", "metrics.jsonl is a file, not a folder;"),
            (tmp_path / "dangling", f"is a symbolic link to '{tmp_path / 'gone'}', which does not exist"),
            (tmp_path / "none", "none does not exist;")]


def test_a_checkpoint_path_that_is_not_a_folder_is_named_for_what_it_is(run, tmp_path):
    """Before: ``checkpoint.resume`` at a checkpoint's ``run.json`` (or any file, or a dangling link) said "does not
    exist or is not a directory" of a file that exists, and ``generate --checkpoint`` called a dangling link missing;
    neither pointed at the checkpoint folder the file belongs to."""
    for path, said in _kinds(run, tmp_path):
        code, output = cli("train", *TINY, "train.steps=3", "--dry-run", f"output_dir={tmp_path / 'out'}",
                           f"checkpoint.resume={path}")
        assert code == 2 and said in output and "does not exist or" not in output, output
        code, output = cli("generate", "--checkpoint", str(path), "--prompt", "hi", "--max-new-tokens", "2")
        assert code == 2 and said in output, output


def test_new_subdir_passes_over_a_dangling_run_link(run, tmp_path):
    """Before: ``checkpoint.if_exists=new_subdir`` took ``run-001`` when it was a dangling symbolic link (``exists()``
    is false), and rank 0 failed after building the model with a raw "[Errno 17] File exists"."""
    from hybridpar.config import load_config
    from hybridpar.train.run.resume import plan_resume

    out = tmp_path / "run"
    shutil.copytree(run, out)
    (out / "run-001").symlink_to(tmp_path / "gone")
    config = load_config(None, [*TINY, f"output_dir={out}", "checkpoint.resume=null", "checkpoint.if_exists=new_subdir"])
    assert plan_resume(config).output_dir == str(out / "run-002")


@pytest.mark.parametrize("where", ["checkpoints/step_00000002", "checkpoints/step_00000001/sub",
                                   "checkpoints", "checkpoints/new-run"])
def test_an_output_dir_inside_another_runs_checkpoints_is_refused(run, where):
    """Before: ``output_dir`` inside another run's ``step_*`` folder or its ``checkpoints/`` was accepted (a step folder
    itself was told to use "a subfolder of this one"): that run's retention or ``if_exists=overwrite`` deletes the
    folder, with this run's checkpoints in it."""
    from hybridpar.config import ConfigError
    from hybridpar.train.run.directory import check_output_dir

    with pytest.raises(ConfigError) as error:
        check_output_dir(run / where)
    message = one_line(error)
    assert "checkpoint" in message and "deletes" in message and "a subfolder of this one" not in message, message
    check_output_dir(run)  # the run's own directory is its place


def test_an_export_inside_another_runs_checkpoint_is_refused(run, tmp_path):
    """The same for ``model.export_hf``: an export into another run's step folder was checked for emptiness only."""
    target = run / "checkpoints" / "step_00000001" / "export"
    code, output = cli("train", *TINY, "train.steps=1", "--dry-run", f"output_dir={tmp_path / 'out'}",
                       "model.overrides={pattern: 'MM'}", f"model.export_hf={target}",
                       "model.export_architecture=Mamba2ForCausalLM")
    assert code == 2 and "model.export_hf=" in output and "a checkpoint of a run" in output, output


def _torchrun_env(monkeypatch, world: int, rank: int = 0, local: int | None = None, local_world: int | None = None):
    for key, value in {"WORLD_SIZE": world, "RANK": rank, "LOCAL_RANK": rank if local is None else local,
                       "LOCAL_WORLD_SIZE": world if local_world is None else local_world,
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29511}.items():
        monkeypatch.setenv(key, str(value))


def test_a_torchrun_world_size_the_layout_does_not_take_is_refused_before_the_rendezvous(monkeypatch):
    """Before: a torchrun worker whose ``WORLD_SIZE`` the layout does not take (``WORLD_SIZE=4``, a one-process
    layout) waited in the rendezvous for peers that never came (until the collective timeout), and ``--dry-run``
    named a ``--nproc-per-node 4`` that was never passed."""
    from hybridpar import cli as hybridpar_cli
    from hybridpar import worker
    from hybridpar.config import ConfigError, load_config

    def rendezvous(*args, **kwargs):
        raise AssertionError("the rendezvous was entered")

    monkeypatch.setattr(worker, "init_distributed", rendezvous)
    _torchrun_env(monkeypatch, world=4)
    config = load_config(None, TINY)
    for command in ("train", "check"):
        with pytest.raises(ConfigError) as error:
            worker.run(argparse.Namespace(command=command), config)
        assert "WORLD_SIZE=4 (set by torchrun) does not fit the layout" in one_line(error)
        assert "--nnodes x --nproc-per-node = 1" in str(error.value) and "pass --nproc-per-node" not in str(error.value)
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=4 \(set by torchrun\)"):
        hybridpar_cli.check_world(config, 4)


def test_a_torchrun_dry_run_counts_this_machines_processes_against_its_gpus(monkeypatch):
    """Before: ``--dry-run`` in a torchrun job of 2 machines x 8 processes compared the job's ``WORLD_SIZE=16`` with
    this machine's 8 GPUs and refused it; each machine runs ``LOCAL_WORLD_SIZE`` of them."""
    from hybridpar import cli as hybridpar_cli
    from hybridpar.train import preflight

    seen = []
    monkeypatch.setattr(hybridpar_cli, "check_devices", seen.append)
    monkeypatch.setattr(preflight, "validate_run", lambda *args, **kwargs: None)
    _torchrun_env(monkeypatch, world=16, local_world=8)
    args = hybridpar_cli.parse_args(["train", "--dry-run", *TINY, "parallel.dp_shard=16"])
    assert hybridpar_cli.dry_run(args) == 0 and seen == [8]


def test_a_local_rank_beyond_the_gpus_is_one_line(monkeypatch):
    """Before: ``LOCAL_RANK=3`` on a machine of 2 GPUs reached ``torch.cuda.set_device(3)``: CUDA's "invalid device
    ordinal" traceback on every such rank."""
    import torch
    import torch.distributed as dist

    from hybridpar import worker
    from hybridpar.config import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("the process group was started"))
    _torchrun_env(monkeypatch, world=4, rank=3)
    with pytest.raises(ConfigError) as error:
        worker.init_distributed(5.0)
    assert "LOCAL_RANK=3 names a GPU this machine does not have (it has 2" in one_line(error)
    assert os.environ["LOCAL_RANK"] == "3"


@pytest.mark.parametrize("resume", ["", "/", "/checkpoints"])
def test_resume_at_this_runs_own_output_dir_points_at_auto(run, resume):
    """Before: ``checkpoint.resume`` at the run's own output_dir (or its checkpoints/) said "set output_dir=<the
    output_dir it already is> with checkpoint.resume=auto", then a second list of fixes."""
    code, output = cli("train", *TINY, "train.steps=3", "--dry-run", f"output_dir={run}",
                       f"checkpoint.resume={run}{resume}")
    assert code == 2 and "it is this run's " in output and "checkpoint.resume=auto resumes its newest" in output, output
    assert "set output_dir=" not in output and "point it at" not in output, output


def test_an_output_dir_removed_during_the_run_stops_it(run, tmp_path):
    """Before: an ``output_dir`` removed mid-run (``rm -rf``) went unnoticed: ``metrics.jsonl`` is held open, so every
    step was written to a deleted file, and a run with ``checkpoint.every=-1`` (or before its next save) trained to the
    end and exited 0 with nothing on disk. Now the step after the removal stops the run with one line."""
    from hybridpar.train.run.checkpoint import OutputWriteError
    from hybridpar.train.run.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path / "out", rank=0, tensorboard=False, plot=False)
    logger.log(1, {"loss": 1.0}, echo=False)
    shutil.rmtree(tmp_path / "out")
    with pytest.raises(OutputWriteError) as error:
        logger.log(2, {"loss": 0.9}, echo=False)
    assert "was removed, emptied or renamed during the run" in one_line(error) and "stopped at step 2" in str(error.value)
    logger.close()


@pytest.mark.parametrize("how", ["removed", "renamed"])
def test_an_output_dir_removed_or_renamed_mid_run_is_said_as_such(tmp_path, monkeypatch, how):
    """Before: removed, the run's error (above) was replaced by the loss curve's, drawn on the way out into the removed
    folder: "No such file or directory: run/loss_curve.png"; renamed (``mv run old``), the run went on writing its
    metrics into ``old`` and its checkpoints into a new ``run``, without a word. Now both stop at the next step with
    the one line that names the cause."""
    from hybridpar.train.trainer import Trainer

    out, step = tmp_path / "run", Trainer.train_step

    def then_move(self, index):
        metrics = step(self, index)
        if index == 1:
            shutil.rmtree(out) if how == "removed" else out.rename(tmp_path / "old")
        return metrics

    monkeypatch.setattr(Trainer, "train_step", then_move)
    code, output = cli("train", *TINY, "train.steps=4", "checkpoint.every=-1", "plot=true", f"output_dir={out}")
    assert code != 0 and "was removed, emptied or renamed during the run" in output, output
    assert "stopped at step 2" in output and "loss_curve" not in output, output
