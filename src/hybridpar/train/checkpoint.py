"""Sharded, layout-free checkpoints with torch.distributed.checkpoint (DCP).

    <dir>/step_00000040/            a complete checkpoint (DCP shards + .metadata + trainer.pt)
    <dir>/step_00000060.tmp/        being written; never loaded, replaced by the next save

Every rank writes its own shards into the ``.tmp`` folder; rank 0 renames it only after
all ranks finished, so an interrupted save leaves the previous checkpoint loadable.
State dicts come from ``get_state_dict`` with layout-free names, so a checkpoint written
under one world size or mesh loads under another (DCP reshards on load).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

TRAINER_STATE = "trainer.pt"
PREFIX = "step_"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded, with the path and what to do."""


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"{PREFIX}{step:08d}"


def is_complete(path: Path) -> bool:
    return path.is_dir() and not path.name.endswith(".tmp") and (path / ".metadata").is_file() and (path / TRAINER_STATE).is_file()


def latest_checkpoint(directory: str | Path) -> Path | None:
    """Newest complete checkpoint in ``directory`` (``.tmp`` folders are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    complete = sorted(p for p in directory.glob(f"{PREFIX}*") if is_complete(p))
    return complete[-1] if complete else None


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save_checkpoint(directory, step: int, model, optimizer, scheduler, extra: dict | None = None, keep: int = 2) -> Path:
    """Write a checkpoint of ``step`` atomically and keep the newest ``keep``; returns its path."""
    final = checkpoint_path(directory, step)
    staging = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(staging))
    if rank == 0:
        trainer_state = {"step": step, "scheduler": scheduler.state_dict(), "rng": rng_state(), **(extra or {})}
        torch.save(trainer_state, staging / TRAINER_STATE)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        for old in sorted(p for p in Path(directory).glob(f"{PREFIX}*") if is_complete(p))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG from ``path``; returns the trainer state.

    Every rank checks the same files first, so a broken checkpoint fails everywhere with
    the same message instead of leaving some ranks waiting in a collective.
    """
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete or missing (needs .metadata and {TRAINER_STATE}); "
            "point checkpoint.resume at a complete step_* folder or set checkpoint.resume=null."
        )
    try:
        trainer_state = torch.load(path / TRAINER_STATE, weights_only=False)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except (Exception, CheckpointException) as error:  # DCP gathers every rank's failure: all ranks get here
        raise CheckpointError(
            f"checkpoint {str(path)!r} could not be loaded ({type(error).__name__}: {str(error).splitlines()[0][:300]}); "
            "it may be corrupt or from a different model: resume from another step_* folder or start fresh "
            "with checkpoint.resume=null."
        ) from error
    scheduler.load_state_dict(trainer_state["scheduler"])
    set_rng_state(trainer_state["rng"])
    return trainer_state
