"""The Python standard library's own source files as a text corpus (``data.task: python_stdlib``).

Every Python installation carries its standard library as source (``sysconfig.get_paths()
["stdlib"]``), so a text job needs no download and runs the same way on any machine.
``stdlib_corpus(root, **options)`` reads it:

- **files**: every ``*.py`` under ``root`` (default: the running interpreter's stdlib), except
  under a directory named in ``exclude`` (tests, third-party ``site-packages``, caches) and files
  larger than ``max_file_bytes`` (generated tables such as ``pydoc_data/topics.py``); an empty
  file is no document;
- **order**: by ``sha256("order:" + relative path)``; files are taken in this order until the
  next one would pass ``max_bytes`` of text, so a cap samples the whole library, not its
  alphabetical start;
- **held-out split, by file**: a file is held out when
  ``int(sha256("eval:" + relative path)[:8], 16) / 2**32 < eval_fraction``. The split depends on
  the file's own path only (not on the cap or on which other files exist), and no held-out
  file's text is ever trained on, the tokenizer included.

One document per file: a module is the unit its author wrote (imports, then definitions that
refer to each other), and it needs no parser. The packer cuts files longer than a pack into
pack-sized pieces; a split piece still predicts the first token of the next one.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from hybridpar.config_rules import did_you_mean, quoted
from hybridpar.data.sources import read_text_file

__all__ = ["STDLIB_OPTIONS", "SourceFile", "StdlibCorpus", "stdlib_root", "check_stdlib_options", "stdlib_corpus"]

STDLIB_OPTIONS = {  # data.task_options of python_stdlib, with their defaults
    "max_bytes": 4_000_000,  # text read at most (train + held-out): BPE training stays a few seconds
    "max_file_bytes": 65_536,  # larger files are skipped
    "eval_fraction": 0.1,  # of the files, held out for evaluation
    "exclude": ["test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"],
}


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the corpus root, '/'-separated
    text: str


@dataclass(frozen=True)
class StdlibCorpus:
    root: Path
    train: list[SourceFile]
    held_out: list[SourceFile]

    def fingerprint(self) -> str:
        """sha256 of the training files' paths and texts (what a tokenizer trained on them saw)."""
        digest = hashlib.sha256()
        for file in self.train:
            digest.update(file.path.encode() + b"\0" + file.text.encode() + b"\0")
        return digest.hexdigest()


def stdlib_root(path: str | Path | None = None) -> Path:
    """``path`` (a directory of Python files) or the running interpreter's standard library."""
    root = Path(path) if path is not None else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"data.path={quoted(str(path))} is not a directory; data.task='python_stdlib' reads the .py files "
                         "under a directory: leave data.path null for this Python's standard library, or name one.")
    return root


def check_stdlib_options(options: dict) -> dict:
    """``options`` over the defaults; ValueError naming the option, the rule and the fix."""
    unknown = sorted(set(options) - set(STDLIB_OPTIONS))
    if unknown:
        raise ValueError(f"data.task_options {unknown} do not apply to data.task='python_stdlib'"
                         f"; its options are {STDLIB_OPTIONS} (shown with their defaults); remove the others"
                         f"{did_you_mean(unknown[0], STDLIB_OPTIONS, end='.')}")
    merged = {**STDLIB_OPTIONS, **options}
    for key in ("max_bytes", "max_file_bytes"):
        if not isinstance(merged[key], int) or isinstance(merged[key], bool) or merged[key] < 1:
            raise ValueError(f"data.task_options.{key}={quoted(merged[key])} is invalid: it must be an integer >= 1; e.g. "
                             f"{key}={STDLIB_OPTIONS[key]} (the default).")
    fraction = merged["eval_fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise ValueError(f"data.task_options.eval_fraction={quoted(fraction)} is invalid: it must be a number in [0, 1); "
                         "e.g. eval_fraction=0.1 (the default).")
    if not isinstance(merged["exclude"], (list, tuple)) or not all(isinstance(x, str) for x in merged["exclude"]):
        raise ValueError(f"data.task_options.exclude={quoted(merged['exclude'])} is invalid: it must be a list of directory "
                         f"names; e.g. exclude={STDLIB_OPTIONS['exclude']} (the default).")
    return merged


def _hash_fraction(tag: str, path: str) -> float:
    return int(hashlib.sha256(f"{tag}:{path}".encode()).hexdigest()[:8], 16) / 2**32


def stdlib_corpus(root: str | Path | None = None, **options) -> StdlibCorpus:
    """The training and held-out files (module docstring); ValueError if no file is left to train on."""
    options = check_stdlib_options(options)
    root = stdlib_root(root)
    excluded = set(options["exclude"])
    candidates = []
    for file in root.rglob("*.py"):
        relative = file.relative_to(root)
        if excluded & set(relative.parts[:-1]) or not file.is_file():
            continue
        size = file.stat().st_size
        if 0 < size <= options["max_file_bytes"]:
            candidates.append((_hash_fraction("order", relative.as_posix()), relative.as_posix(), file))
    train, held_out, total = [], [], 0
    for _, relative, file in sorted(candidates):
        text = read_text_file(file)
        if not text.strip():
            continue
        total += len(text.encode("utf-8"))
        if total > options["max_bytes"]:
            break
        split = held_out if _hash_fraction("eval", relative) < options["eval_fraction"] else train
        split.append(SourceFile(relative, text))
    if not train:
        raise ValueError(f"data.task='python_stdlib' found no training file under {root} (.py files of 1 to "
                         f"max_file_bytes={options['max_file_bytes']} bytes, not under {sorted(excluded)}, within "
                         f"max_bytes={options['max_bytes']}); point data.path at a directory of Python files or raise "
                         "the limits.")
    return StdlibCorpus(root, train, held_out)
