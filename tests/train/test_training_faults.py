"""Faults during training on real gloo ranks: non-finite values, a second run into a locked
directory, an export target that appears during training, and what decides the batches."""

import json
import math
from pathlib import Path

import torch

from hybridpar.config import load_config
from tests.distributed.harness import run_ranks

DEFAULT = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-hybrid.yaml")
SMALL = ["model.preset=tiny", "tensorboard=false", "plot=false", "train.eval_every=0", "train.log_every=1", "data.pack_size=64",
         "data.packs_per_step=2", "data.task_options={min_len: 16, max_len: 32, num_kv_pairs: 2, vocab_size: 32}"]
CP2 = ["parallel.cp=2", "parallel.tp=1", "parallel.sequence_parallel=false"]
ONE = ["parallel.cp=1", "parallel.tp=1", "parallel.sequence_parallel=false"]


def _trainer(directory, *overrides):
    from hybridpar.train.trainer import Trainer

    return Trainer(load_config(DEFAULT, SMALL + [f"output_dir={directory}", *overrides]), torch.device("cpu"))


def _strict_records(path: Path) -> list[dict]:
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def _nonfinite_cases(rank, world_size, root):
    from hybridpar.train.run.checkpoint import is_complete, list_checkpoints
    from hybridpar.train.nonfinite import NonFiniteError

    out = {}
    huge = ["train.lr=1000000.0", "train.warmup_steps=0", "train.steps=8", "checkpoint.every=1", "checkpoint.keep=1"]
    for policy in ("stop", "skip"):
        directory = Path(root) / policy
        try:
            _trainer(directory, *CP2, *huge, f"train.on_nonfinite={policy}", "train.max_nonfinite_skips=2").fit()
            out[policy] = None
        except NonFiniteError as error:
            kept = list_checkpoints(directory / "checkpoints")
            out[policy] = (str(error), [p.name for p in kept], all(is_complete(p) for p in kept))
    # The kept checkpoint loads and is finite.
    resumed = _trainer(Path(root) / "stop", *CP2, "train.steps=8")
    resumed.resume()
    out["resumed_finite"] = all(bool(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all())
                                for p in resumed.model.parameters())
    out["resumed_step"] = resumed.start_step
    resumed._lock and resumed._lock.release()
    # A weight that is not finite on one rank: no checkpoint, on every rank.
    trainer = _trainer(Path(root) / "weights", *CP2, "train.steps=4", "checkpoint.every=1")
    trainer.fit(stop_after=1)
    if rank == 0:
        with torch.no_grad():
            param = next(trainer.model.parameters())
            (param.to_local() if hasattr(param, "to_local") else param).view(-1)[0] = float("nan")
    try:
        trainer.save(2)
        out["save"] = None
    except NonFiniteError as error:
        out["save"] = str(error)
    out["weights_checkpoints"] = sorted(p.name for p in (Path(root) / "weights" / "checkpoints").iterdir())
    return out


def test_nonfinite_values_stop_or_skip_and_never_reach_a_checkpoint(tmp_path):
    """train.lr=1e6: the loss is NaN from step 2. ``stop`` ends the run naming step 2 and keeps
    the finite step-1 checkpoint; ``skip`` skips 2 steps and stops at the third; metrics.jsonl
    stays strict JSON; a NaN weight on one rank stops the save on both."""
    results = run_ranks(2, _nonfinite_cases, str(tmp_path), timeout_s=600)
    for out in results:
        message, kept, complete = out["stop"]
        assert message.startswith("step 2: the loss is nan") and "train.on_nonfinite=skip" in message
        assert kept == ["step_00000001"] and complete
        message, kept, complete = out["skip"]
        assert message.startswith("step 4:") and "3 non-finite steps, more than train.max_nonfinite_skips=2" in message
        assert kept == ["step_00000003"] and complete  # steps 2 and 3 were skipped: weights still those of step 1
        assert out["resumed_finite"] and out["resumed_step"] == 1
        assert out["save"].startswith("step 2: ") and "not finite; no checkpoint was written" in out["save"]
        assert "step_00000001" in out["save"] and out["weights_checkpoints"] == ["step_00000001"]
    records = _strict_records(tmp_path / "stop" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and records[1]["loss"] is None and math.isfinite(records[0]["loss"])
    skipped = _strict_records(tmp_path / "skip" / "metrics.jsonl")
    assert [r.get("skipped_steps") for r in skipped] == [None, 1, 2, None]


def _locked(rank, world_size, directory):
    from hybridpar.config import ConfigError

    try:
        _trainer(directory, *CP2, "train.steps=2").fit()
    except ConfigError as error:
        return str(error)
    return None


def test_a_second_run_into_a_locked_output_dir_is_refused_on_every_rank(tmp_path):
    import os

    from hybridpar.train.run.directory import OutputDirLock

    lock = OutputDirLock(tmp_path)
    lock.acquire()  # this test process plays the first run
    try:
        results = run_ranks(2, _locked, str(tmp_path), timeout_s=300)
    finally:
        lock.release()
    assert all(r is not None and f"is in use by process {os.getpid()}" in r for r in results), results
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


def _one_rank_cases(rank, world_size, root):
    root = Path(root)
    # The packs of step k do not depend on train.steps (extending 10 -> 20) nor on the layout's padding.
    ten = _trainer(root / "ten", *ONE, "train.steps=10", "checkpoint.every=-1")
    twenty = _trainer(root / "twenty", *ONE, "train.steps=20", "data.pad_to_multiple_of=2")
    same = all(torch.equal(a["input_ids"], b["input_ids"]) for k in range(20)
               for a, b in zip(ten.train_data.step_packs(k), twenty.train_data.step_packs(k)))
    ten.fit(stop_after=3)  # checkpoint.every=-1: never saves, not even at the end
    never = not (root / "ten" / "checkpoints").exists()
    # An export target that became non-empty during training is left alone.
    target = root / "export"
    exporter = _trainer(root / "run", *ONE, "train.steps=1", "checkpoint.every=-1", f"model.export_hf={target}",
                        "model.export_architecture=NemotronHForCausalLM", "model.overrides={rotary_fraction: 0.0}")
    target.mkdir()
    (target / "notes.txt").write_text("the user's file")
    exporter.fit()
    siblings = sorted(p.name for p in root.iterdir() if p.name.startswith("export") or p.name.startswith(".export"))
    return same, never, (target / "notes.txt").read_text(), sorted(p.name for p in target.iterdir()), siblings


def test_batches_do_not_depend_on_train_steps_and_export_never_overwrites(tmp_path):
    same, never, notes, target, siblings = run_ranks(1, _one_rank_cases, str(tmp_path), timeout_s=300)[0]
    assert same and never
    assert notes == "the user's file" and target == ["notes.txt"]
    assert len(siblings) == 2 and siblings[0] == "export" and siblings[1].startswith("export-")  # no .tmp left
    assert (tmp_path / siblings[1] / "config.json").is_file() and (tmp_path / siblings[1] / "model.safetensors").is_file()
