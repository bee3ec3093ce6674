"""Sharded, layout-free checkpoints with torch.distributed.checkpoint (DCP).

    <dir>/step_00000040/            a complete checkpoint:
        __<rank>_<k>.distcp, .metadata    DCP shards (every rank writes its own)
        trainer.pt                        step, scheduler, RNG, skipped steps (rank 0)
        run.json                          run id, model config, data stream (rank 0)
        manifest.json                     every file above with its size and sha256, written last
    <dir>/step_00000060.tmp/        being written; never loaded, removed at the next start (``directory.py``)

A checkpoint is complete when its manifest exists and every listed file has its size and
sha256, whatever its size (format 2; format-1 manifests hashed files up to 64 MiB only, and
those are checked as recorded). Each rank hashes the shards it wrote while saving, and each
rank verifies a share of the files before loading (about 2 s per GiB with sha256 on one
core of a busy machine: ``benchmarks/checkpoint_hash.py``); a verified file is not hashed
again in the same process unless its size or mtime changed. Nothing else is ever loaded,
and the reason names the file. A loaded checkpoint's weights and optimizer state must be
finite, or it is refused naming the tensor. Rank 0 renames the
``.tmp`` folder only after all ranks finished writing, so an interrupted save leaves the
previous checkpoint loadable. Retention keeps the newest ``keep`` checkpoints of the
current run (same ``run_id`` in run.json), ordered by step number; other runs' checkpoints
are never pruned. State dicts come from ``get_state_dict`` with layout-free names, so a
checkpoint written under one world size or mesh loads under another (DCP reshards on load);
packed tensor-parallel weights are saved as one process holds them (``parallel/packed_checkpoint.py``).
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

from hybridpar.config_rules import bounded_message, not_a_directory, quoted, shorten
from hybridpar.models.hf.files import directory_kind
from hybridpar.parallel.packed_checkpoint import packed_shards
from hybridpar.train.run.fused_resume import fused_legacy_names
from hybridpar.strict_json import loads as strict_loads

TRAINER_STATE = "trainer.pt"
RUN_INFO = "run.json"
MANIFEST = "manifest.json"
PREFIX = "step_"
FORMAT = 2  # 1: sha256 of files up to 64 MiB only; 2: of every file
_VERIFIED: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256, the files this process hashed
_NAME = re.compile(rf"{PREFIX}(\d+)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded, with the path and what to do (one bounded line)."""

    def __init__(self, message="", *args):
        super().__init__(bounded_message(message), *args)


class OutputWriteError(RuntimeError):
    """An output of the run (a checkpoint, the export) that could not be written (disk full, a
    directory removed, ...): the run stops with one line naming the cause, the free space and
    what is still intact."""

    def __init__(self, message="", *args):
        super().__init__(bounded_message(message), *args)


def read_only_note(path: Path) -> str:
    """`` (it is on a read-only file system)`` when ``path`` is, else ``""``."""
    return " (it is on a read-only file system)" if os.statvfs(path).f_flag & os.ST_RDONLY else ""


def free_space(directory: str | Path) -> str:
    """``"12.3 MiB free there"`` for a failure message."""
    try:
        return f"{shutil.disk_usage(directory).free / 2**20:,.1f} MiB free there"
    except OSError:
        return "the directory is gone"


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


def file_sha256(path: Path) -> str:
    """sha256 of a file, streamed in 16 MiB blocks (remembered for this size and mtime)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _VERIFIED:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(16 * 2**20), b""):
                digest.update(block)
        _VERIFIED[key] = digest.hexdigest()
    return _VERIFIED[key]


def _read_manifest(path: Path) -> tuple[dict, dict, str | None]:
    """``(files -> size, files -> sha256, problem)`` of a checkpoint folder's manifest."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        return {}, {}, directory_kind(path, "run") or f"{manifest_file} is missing (the save did not finish)"
    try:
        manifest = strict_loads(manifest_file.read_text())  # a key written twice: edited, refused
        files, hashes = dict(manifest["files"]), dict(manifest.get("sha256", {}))
        if manifest.get("format", 1) >= 2 and set(files) - set(hashes):
            return {}, {}, f"{manifest_file} records no sha256 for {sorted(set(files) - set(hashes))[:3]}"
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        return {}, {}, f"{manifest_file} is unreadable ({str(error)[:200]})"
    return files, hashes, None


def _file_problem(path: Path, name: str, size: int, sha256: str | None, verify: bool) -> str | None:
    file = path / name
    if not file.is_file():
        return f"{file} is missing"
    actual = file.stat().st_size
    if actual != size:
        return f"{file} has {actual} bytes but the manifest records {size} (truncated or overwritten)"
    if verify and sha256 is not None and file_sha256(file) != sha256:
        return f"{file} does not match the sha256 in the manifest (corrupted or overwritten)"
    return None


def incomplete_reason(path: str | Path, verify: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """Why ``path`` is not a complete checkpoint (naming the file), or None if it is.

    Every listed file must exist with its recorded size; ``verify`` also hashes every file
    (``share=(rank, world)``: only files ``rank, rank + world, ...`` are hashed, so ranks split
    the work). ``verify=False`` (listing, pruning) checks sizes only.
    """
    path = Path(path)
    if not path.is_dir():
        return f"{path} {not_a_directory(path)}"
    files, hashes, problem = _read_manifest(path)
    if problem:
        return problem
    rank, world = share
    for index, (name, size) in enumerate(sorted(files.items())):
        problem = _file_problem(path, name, size, hashes.get(name), verify and index % world == rank)
        if problem:
            return problem
    return None


def is_complete(path: str | Path) -> bool:
    return incomplete_reason(path) is None


def read_run_info(path: str | Path) -> dict:
    """The run.json of a complete checkpoint (run id, step, model config, data stream); CheckpointError
    naming the file when it is not what hybridpar writes (edited, or of another version)."""
    file = Path(path) / RUN_INFO
    try:
        info = strict_loads(file.read_text())
        if not isinstance(info, dict):
            raise ValueError(f"it holds a JSON {type(info).__name__}, not an object")
        step = info.get("step", 0)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"its step is {quoted(step)}, not an integer >= 0")
        wrong = [key for key in ("config", "data", "model", "lora_base") if not isinstance(info.get(key) or {}, dict)]
        if wrong:
            raise ValueError(f"its {wrong[0]} is a {type(info[wrong[0]]).__name__}, not an object")
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{file} cannot be read ({shorten(str(error), 200)}): it was edited or written by another "
                              "hybridpar; resume another checkpoint (checkpoint.resume=PATH) or start fresh "
                              "(checkpoint.resume=null).") from None
    return info


def newest_complete(directory: str | Path) -> tuple[Path | None, dict[Path, str]]:
    """The newest complete, verified checkpoint in ``directory`` (None if none is; a ``.tmp`` folder is
    none), and each newer one skipped with why (``incomplete_reason``)."""
    skipped = {}
    for path in reversed(list_checkpoints(directory)):
        if (reason := incomplete_reason(path)) is None:
            return path, skipped
        skipped[path] = reason
    return None, skipped


def latest_checkpoint(directory: str | Path) -> Path | None:
    """Newest complete, verified checkpoint in ``directory`` (``.tmp`` and incomplete folders are skipped)."""
    return newest_complete(directory)[0]


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def _write_json(path: Path, value: dict) -> None:
    temporary = path.with_name(path.name + ".part")
    temporary.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
    os.replace(temporary, path)


def _write_manifest(folder: Path, hashed: dict[str, str] | None = None) -> None:
    """The manifest of every file in ``folder``: size and sha256 (``hashed``: those the other
    ranks computed for the shards they wrote)."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    hashes = {name: (hashed or {}).get(name) or file_sha256(folder / name) for name in files}
    _write_json(folder / MANIFEST, {"format": FORMAT, "files": files, "sha256": hashes})


def _hash_own_shards(folder: Path, rank: int) -> dict[str, str]:
    """sha256 of the DCP shards this rank wrote (``__<rank>_<k>.distcp``), while it still has them in cache."""
    return {p.name: file_sha256(p) for p in sorted(folder.glob(f"__{rank}_*.distcp")) if p.is_file()}


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint so that a half-finished deletion is never mistaken for a checkpoint; a
    symbolic link to one (kept on another disk) loses the link only, never what it points to."""
    if path.is_symlink():
        path.unlink()
        return
    (path / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def prune(directory: str | Path, run_id: str, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints of run ``run_id``; returns them."""
    mine = []
    for path in list_checkpoints(directory):
        try:
            if incomplete_reason(path, verify=False) is None and read_run_info(path).get("run_id") == run_id:
                mine.append(path)
        except (OSError, ValueError):
            continue
    doomed = mine[:-keep] if keep > 0 else mine
    for path in doomed:
        remove_checkpoint(path)
    return doomed


def load_failure(error: BaseException) -> str:
    """``"Type: first line"`` of what went wrong in a DCP load: a ``CheckpointException`` (not an
    ``Exception``: catch both) names its first failing rank's own error, not its traceback."""
    failures = getattr(error, "failures", None)
    if isinstance(error, CheckpointException) and failures:
        error = next(iter(failures.values()))[0]
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:300]}"


def _options(model, setting: bool = False) -> StateDictOptions:
    """Frozen parameters (a LoRA run's base weights) are neither saved nor loaded (``adapters.py``);
    ``dcp.load`` still requires every trainable key, so setting the loaded subset is not strict."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not (frozen and setting))


def save_checkpoint(directory, step: int, model, optimizer, scheduler, extra: dict | None = None, keep: int = 2,
                    run_info: dict | None = None) -> Path:
    """Write a checkpoint of ``step`` atomically and keep the newest ``keep`` of this run; returns its path.
    ``run_info`` (JSON: ``run_id``, model config, data stream) goes to run.json; retention only touches checkpoints
    with the same ``run_id``."""
    try:
        return _save(directory, step, model, optimizer, scheduler, extra, keep, run_info)
    except BaseException as error:  # DCP's CheckpointException is a BaseException, as is an interrupt (DCP wraps it)
        cause = next(iter(error.failures.values()))[0] if isinstance(error, CheckpointException) and error.failures else error
        if not isinstance(cause, Exception):  # SIGINT (a one-process run's SIGTERM) mid-save: no write failed; the
            raise cause from None  # next run removes the .tmp folder, as a killed save's
        if dist.get_rank() == 0:
            shutil.rmtree(checkpoint_path(directory, step).with_name(f"{PREFIX}{step:08d}.tmp"), ignore_errors=True)
        intact = latest_checkpoint(directory)
        raise OutputWriteError(
            f"saving the checkpoint of step {step} in {directory} failed ({load_failure(error)}; {free_space(directory)}); the run "
            f"stopped. The newest complete checkpoint ({intact.name if intact else 'none'}) is intact: free space or "
            "fix the directory, then run again with checkpoint.resume=auto.") from None


def _save(directory, step: int, model, optimizer, scheduler, extra: dict | None, keep: int,
          run_info: dict | None) -> Path:
    final = checkpoint_path(directory, step)
    staging = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
    with packed_shards({"model": model_state, "optim": optim_state}) as state:
        dcp.save(state, checkpoint_id=str(staging))
    hashed = [_hash_own_shards(staging, rank)]  # every rank hashes its own shards, in parallel
    if dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(hashed[0], gathered, dst=0)
        hashed = gathered
    if rank == 0:
        trainer_state = {"step": step, "scheduler": scheduler.state_dict(), "rng": rng_state(), **(extra or {})}
        torch.save(trainer_state, staging / TRAINER_STATE)
        _write_json(staging / RUN_INFO, {"step": step, **(run_info or {})})
        _write_manifest(staging, {k: v for part in hashed for k, v in part.items()})  # last: every file above is whole
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


def verify_checkpoint(path: str | Path) -> None:
    """CheckpointError on every rank unless every file of ``path`` has its recorded size and
    sha256; the ranks split the hashing and share their verdicts (one all_gather_object)."""
    path = Path(path)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    share = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    reasons = [incomplete_reason(path, share=share)]
    if distributed:
        reasons = [None] * share[1]
        dist.all_gather_object(reasons, incomplete_reason(path, share=share))
    reason = next((r for r in reasons if r), None)
    if reason is not None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be loaded: {reason}; point checkpoint.resume at a complete step_* "
            "folder, or start fresh with checkpoint.resume=null."
        )


def _check_loaded_finite(path: Path, model, optimizer) -> None:
    """CheckpointError on every rank if a loaded weight or optimizer state is not finite (naming it)."""
    from hybridpar.train.nonfinite import first_nonfinite

    bad = first_nonfinite({"model": dict(model.named_parameters()),
                           "optim": {str(i): s for i, s in enumerate(optimizer.state.values())}})
    found = [bad]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, bad)
    bad = next((b for b in found if b), None)
    if bad is not None:
        raise CheckpointError(f"checkpoint {str(path)!r} holds a non-finite value in {bad}; it was damaged after its "
                              "manifest was written, or written by an older hybridpar without the finite check: resume "
                              "from an earlier step_* folder, or start fresh with checkpoint.resume=null.")


def load_checkpoint(path, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG from ``path``; returns the trainer state.

    Every file is verified first (size and sha256, the ranks sharing the work), so a broken
    checkpoint fails everywhere with the same message instead of leaving some ranks waiting
    in a collective; the loaded weights and optimizer state must be finite.
    """
    path = Path(path)
    verify_checkpoint(path)
    try:
        trainer_state = torch.load(path / TRAINER_STATE, weights_only=False)
        model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
        groups = [list(group["params"]) for group in optim_state["param_groups"]]  # names in each of this run's groups
        state = {"model": model_state, "optim": optim_state}
        with fused_legacy_names(state, path, model), packed_shards(state):  # an older run's fused in_proj.weight
            dcp.load(state, checkpoint_id=str(path))
        for group, names in zip(state["optim"]["param_groups"], groups):  # moments load by name, groups are this run's:
            group["params"] = names  # a run saved before optim.NO_DECAY had Mamba1's A_log decayed (KeyError on load)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_options(model, setting=True))
    except (Exception, CheckpointException) as error:  # DCP gathers every rank's failure: all ranks get here
        raise CheckpointError(
            f"checkpoint {str(path)!r} could not be loaded ({load_failure(error)}); "
            "it may be corrupt or from a different model: resume from another step_* folder or start fresh "
            "with checkpoint.resume=null."
        ) from error
    _check_loaded_finite(path, model, optimizer)
    scheduler.load_state_dict(trainer_state["scheduler"])
    set_rng_state(trainer_state["rng"])
    return trainer_state
