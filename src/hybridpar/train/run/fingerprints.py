"""Content fingerprints of a run's data sources, recorded in every checkpoint's run.json.

    data.path          a file: its sha256 and size; a directory (a saved ``datasets`` dataset):
                       the sha256 of every file's relative path and sha256, in path order;
                       python_stdlib: the paths and texts of the files it reads (train and held out)
    data.tokenizer     a tokenizer directory (given, or model.hf_path's own under ``auto``):
                       the same directory fingerprint over its tokenizer files

A resumed run compares them with the checkpoint's (``resume.plan_resume``): an edited
file changes the batches even when its size does not. ``data.on_change`` decides:
``refuse`` (default) stops naming the file and the fix, ``warn`` prints one notice and
continues (the next checkpoint records the new content). Hashes are remembered per file
size and mtime within a process (``checkpoint.file_sha256``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from hybridpar.config import RunConfig
from hybridpar.config_rules import quoted
from hybridpar.data.documents import FILE_TASKS
from hybridpar.data.tokenizers import ships_tokenizer
from hybridpar.models.hf.files import TOKENIZER_FILES
from hybridpar.train.run.checkpoint import file_sha256

__all__ = ["data_sources", "source_changes", "moved_sources"]


def _directory_fingerprint(root: Path, files: list[Path]) -> dict:
    digest, total = hashlib.sha256(), 0
    for file in sorted(files):
        digest.update(f"{file.relative_to(root).as_posix()}\0{file_sha256(file)}\0".encode())
        total += file.stat().st_size
    return {"path": str(root), "files": len(files), "bytes": total, "sha256": digest.hexdigest()}


def _path_fingerprint(path: Path) -> dict | None:
    if path.is_file():
        return {"path": str(path), "bytes": path.stat().st_size, "sha256": file_sha256(path)}
    if path.is_dir():
        return _directory_fingerprint(path, [p for p in path.rglob("*") if p.is_file()])
    return None


def _stdlib_fingerprint(config: RunConfig) -> dict:
    from hybridpar.data.stdlib import stdlib_corpus

    corpus = stdlib_corpus(config.data.path, **config.data.task_options)
    digest = hashlib.sha256()
    for file in corpus.train + corpus.held_out:
        digest.update(file.path.encode() + b"\0" + file.text.encode() + b"\0")
    return {"path": str(corpus.root), "files": len(corpus.train) + len(corpus.held_out), "sha256": digest.hexdigest()}


def data_sources(config: RunConfig) -> dict:
    """``{"data.path": ..., "data.tokenizer": ...}`` fingerprints of what this run reads (empty
    for a synthetic task)."""
    data, sources = config.data, {}
    if data.task not in FILE_TASKS:
        return sources
    if data.task == "python_stdlib":
        sources["data.path"] = _stdlib_fingerprint(config)
    elif data.path:
        found = _path_fingerprint(Path(data.path))
        if found is not None:
            sources["data.path"] = found
    tokenizer = data.tokenizer if data.tokenizer not in ("auto", "bytes", "bpe") else \
        config.model.hf_path if data.tokenizer == "auto" and ships_tokenizer(config.model.hf_path) else None
    if tokenizer and Path(tokenizer).is_dir():
        root = Path(tokenizer)
        sources["data.tokenizer"] = _directory_fingerprint(root, [root / n for n in TOKENIZER_FILES if (root / n).is_file()])
    return sources


def _describe(source: dict | None) -> str:
    if source is None:
        return "nothing"
    size = f", {source['bytes']:,} bytes" if "bytes" in source else ""
    return f"sha256 {source['sha256'][:12]}{size}"


def source_changes(recorded: dict | None, current: dict, legacy_file_bytes: int | None = None) -> list[str]:
    """One phrase per data source whose content differs from the recorded one. A checkpoint of
    an older hybridpar records only ``file_bytes`` (the size of data.path), compared as such."""
    if recorded is None:
        now = current.get("data.path", {}).get("bytes")
        if legacy_file_bytes is not None and now is not None and now != legacy_file_bytes:
            return [f"data.path={quoted(current['data.path']['path'])} has {now:,} bytes, the checkpoint recorded "
                    f"{legacy_file_bytes:,}"]
        return []
    changes = []
    for key in sorted(set(recorded) | set(current)):
        before, after = recorded.get(key), current.get(key)
        if (before or {}).get("sha256") != (after or {}).get("sha256"):
            where = quoted((after or before)["path"])
            changes.append(f"{key}={where} changed ({_describe(before)} when saved -> {_describe(after)} now)")
    return changes


def moved_sources(recorded: dict, current: dict, recorded_sources: dict | None, notes: list[str]) -> tuple[str, ...]:
    """The data keys (``path``, ``tokenizer``) whose source moved to another path with the same content
    (sha256): the batches are the same, so resuming is exact; one note each is appended to ``notes``."""
    moved = []
    for key in ("path", "tokenizer"):
        before, after = (recorded_sources or {}).get(f"data.{key}"), current.get("sources", {}).get(f"data.{key}")
        if recorded.get(key) != current.get(key) and before and after and before["sha256"] == after["sha256"]:
            moved.append(key)
            notes.append(f"data.{key} moved from {quoted(recorded.get(key))} to {quoted(current.get(key))} with the "
                         f"same content ({_describe(after)}); resuming on it")
    return tuple(moved)
