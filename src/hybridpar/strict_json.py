"""JSON read strictly: an object that writes a key twice is refused, not read as its last value.

Python's ``json`` (and transformers, safetensors and tokenizers behind it) keeps the last of two
equal keys without a word, so ``{"text": "a", "text": "b"}`` trains on ``"b"`` and a
``config.json`` or shard index with a key written twice loads one of two values silently. Every
JSON file hybridpar reads that a person or another program wrote (data lines, checkpoint,
tokenizer and adapter files, a run's own records) goes through ``loads``/``load_file``: the
error names the file, the line and the key and says to keep one. Lowest floor: anything may
import it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from hybridpar.config_rules import quoted

__all__ = ["DuplicateKeyError", "loads", "load_file", "pairs_hook", "check_no_duplicate_keys", "check_json_data_file"]


class DuplicateKeyError(ValueError):
    """A JSON object writes ``key`` twice (``where``: the file, with its line when known)."""

    def __init__(self, key: str, where: str = "", line: int | None = None):
        self.key, self.where, self.line = key, where, line
        at = f"{where}:{line}" if where and line else where
        super().__init__(
            f"{at + ': ' if at else ''}the key {quoted(key)} is written twice in one JSON object; JSON readers keep "
            "only the last value without a word, so the other would be dropped: keep one of them (or rename it).")


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


def load_file(path: str | Path):
    """``loads`` of a UTF-8 file, its errors naming ``path``."""
    return loads(Path(path).read_text(encoding="utf-8"), str(path))


def check_no_duplicate_keys(directory: str | Path, names) -> None:
    """DuplicateKeyError for the first of the JSON files ``names`` in ``directory`` that writes a key
    twice (files read by transformers or tokenizers, which keep the last value); a file that is
    missing or not JSON is left to the library that reads it, whose error names it."""
    for name in names:
        file = Path(directory) / name
        try:
            load_file(file)
        except DuplicateKeyError:
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
