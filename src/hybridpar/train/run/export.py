"""The export of a finished run (``model.export_hf``), written into a staging folder and renamed
into place, so a failed export leaves nothing half-written where the user looks. A failure to
write (a full disk, a directory removed) is one line saying where the trained weights still are.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from hybridpar.train.run.checkpoint import OutputWriteError, free_space

__all__ = ["write_export", "overlap_problem", "remove_stale_staging"]

RUN_FOLDERS = ("checkpoints", "tensorboard", "tokenizer")  # what a run writes under output_dir


def _write_failure(error: Exception) -> bool:
    """An OSError, or safetensors' ``SafetensorError`` wrapping one ("I/O error: No space left ...")."""
    return isinstance(error, OSError) or "I/O error" in str(error)


def overlap_problem(target: str | Path, output_dir: str | Path) -> str | None:
    """Why export ``target`` would collide with the run's own ``output_dir`` (it is output_dir, holds it,
    or lies in a folder the run fills): found at start, not after training when it is no longer empty."""
    target, out = Path(target).resolve(), Path(output_dir).resolve()
    if target == out or out.is_relative_to(target):
        return f"it is or holds output_dir={str(output_dir)!r}, which the run fills before the export is written"
    inside = next((name for name in RUN_FOLDERS if target.is_relative_to(out / name)), None)
    return f"it lies in output_dir's {inside}/, which the run writes" if inside else None


def remove_stale_staging(target: Path) -> list[Path]:
    """Remove the staging folders of ``target`` whose process is gone (an export killed with SIGKILL
    leaves ``.<name>.tmp-<pid>`` behind); a live process's folder is left alone. Returns the removed."""
    removed = []
    for folder in target.parent.glob(f".{glob.escape(target.name)}.tmp-*"):
        pid = folder.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (another export at work)
        except PermissionError:
            continue  # alive, another user's
        except (ProcessLookupError, OverflowError):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def write_export(target: Path, write: Callable[[Path], None], last_checkpoint: str | None) -> None:
    """``write(staging)`` the export, then rename the staging folder to ``target`` (empty or absent)."""
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    remove_stale_staging(target)
    try:
        write(staging)
        if target.is_dir():
            target.rmdir()  # empty (checked before training)
        staging.rename(target)
    except Exception as error:
        shutil.rmtree(staging, ignore_errors=True)
        if not _write_failure(error):
            raise
        kept = (f"the trained weights are in {last_checkpoint}: free space and run the same command again to export "
                "them (nothing is left to train)" if last_checkpoint else
                "no checkpoint holds the trained weights (checkpoint.every=-1)")
        first = (str(error).strip().splitlines() or [""])[0][:200]
        raise OutputWriteError(f"model.export_hf={str(target)!r} could not be written ({type(error).__name__}: {first}; "
                               f"{free_space(target.parent)}); {kept}.") from None
