"""Sharded, layout-free checkpoints with torch.distributed.checkpoint (DCP).

    <dir>/step_00000040/            a complete checkpoint:
        __<rank>_<k>.distcp, .metadata    DCP shards (every rank writes its own)
        trainer.pt                        step, scheduler, RNG, skipped steps (rank 0)
        run.json                          run id, model config, data stream (rank 0)
        manifest.json                     every file above with its size (and a hash of the
                                          small ones), written last
    <dir>/step_00000060.tmp/        being written; never loaded, replaced by the next save

A checkpoint is complete when its manifest exists and every listed file has its size and
hash; nothing else is ever loaded, and the reason names the file. Rank 0 renames the
``.tmp`` folder only after all ranks finished writing, so an interrupted save leaves the
previous checkpoint loadable. Retention keeps the newest ``keep`` checkpoints of the
current run (same ``run_id`` in run.json), ordered by step number; other runs' checkpoints
are never pruned. State dicts come from ``get_state_dict`` with layout-free names, so a
checkpoint written under one world size or mesh loads under another (DCP reshards on load).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

TRAINER_STATE = "trainer.pt"
RUN_INFO = "run.json"
MANIFEST = "manifest.json"
PREFIX = "step_"
HASHED_BYTES = 64 * 2**20  # files up to this size also get a sha256 in the manifest
_NAME = re.compile(rf"{PREFIX}(\d+)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded, with the path and what to do."""


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"{PREFIX}{step:08d}"


def checkpoint_step(path: str | Path) -> int | None:
    """The step of a ``step_<n>`` folder name; None for anything else (``.tmp`` included)."""
    match = _NAME.fullmatch(Path(path).name)
    return int(match[1]) if match else None


def list_checkpoints(directory: str | Path) -> list[Path]:
    """``step_<n>`` folders in ``directory``, oldest step first (by number, not by name)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def incomplete_reason(path: str | Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (naming the file), or None if it is."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} does not exist or is not a directory"
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        return f"{manifest_file} is missing (the save did not finish)"
    try:
        manifest = json.loads(manifest_file.read_text())
        files, hashes = dict(manifest["files"]), dict(manifest.get("sha256", {}))
    except (ValueError, KeyError, TypeError) as error:
        return f"{manifest_file} is unreadable ({error})"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        actual = file.stat().st_size
        if actual != size:
            return f"{file} has {actual} bytes but the manifest records {size} (truncated or overwritten)"
        if name in hashes and _sha256(file) != hashes[name]:
            return f"{file} does not match the sha256 in the manifest (corrupted or overwritten)"
    return None


def is_complete(path: str | Path) -> bool:
    return incomplete_reason(path) is None


def read_run_info(path: str | Path) -> dict:
    """The run.json of a complete checkpoint (run id, step, model config, data stream)."""
    return json.loads((Path(path) / RUN_INFO).read_text())


def latest_checkpoint(directory: str | Path) -> Path | None:
    """Newest complete checkpoint in ``directory`` (``.tmp`` and incomplete folders are skipped)."""
    complete = [p for p in list_checkpoints(directory) if is_complete(p)]
    return complete[-1] if complete else None


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def _write_json(path: Path, value: dict) -> None:
    temporary = path.with_name(path.name + ".part")
    temporary.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
    os.replace(temporary, path)


def _write_manifest(folder: Path) -> None:
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    hashes = {name: _sha256(folder / name) for name, size in files.items() if size <= HASHED_BYTES}
    _write_json(folder / MANIFEST, {"format": 1, "files": files, "sha256": hashes})


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint so that a half-finished deletion is never mistaken for a checkpoint."""
    (path / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def prune(directory: str | Path, run_id: str, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints of run ``run_id``; returns them."""
    mine = []
    for path in list_checkpoints(directory):
        try:
            if is_complete(path) and read_run_info(path).get("run_id") == run_id:
                mine.append(path)
        except (OSError, ValueError):
            continue
    doomed = mine[:-keep] if keep > 0 else mine
    for path in doomed:
        remove_checkpoint(path)
    return doomed


def _options(model, setting: bool = False) -> StateDictOptions:
    """Frozen parameters (a LoRA run's base weights) are neither saved nor loaded (``adapters.py``);
    ``dcp.load`` still requires every trainable key, so setting the loaded subset is not strict."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not (frozen and setting))


def save_checkpoint(directory, step: int, model, optimizer, scheduler, extra: dict | None = None, keep: int = 2,
                    run_info: dict | None = None) -> Path:
    """Write a checkpoint of ``step`` atomically and keep the newest ``keep`` of this run; returns its path.

    ``run_info`` (JSON: ``run_id``, model config, data stream) goes to run.json; retention
    only touches checkpoints with the same ``run_id``.
    """
    final = checkpoint_path(directory, step)
    staging = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(staging))
    if rank == 0:
        trainer_state = {"step": step, "scheduler": scheduler.state_dict(), "rng": rng_state(), **(extra or {})}
        torch.save(trainer_state, staging / TRAINER_STATE)
        _write_json(staging / RUN_INFO, {"step": step, **(run_info or {})})
        _write_manifest(staging)  # last: its presence means every file above is whole
    dist.barrier()
    if rank == 0:
        if final.exists():
            remove_checkpoint(final)
        staging.rename(final)
        run_id = (run_info or {}).get("run_id")
        if run_id is not None:
            prune(directory, run_id, keep)
        for stale in Path(directory).glob(f"{PREFIX}*.tmp"):  # interrupted saves of earlier steps
            if (checkpoint_step(stale.name.removesuffix(".tmp")) or 0) < step:
                shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG from ``path``; returns the trainer state.

    Every rank checks the same files first, so a broken checkpoint fails everywhere with
    the same message instead of leaving some ranks waiting in a collective.
    """
    path = Path(path)
    reason = incomplete_reason(path)
    if reason is not None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete: {reason}; point checkpoint.resume at a complete step_* "
            "folder, or start fresh with checkpoint.resume=null."
        )
    try:
        trainer_state = torch.load(path / TRAINER_STATE, weights_only=False)
        model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_options(model, setting=True))
    except (Exception, CheckpointException) as error:  # DCP gathers every rank's failure: all ranks get here
        raise CheckpointError(
            f"checkpoint {str(path)!r} could not be loaded ({type(error).__name__}: {str(error).splitlines()[0][:300]}); "
            "it may be corrupt or from a different model: resume from another step_* folder or start fresh "
            "with checkpoint.resume=null."
        ) from error
    scheduler.load_state_dict(trainer_state["scheduler"])
    set_rng_state(trainer_state["rng"])
    return trainer_state
