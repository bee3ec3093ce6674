"""The output directory of a run: one run at a time, and nothing of an earlier run lost.

- **Lock.** Rank 0 holds ``flock`` on ``<output_dir>/.hybridpar.lock`` for the whole run and
  writes its pid and host there; a second run into the directory is refused while the
  first holds it. The kernel releases the lock when a process dies, so a lock file that
  still names a process (it did not finish cleanly) is taken over with a warning.
- **Writable before the first step.** ``check_run_paths`` checks every path the run will
  write (output_dir, its checkpoints/, metrics.jsonl, tensorboard/, loss_curve.png, the
  trained tokenizer, model.export_hf and the sibling it is staged in) before any process
  starts, naming the key: a path under a regular file, a directory where a file goes, or
  a directory this user cannot write (or on a read-only file system).
- **A run directory, not someone else's.** An ``output_dir`` that exists, is not empty and
  holds nothing a run writes (its lock file, ``checkpoints/``, ``metrics.jsonl``, ``tokenizer/``
  (trained by the launcher first), ``tensorboard/``, ``loss_curve.png`` or ``run-NNN``),
  or that is ``/``, the home directory or a source tree (it holds ``.git``), is refused: a
  run would scatter its files among (and ``if_exists=overwrite`` delete from) files it does not own.
- **No stale saves.** A ``checkpoints/step_*.tmp`` folder is a save its process did not finish
  (killed mid-write); rank 0 removes it at start, once it holds the lock (no live run writes there).
- **Resume or refuse**: ``resume.py``.

The launcher calls ``check_lock_free`` before torchrun starts (so the error exits 2 at once);
rank 0 takes the lock as the authority (``resume.prepare_output_dir``).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
from pathlib import Path

from hybridpar.config import ConfigError, RunConfig
from hybridpar.config_rules import quoted
from hybridpar.train.run.checkpoint import PREFIX, read_only_note, remove_checkpoint

LOCK_FILE = ".hybridpar.lock"
METRICS_FILE = "metrics.jsonl"


# ----------------------------------------------------------------------------- lock


class OutputDirLock:
    """An exclusive lock on an output directory for this process (re-entrant within it)."""

    _held: dict[str, list] = {}  # resolved directory -> [file descriptor, count]

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.key = str(self.directory.resolve())
        self.acquired = False

    def acquire(self) -> str | None:
        """Take the lock; returns a warning when a stale lock was taken over. ConfigError if held."""
        if self.key in self._held:
            self._held[self.key][1] += 1
            self.acquired = True
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        if problem := lock_file_problem(self.directory):
            raise ConfigError(problem)
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(_in_use_message(self.directory, holder)) from None
        previous = _read_holder(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode(), 0)
        self._held[self.key] = [fd, 1]
        self.acquired = True
        if previous.get("pid") and previous.get("pid") != os.getpid():
            return (f"output_dir {str(self.directory)!r} was locked by process {previous['pid']} on "
                    f"{previous.get('host', '?')}, which is no longer running (it did not finish cleanly); "
                    "taking the lock over.")
        return None

    def release(self) -> None:
        if not self.acquired or self.key not in self._held:
            return
        self.acquired = False
        entry = self._held[self.key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._held[self.key]
            os.ftruncate(entry[0], 0)  # a clean exit leaves no holder behind
            fcntl.flock(entry[0], fcntl.LOCK_UN)
            os.close(entry[0])


def remove_stale_saves(directory: str | Path) -> list[str]:
    """Remove the ``step_*.tmp`` folders of ``<directory>/checkpoints`` (call it holding the lock);
    returns a notice for each, naming it and its size."""
    notes = []
    for folder in sorted((Path(directory) / "checkpoints").glob(f"{PREFIX}*.tmp")):
        if not folder.is_dir():
            continue
        size = 0 if folder.is_symlink() else sum(os.lstat(os.path.join(root, name)).st_size
                                                 for root, _, names in os.walk(folder) for name in names)
        remove_checkpoint(folder)
        notes.append(f"removed {folder} ({size / 2**20:,.1f} MiB), a checkpoint save that did not finish (its "
                     "process was stopped while writing it)")
    return notes


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, OSError, RecursionError):
        return {}


def lock_file_problem(directory: Path) -> str | None:
    """Why ``<directory>/.hybridpar.lock`` is not a lock file hybridpar may take (it truncates and
    writes it): a symbolic link (its target would be overwritten), a directory, a pipe; or None."""
    lock = Path(directory) / LOCK_FILE
    if lock.is_symlink():
        what = f"a symbolic link (to {os.readlink(lock)}), whose target the lock would overwrite"
    elif lock.exists() and not lock.is_file():
        what = "not a regular file (a directory, pipe or device)"
    else:
        return None
    return (f"output_dir {str(directory)!r} holds {LOCK_FILE}, which is {what}; hybridpar keeps its lock there as a "
            f"plain file: remove {lock}, or choose another output_dir.")


def _in_use_message(directory: Path, holder: dict) -> str:
    who = f"process {holder.get('pid', '?')} on {holder.get('host', '?')}" if holder else "another process"
    return (f"output_dir {str(directory)!r} is in use by {who} (it holds {directory / LOCK_FILE}); two runs in one "
            "directory would overwrite each other's checkpoints: wait for it to finish, stop it, or choose another "
            "output_dir.")


def _write_problem(path: Path, kind: str) -> str | None:
    """Why this user cannot create or write ``path`` (``kind``: "dir" or "file"), or None."""
    if kind == "dir" and path.is_symlink() and not path.exists():  # a file link is created through
        return f"it is a symbolic link to nothing that exists ({os.readlink(path)}: dangling, or a loop)"
    if kind == "file" and path.is_symlink():  # written through: the file it points to would be overwritten
        return f"it is a symbolic link (to {os.readlink(path)}), and the run would overwrite the file it points to"
    if path.exists() or path.is_symlink():
        if kind == "dir" and not path.is_dir():
            return "it is a file, not a directory"
        if kind == "file" and path.is_dir():
            return "it is a directory, not a file"
        target = path if kind == "dir" else path.parent
        if not (os.access(path, os.W_OK) and os.access(target, os.W_OK | os.X_OK)):
            return f"it is not writable by this user{read_only_note(target)}"
        return _create_problem(target)
    existing = next(p for p in path.absolute().parents if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user{read_only_note(existing)}"
    return _create_problem(existing)


def _create_problem(directory: Path) -> str | None:
    """Why nothing can be created in ``directory`` though access() allows it, or None: root is
    allowed everywhere by access(), and /proc or /sys still refuse. An empty folder made and removed."""
    probe = directory / f".hybridpar-write-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except FileExistsError:
        return None
    except OSError as error:
        return f"{directory} does not let a folder be created in it ({error.strerror or error}; a system file system?)"
    try:
        probe.rmdir()
    except OSError:
        pass
    return None


RUN_MARKERS = (LOCK_FILE, "checkpoints", METRICS_FILE, "tokenizer", "tensorboard", "loss_curve.png")  # what a run writes


def _not_a_run_dir(path: Path) -> str | None:
    """Why ``path`` (an existing directory) is not a place for a run's files, or None."""
    try:
        resolved = path.resolve()
        if resolved == Path(resolved.anchor) or resolved == Path.home().resolve():
            return "it is " + ("the root directory" if resolved == Path(resolved.anchor) else "your home directory")
        if (path / ".git").exists():
            return "it is a source tree (it holds .git)"
        entries = sorted(entry.name for entry in os.scandir(path))
    except (OSError, RuntimeError):
        return None  # unreadable: _write_problem says so
    if not entries or any(name in RUN_MARKERS or re.fullmatch(r"run-\d{3,}", name) for name in entries):
        return None
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    return (f"it already holds files of something else ({shown}) and no hybridpar run (no {LOCK_FILE}, "
            "checkpoints/ or metrics.jsonl)")


def inside_another_run(path: str | Path) -> str | None:
    """Why ``path`` lies where another run deletes: in (or at) a checkpoint's ``step_*`` folder or a run's
    ``checkpoints/``, which retention (``checkpoint.keep``) and ``checkpoint.if_exists=overwrite`` remove whole."""
    for folder in (Path(path).absolute(), *Path(path).absolute().parents):
        where = "it is" if folder == Path(path).absolute() else "it lies in"
        try:
            if (folder / "manifest.json").is_file() and (folder / "run.json").is_file():
                return (f"{where} {quoted(str(folder), 200)}, a checkpoint of a run, which that run's retention "
                        "(checkpoint.keep) or checkpoint.if_exists=overwrite deletes with all it holds")
            if folder.name == "checkpoints" and any((folder.parent / n).exists() for n in (METRICS_FILE, LOCK_FILE)):
                return (f"{where} {quoted(str(folder), 200)}, the checkpoints/ folder of the run in "
                        f"{quoted(str(folder.parent), 200)}, from which that run's retention (checkpoint.keep) or "
                        "checkpoint.if_exists=overwrite deletes")
        except OSError:
            continue
    return None


def check_output_dir(directory: str | Path) -> None:
    """ConfigError unless ``directory`` is a directory this process can write, or can be created,
    and is new, empty or a run directory (module docstring)."""
    path = Path(directory)
    problem = _write_problem(path, "dir")
    fix = "choose a directory you can write"
    if problem is None and (inside := inside_another_run(path)):
        problem, fix = inside, "choose a directory outside every run's checkpoints"
    elif problem is None and path.is_dir():
        problem, fix = _not_a_run_dir(path), "choose a new or empty directory (or a subfolder of this one)"
    if problem:
        raise ConfigError(f"output_dir={quoted(str(directory))} cannot hold the run: {problem}; {fix}, e.g. "
                          "output_dir=runs/my-run.")


def run_paths(config: RunConfig) -> list[tuple[str, Path, str]]:
    """``(key, path, "dir" | "file")`` of everything a run writes."""
    out = Path(config.output_dir)
    paths = [("output_dir", out, "dir"), ("output_dir (its checkpoints/)", out / "checkpoints", "dir"),
             ("output_dir (its metrics.jsonl)", out / METRICS_FILE, "file")]
    if config.tensorboard:
        paths.append(("tensorboard=true (output_dir/tensorboard/)", out / "tensorboard", "dir"))
    if config.plot:
        paths.append(("plot=true (output_dir/loss_curve.png)", out / "loss_curve.png", "file"))
    if config.data.tokenizer == "bpe":
        paths.append(("data.tokenizer=bpe (output_dir/tokenizer/)", out / "tokenizer", "dir"))
    if config.model.export_hf:
        target = Path(config.model.export_hf)
        paths += [("model.export_hf", target, "dir"), ("model.export_hf (staged beside it)", target.absolute().parent,
                                                          "dir")]
    return paths


def check_run_paths(config: RunConfig) -> None:
    """ConfigError naming the key of the first path the run will write that it cannot (module docstring)."""
    check_output_dir(config.output_dir)
    if problem := lock_file_problem(Path(config.output_dir)):
        raise ConfigError(problem)
    for key, path, kind in run_paths(config):
        problem = _write_problem(path, kind)
        if problem:
            raise ConfigError(f"{key}: {quoted(str(path))} cannot be written: {problem}; the run would fail there "
                              "after training. Choose paths you can write (output_dir=..., model.export_hf=...), or "
                              "move what is in the way.")


def check_lock_free(directory: str | Path) -> None:
    """ConfigError if another process holds the lock of ``directory`` (this process may hold it)."""
    directory = Path(directory)
    path = directory / LOCK_FILE
    if not path.is_file() or str(directory.resolve()) in OutputDirLock._held:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        raise ConfigError(_in_use_message(directory, _read_holder(fd))) from None
    finally:
        os.close(fd)
