"""JSON read strictly: an object that writes a key twice is refused, not read as its last value.

Python's ``json`` (and transformers, safetensors and tokenizers behind it) keeps the last of two
equal keys without a word, so ``{"text": "a", "text": "b"}`` trains on ``"b"`` and a
``config.json`` or shard index with a key written twice loads one of two values silently. Every
JSON file hybridpar reads that a person or another program wrote (data lines, checkpoint,
tokenizer and adapter files, a run's own records) goes through ``loads``/``load_file``: the
error names the file, the line and the key and says to keep one.

Such a file is read whole, so ``read_bounded`` (behind ``load_file``) first refuses one that is not a
regular file (a FIFO blocks, a link to ``/dev/zero`` never ends: memory grew until the process was
killed) or larger than its cap, in one line naming it; ``check_files`` does so for every file read from
a checkpoint or tokenizer directory, before transformers or tokenizers opens one. Lowest floor:
anything may import it.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

from hybridpar.config_rules import quoted, shorten

__all__ = ["DuplicateKeyError", "FileRefused", "METADATA_BYTES", "VOCABULARY_BYTES", "TOKENIZER_FILES", "TEMPLATE_DIR",
           "file_kind", "check_readable", "read_bounded", "check_files", "loads", "load_file", "pairs_hook",
           "check_no_duplicate_keys", "check_json_data_file"]

METADATA_BYTES = 64 * 2**20  # config, generation, index, adapter and tokenizer settings: KBs to a few MB
VOCABULARY_BYTES = 256 * 2**20  # tokenizer.json, vocab and merges, sentencepiece models: tens of MB at most
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
TOKENIZER_FILES = (  # a checkpoint's files beside its weights and config.json, which an export copies
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "generation_config.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
)
TEMPLATE_DIR = "additional_chat_templates"  # transformers 5 saves named extra templates here
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model")
READ_FILES = ("config.json", "model.safetensors.index.json", "adapter_config.json", *TOKENIZER_FILES)


class DuplicateKeyError(ValueError):
    """A JSON object writes ``key`` twice (``where``: the file, with its line when known)."""

    def __init__(self, key: str, where: str = "", line: int | None = None):
        self.key, self.where, self.line = key, where, line
        at = f"{where}:{line}" if where and line else where
        super().__init__(
            f"{at + ': ' if at else ''}the key {quoted(key)} is written twice in one JSON object; JSON readers keep "
            "only the last value without a word, so the other would be dropped: keep one of them (or rename it).")


class FileRefused(ValueError):
    """A file hybridpar reads whole that is not a regular file, or larger than its cap (one line naming it)."""


def file_kind(path: str | Path) -> str | None:
    """What ``path`` is, after links, when it is there but not a regular file ("a FIFO (named pipe)", "a
    character device", "a directory", ...); None for a regular file or nothing there."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return None if stat.S_ISREG(mode) else next((kind for test, kind in _KINDS if test(mode)), "not a file")


def check_readable(path: str | Path, limit: int | None = METADATA_BYTES) -> None:
    """FileRefused when ``path`` is there but not a regular file, or (``limit`` not None) has more than
    ``limit`` bytes; a missing file is left to its reader."""
    if kind := file_kind(path):
        link = f" (a link to {shorten(os.path.realpath(path), 300)})" if os.path.islink(path) else ""
        why = "" if kind == "a directory" else " (it is read whole: a pipe blocks, a device never ends)"
        raise FileRefused(f"{shorten(path, 600)} is {kind}{link}, not a regular file{why}; put the file itself there "
                          "(a link to a regular file is fine).")
    if limit is not None and os.path.isfile(path) and (size := os.stat(path).st_size) > limit:
        raise FileRefused(_too_large(path, limit, size))


def _too_large(path, limit: int, size: int | None = None) -> str:
    return (f"{shorten(path, 600)} has {f'{size:,} bytes, ' if size else ''}more than the {limit:,} bytes a file of "
            "that name can have (it is read whole: is it another file?); put the checkpoint's own file there.")


def read_bounded(path: str | Path, limit: int = METADATA_BYTES) -> bytes:
    """The bytes of regular file ``path`` (``check_readable``), at most ``limit`` of them (FileRefused past it)."""
    check_readable(path, limit)
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:  # it grew after the check
        raise FileRefused(_too_large(path, limit))
    return data


def check_files(directory: str | Path) -> None:
    """FileRefused for the first file of ``directory`` read from it (``READ_FILES``, the templates in
    ``TEMPLATE_DIR``, safetensors weights) that is there but not a regular file, or larger than its cap
    (``VOCABULARY_BYTES`` for a vocabulary, ``METADATA_BYTES`` for other settings, none for weights)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for name in READ_FILES:
        check_readable(directory / name, VOCABULARY_BYTES if name in VOCABULARY_FILES else METADATA_BYTES)
    if (directory / TEMPLATE_DIR).is_dir():
        for template in sorted((directory / TEMPLATE_DIR).iterdir()):
            check_readable(template)
    for weights in sorted(directory.glob("*.safetensors")):
        check_readable(weights, None)


def pairs_hook(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook`` for ``json.loads``: the object as a dict, DuplicateKeyError on a repeated key."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def _line_of_second(text: str, key: str) -> int | None:
    """The line of the second ``"key":`` in ``text`` when the key is written as a key exactly twice
    (then it is the repeated one), else None: a line is named only when it is certain."""
    found = [m.start() for m in re.finditer(re.escape(json.dumps(key)) + r"\s*:", text)]
    return text.count("\n", 0, found[1]) + 1 if len(found) == 2 else None


def loads(text: str | bytes, where: str = "", line: int | None = None):
    """``json.loads(text)``, refusing a key written twice in one object (DuplicateKeyError naming
    ``where`` and ``line``: given for a JSON-lines record, found in ``text`` otherwise when certain).
    Other errors are ``json.loads``' own (JSONDecodeError, also for an integer longer than Python converts;
    RecursionError)."""
    try:
        return json.loads(text, object_pairs_hook=pairs_hook)
    except DuplicateKeyError as error:
        if line is None and isinstance(text, str):
            line = _line_of_second(text, error.key)
        raise DuplicateKeyError(error.key, where, line) from None
    except ValueError as error:  # Python's bound on int(str): a bare ValueError that named no file or line
        if isinstance(error, json.JSONDecodeError) or "integer string conversion" not in str(error):
            raise
        digits = sys.get_int_max_str_digits()
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        found = re.search(r"\d{%d,}" % (digits + 1), text)
        raise json.JSONDecodeError(f"an integer of more than {digits} digits", text, found.start() if found else 0) from None


def load_file(path: str | Path, limit: int = METADATA_BYTES):
    """``loads`` of a UTF-8 file read by ``read_bounded``, its errors naming ``path``."""
    return loads(read_bounded(path, limit).decode("utf-8"), str(path))


def check_no_duplicate_keys(directory: str | Path, names) -> None:
    """DuplicateKeyError for the first of the JSON files ``names`` in ``directory`` that writes a key
    twice (files read by transformers or tokenizers, which keep the last value), FileRefused for one
    ``read_bounded`` refuses; a file that is missing or not JSON is left to the library that reads
    it, whose error names it."""
    for name in names:
        file = Path(directory) / name
        try:
            load_file(file, VOCABULARY_BYTES)
        except (DuplicateKeyError, FileRefused):
            raise
        except (OSError, ValueError, RecursionError):
            continue


def check_json_data_file(file: str | Path) -> None:
    """DuplicateKeyError for a JSON data file (one JSON value, or JSON lines: read line by line, so a
    large file is not held twice) that writes a key twice, naming the line; other errors are left to
    the reader (``datasets`` keeps the last value of a JSON value's keys)."""
    file = Path(file)
    if file.suffix != ".jsonl":
        text = file.read_text(encoding="utf-8", errors="replace")
        try:
            loads(text, str(file))
            return
        except DuplicateKeyError:
            raise
        except (ValueError, RecursionError):
            pass  # JSON lines in a .json file, or not JSON: line by line
        del text
    with open(file, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            try:
                loads(line, str(file), number)
            except DuplicateKeyError:
                raise
            except (ValueError, RecursionError):
                continue


ARRAY_FILE = "; the file is one JSON array, not JSON lines: write one object per line (e.g. jq -c '.[]' file.json > file.jsonl)"


def not_an_object(path, number: int, record, more_lines: bool) -> str:
    """The message for line ``number`` of JSON lines file ``path`` that holds ``record``, not a JSON object: a bare
    list of chat messages is a conversation (wrap it), a one-line file of one array of objects is a JSON file (split
    it), a line of objects among more lines is a list per line (one object each)."""
    head = f"{path}:{number} holds a {type(record).__name__}, not a JSON object"
    objects = isinstance(record, list) and record and all(isinstance(r, dict) for r in record)
    if objects and all("role" in r for r in record):  # [{"role": ..., "content": ...}, ...]: one conversation
        return (f"{head}: a conversation as a bare list of messages; data.task=chat reads each line as an object whose "
                "'messages' field holds them: wrap each line (e.g. jq -c '{messages: .}' in.jsonl > out.jsonl).")
    if objects and number == 1 and not more_lines:
        return f"{head}{ARRAY_FILE}."
    if objects:
        return f"{head}: a list of records on one line (the file has more lines); write one JSON object per line."
    return f"{head}; write one JSON object per line."
