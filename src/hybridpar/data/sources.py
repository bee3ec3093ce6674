"""Built-in data: a byte tokenizer, synthetic long-range memory tasks, and text files.

Every source returns documents in the form ``pack_documents`` / ``collate_padded`` take:
a token list (labels are the next tokens), or ``{"input_ids": [...], "labels": [...]}`` with
labels already shifted (``labels[t]`` is the target predicted at position ``t``, -100 where
there is none). Nothing is downloaded.

- ``ByteTokenizer`` (defined in ``data/tokenizers.py`` with the other tokenizers): token id =
  byte value, vocabulary 256, so the tiny model (vocab 256) trains on raw text.
- ``MQARTask``: multi-query associative recall (Zoology): key-value pairs, then the keys
  queried again far later; the target is the bound value. ``SelectiveCopyTask``: content
  tokens scattered among blanks, then a separator; the target is the content in order.
  Both draw variable-length documents from a seeded generator and keep every id below
  ``vocab_size``; ``answer_accuracy`` scores a model on the answer positions.
- ``text_documents``, ``jsonl_documents``: local files through any tokenizer (bytes by
  default; see ``data/tokenizers.py`` for how documents get BOS/EOS). Chat and
  prompt/completion files are in ``data/chat.py``, Hugging Face ``datasets`` in
  ``data/hf_datasets.py``.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from hybridpar.config_rules import Notice, quoted, wide_encoding
from hybridpar.data.packing import IGNORE_INDEX
from hybridpar.data.tokenizers import ByteTokenizer, as_tokenizer
from hybridpar.strict_json import ARRAY_FILE, not_an_object, loads as strict_loads

__all__ = [
    "ByteTokenizer",
    "MQARTask",
    "SelectiveCopyTask",
    "TASKS",
    "answer_counts",
    "prediction_counts",
    "answer_accuracy",
    "text_documents",
    "jsonl_documents",
    "read_jsonl",
]


def _lengths_problem(min_len: int, max_len: int) -> str | None:  # min_len > max_len was told to raise min_len
    return None if min_len <= max_len else (f"min_len={min_len} is above max_len={max_len} (a document's length is "
                                            f"drawn from [min_len, max_len]); lower min_len or raise max_len to {min_len}.")


def _range(value: int | tuple[int, int], name: str) -> tuple[int, int]:
    low, high = (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))
    if low < 1 or high < low:
        raise ValueError(f"{name}={quoted(value)} must be a positive int or an inclusive range (low, high) with low <= high.")
    return low, high


@dataclass
class MQARTask:
    """Multi-query associative recall with variable-length documents.

    A document of length ``L`` (uniform in ``[min_len, max_len]``) is ``k1 v1 ... kn vn``
    (``n`` uniform in ``num_kv_pairs``, keys distinct) followed by a query region where
    ``num_queries`` of the pairs reappear as ``k v`` at uniformly random pair slots, blanks
    (``filler="blank"``) or random non-key tokens (``"random"``) elsewhere. The label at a
    query key is its value; -100 everywhere else. Ids: 0 pad, 1 blank, keys then values split
    the rest of ``[2, vocab_size)`` in half.
    """

    vocab_size: int = 256
    num_kv_pairs: int | tuple[int, int] = (4, 16)
    num_queries: int | None = None  # None: every pair is queried
    min_len: int = 128
    max_len: int = 512
    seed: int = 0
    filler: str = "blank"

    PAD = 0
    BLANK = 1

    def __post_init__(self) -> None:
        self.pairs = _range(self.num_kv_pairs, "num_kv_pairs")
        self.num_keys = (self.vocab_size - 2) // 2
        queries = self.pairs[1] if self.num_queries is None else self.num_queries
        if self.num_queries is not None and not 1 <= self.num_queries <= self.pairs[0]:
            raise ValueError(f"num_queries={self.num_queries} must be in [1, min num_kv_pairs={self.pairs[0]}].")
        if self.num_keys < self.pairs[1]:
            raise ValueError(
                f"vocab_size={self.vocab_size} leaves {self.num_keys} distinct keys, fewer than num_kv_pairs up to "
                f"{self.pairs[1]}; raise vocab_size to at least {2 * self.pairs[1] + 2}."
            )
        if not 2 * self.pairs[1] + 2 * queries <= self.min_len <= self.max_len:
            raise ValueError(_lengths_problem(self.min_len, self.max_len) or (
                f"need 2*pairs + 2*queries = {2 * self.pairs[1] + 2 * queries} <= min_len={self.min_len} <= "
                f"max_len={self.max_len}; raise min_len (and max_len) or lower num_kv_pairs.")
            )
        if self.filler not in ("blank", "random"):
            raise ValueError(f"filler={quoted(self.filler)} must be 'blank' or 'random'.")

    def sample(self, rng: np.random.Generator) -> dict[str, list[int]]:
        """One document from ``rng``."""
        length = int(rng.integers(self.min_len, self.max_len + 1))
        pairs = int(rng.integers(self.pairs[0], self.pairs[1] + 1))
        queries = pairs if self.num_queries is None else self.num_queries
        keys = 2 + rng.choice(self.num_keys, size=pairs, replace=False)
        values = 2 + self.num_keys + rng.integers(0, self.vocab_size - 2 - self.num_keys, size=pairs)
        tokens = np.full(length, self.BLANK, dtype=np.int64)
        if self.filler == "random":  # values only, so no stray key can be mistaken for a query
            tokens[:] = 2 + self.num_keys + rng.integers(0, self.vocab_size - 2 - self.num_keys, size=length)
        labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
        tokens[0:2 * pairs:2], tokens[1:2 * pairs:2] = keys, values
        slots = np.sort(rng.choice((length - 2 * pairs) // 2, size=queries, replace=False))
        asked = rng.choice(pairs, size=queries, replace=False)
        at = 2 * pairs + 2 * slots  # query key positions
        tokens[at], tokens[at + 1], labels[at] = keys[asked], values[asked], values[asked]
        return {"input_ids": tokens.tolist(), "labels": labels.tolist()}

    def documents(self, num_docs: int) -> list[dict[str, list[int]]]:
        """``num_docs`` documents; the same seed gives the same documents."""
        rng = np.random.default_rng(self.seed)
        return [self.sample(rng) for _ in range(num_docs)]


@dataclass
class SelectiveCopyTask:
    """Selective copying (Mamba paper) with variable-length documents.

    A document of length ``L`` (uniform in ``[min_len, max_len]``) holds ``n`` content tokens
    (``n`` uniform in ``num_tokens``) at random places among blanks, a separator, then the
    ``n`` tokens again in order. The label at the separator is the first content token and at
    each copied token the next one (-100 after the last). Ids: 0 pad, 1 blank, 2 separator,
    content in ``[3, vocab_size)``.
    """

    vocab_size: int = 256
    num_tokens: int | tuple[int, int] = (4, 16)
    min_len: int = 128
    max_len: int = 512
    seed: int = 0

    PAD = 0
    BLANK = 1
    SEP = 2

    def __post_init__(self) -> None:
        self.tokens = _range(self.num_tokens, "num_tokens")
        if self.vocab_size < 4:
            raise ValueError(f"vocab_size={self.vocab_size} leaves no content ids; use at least 4.")
        if not 2 * self.tokens[1] + 1 <= self.min_len <= self.max_len:
            raise ValueError(_lengths_problem(self.min_len, self.max_len) or (
                f"need 2*num_tokens + 1 = {2 * self.tokens[1] + 1} <= min_len={self.min_len} <= max_len={self.max_len}; "
                "raise min_len (and max_len) or lower num_tokens.")
            )

    def sample(self, rng: np.random.Generator) -> dict[str, list[int]]:
        """One document from ``rng``."""
        length = int(rng.integers(self.min_len, self.max_len + 1))
        count = int(rng.integers(self.tokens[0], self.tokens[1] + 1))
        context = length - 1 - count
        content = 3 + rng.integers(0, self.vocab_size - 3, size=count)
        tokens = np.full(length, self.BLANK, dtype=np.int64)
        tokens[np.sort(rng.choice(context, size=count, replace=False))] = content
        tokens[context], tokens[context + 1:] = self.SEP, content
        labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
        labels[context:length - 1] = content  # separator -> c1, c_j -> c_{j+1}
        return {"input_ids": tokens.tolist(), "labels": labels.tolist()}

    def documents(self, num_docs: int) -> list[dict[str, list[int]]]:
        """``num_docs`` documents; the same seed gives the same documents."""
        rng = np.random.default_rng(self.seed)
        return [self.sample(rng) for _ in range(num_docs)]


TASKS = {"mqar": MQARTask, "selective_copy": SelectiveCopyTask}


def answer_counts(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """``(correct, total)`` int64 scalars over positions with a label (argmax == label).

    ``logits`` ``[..., V]`` and ``labels`` with the same leading shape (``[B, S]``, ``[T]``, ...);
    sum them over ranks before dividing. Training and evaluation never build the logits: they
    take the predictions from ``model(..., labels=..., return_predictions=True)`` and call
    ``prediction_counts``.
    """
    if logits.shape[:-1].numel() != labels.numel():
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} cover different token counts; pass the "
            "labels of the same (local) tokens."
        )
    return prediction_counts(logits.argmax(dim=-1), labels, ignore_index)


def prediction_counts(predictions: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """``(correct, total)`` int64 scalars: positions with a label where the predicted id equals it.

    ``predictions`` (argmax token ids) and ``labels`` cover the same tokens in any shape.
    """
    if predictions.numel() != labels.numel():
        raise ValueError(
            f"predictions {tuple(predictions.shape)} and labels {tuple(labels.shape)} cover different token counts; "
            "pass the labels of the same (local) tokens."
        )
    labels = labels.reshape(-1).to(predictions.device)  # [N]
    answered = labels != ignore_index
    correct = (predictions.reshape(-1) == labels) & answered
    return correct.sum(), answered.sum()


def answer_accuracy(logits: Tensor, batch: Mapping[str, Any] | Tensor) -> float:
    """Fraction of answer positions (labels != -100) where the argmax is the label."""
    labels = batch["labels"] if isinstance(batch, Mapping) else batch
    correct, total = answer_counts(logits, labels)
    if int(total) == 0:
        raise ValueError("the batch has no answer positions (every label is -100); accuracy is undefined.")
    return int(correct) / int(total)


def _paths(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    found = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    missing = [str(p) for p in found if not p.is_file()]
    if missing or not found:
        raise ValueError(f"files not found: {missing or 'none given'}; pass paths of existing local files.")
    return found


TEXT_SPLITS = ("paragraph", "line", "file")
BLANK_LINES = re.compile(r"\n(?:[^\S\n]*\n)+")  # a line of spaces was no separator, a third newline led the next paragraph
_JSON_KINDS = {int: "number", float: "number", bool: "boolean", list: "array", dict: "object"}


def read_text_file(path: Path) -> str:
    """A file's text as UTF-8 (``\\r\\n`` and ``\\r`` read as ``\\n``, a leading BOM dropped); a ValueError names the
    file, line and byte."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        wide = wide_encoding(data)
        if wide:  # not binary: text in another Unicode encoding (Windows editors save "Unicode" as UTF-16)
            raise ValueError(f"{path}: the file is {wide} text (it starts with the {wide} byte-order mark), not UTF-8; "
                             f"convert it (e.g. iconv -f {wide} -t utf-8 in > out) and point data.path at the copy.") from None
        line = data.count(b"\n", 0, error.start) + 1
        looks = "looks binary" if b"\0" in data[:8192] else "is not UTF-8 text"
        raise ValueError(
            f"{path}:{line}: byte {error.start} (0x{data[error.start]:02x}) is not UTF-8; the file {looks}: convert it "
            "to UTF-8 (e.g. iconv -f latin1 -t utf-8) or point data.path at a text file."
        ) from None
    # a byte-order mark (Windows editors) is not text; a lone CR (classic Mac OS) ends a line too, as in Python's text mode
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def _document_at(tokenizer, text: str, path, line: int, add_bos: bool | None, add_eos: bool | None) -> list[int]:
    """``tokenizer.document(text)`` for text that starts at ``line`` of ``path``; errors name the line."""
    try:
        return tokenizer.document(text, add_bos, add_eos)
    except ValueError as error:
        if not isinstance(tokenizer, ByteTokenizer):
            raise ValueError(f"{path}:{line}: {error}") from None
        data = text.encode("utf-8")
        reserved = bytes((tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id))
        at = next((i for i, b in enumerate(data) if b in reserved), None)
        if at is None:
            raise ValueError(f"{path}:{line}: {error}") from None
        line += data.count(b"\n", 0, at)
        raise ValueError(
            f"{path}:{line}: contains the control byte {data[at]} (NUL, STX and ETX mark "
            "padding and document ends; a NUL usually means a binary file); remove those bytes or point data.path at "
            "a text file."
        ) from None


def _text_parts(text: str, split: str) -> list[tuple[int, str]]:
    """``(first line number, text)`` of each document of ``text`` under ``split``."""
    if split == "file":
        return [(1, text)]
    if split == "line":
        return [(number, line) for number, line in enumerate(text.split("\n"), start=1)]
    parts, line, start = [], 1, 0
    for gap in [*BLANK_LINES.finditer(text), None]:  # paragraphs: separated by blank (or whitespace-only) lines
        part = text[start:gap.start() if gap else len(text)]
        parts.append((line, part))
        if gap:
            line, start = line + part.count("\n") + gap.group().count("\n"), gap.end()
    return parts


def text_documents(
    paths: str | Path | Iterable[str | Path],
    split: str = "file",
    tokenizer=None,
    add_bos: bool | None = None,
    add_eos: bool | None = None,
) -> list[list[int]]:
    """Documents from plain UTF-8 text files: one per file (``"file"``), per non-empty line
    (``"line"``) or per blank-line-separated paragraph (``"paragraph"``). ``tokenizer``: anything
    ``as_tokenizer`` takes (None = bytes); ``add_bos``/``add_eos`` as in ``Tokenizer.document``.
    Errors name the file and line."""
    if split not in TEXT_SPLITS:
        raise ValueError(f"split={quoted(split)} must be one of {list(TEXT_SPLITS)}.")
    tokenizer = as_tokenizer(tokenizer)
    docs = []
    for path in _paths(paths):
        text = read_text_file(path)
        if (record := _first_json_object(text)) is not None:  # the braces, quotes and keys would be trained on
            warnings.warn(f"{path}: its first line is a JSON object (keys {quoted(sorted(record), 80)}), and a text task "
                          "trains on the JSON syntax too (braces, quotes, keys); for the records' text use "
                          f"data.task={record_task(record)}.", Notice, stacklevel=2)
        for line, part in _text_parts(text, split):
            if part.strip():
                docs.append(_document_at(tokenizer, part, path, line, add_bos, add_eos))
    return docs


def _first_json_object(text: str) -> dict | None:
    """The first non-blank line of ``text`` as a JSON object, or None when it is not one."""
    first = next((line for line in text.split("\n", 64)[:64] if line.strip()), "")
    try:
        record = json.loads(first) if first.lstrip().startswith("{") else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def record_task(record: Mapping) -> str:
    """The data task a JSON record is written for: ``chat`` (``messages``), ``prompt_completion`` or ``jsonl``."""
    return "chat" if "messages" in record else "prompt_completion" if {"prompt", "completion"} <= set(record) else "jsonl"


def task_hint(record: Mapping, task: str) -> str:
    """``; it is a <task> record: use data.task=<task>`` when ``record`` is written for another task than ``task``."""
    other = record_task(record)
    return f"; it is a {other} record: use data.task={other}" if other != task else ""


def jsonl_documents(
    paths: str | Path | Iterable[str | Path],
    text_field: str = "text",
    tokenizer=None,
    add_bos: bool | None = None,
    add_eos: bool | None = None,
) -> list[list[int]]:
    """Documents from JSON-lines files, one per record, from its ``text_field`` string.
    Errors name the file and line."""
    tokenizer = as_tokenizer(tokenizer)
    docs = []
    for where, record in read_jsonl(paths):
        if text_field not in record:
            raise ValueError(f"{where} has no string field {quoted(text_field)} (keys: {quoted(sorted(record))})"
                             f"{task_hint(record, 'jsonl')}; pass text_field= (data.task_options.text_field) or fix "
                             "the record.")
        if not isinstance(record[text_field], str):
            value = record[text_field]
            kind = "null" if value is None else f"a JSON {_JSON_KINDS.get(type(value), type(value).__name__)}"
            raise ValueError(f"{where} has no string field {quoted(text_field)}: its value is {kind} "
                             f"({quoted(value, 60)}), not a string; every record's text must be a JSON string: quote "
                             "it, or fix or remove the record.")
        path, line = where.rsplit(":", 1)
        docs.append(_document_at(tokenizer, record[text_field], path, int(line), add_bos, add_eos))
    return docs


def _lone_surrogate(record: dict) -> str | None:
    """The first lone surrogate in ``record``'s text (as ``\\udxxx``), or None."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        return f"\\u{ord(error.object[error.start]):04x}"
    return None


def read_jsonl(paths: str | Path | Iterable[str | Path]) -> Iterator[tuple[str, dict]]:
    """``("file:line", record)`` for every non-empty line; ValueError naming the line otherwise."""
    for path in _paths(paths):
        for number, line in enumerate((text := read_text_file(path)).split("\n"), start=1):
            if not line.strip():
                continue
            try:
                record = strict_loads(line, str(path), number)  # a key written twice: refused
            except (json.JSONDecodeError, RecursionError) as error:  # RecursionError: nested too deep
                raise ValueError(
                    f"{path}:{number}: not valid JSON ("
                    f"{getattr(error, 'msg', 'nested too deeply to read')} at column {getattr(error, 'colno', 1)}); "
                    "every line must be one JSON object"
                    f"{ARRAY_FILE if number == 1 and line.lstrip().startswith('[') else ': fix or remove that line'}."
                ) from None
            if not isinstance(record, dict):
                raise ValueError(not_an_object(path, number, record, more_lines="\n" in text.strip()))
            if "\\ud" in line.lower() and (surrogate := _lone_surrogate(record)):  # JSON escapes any code unit
                raise ValueError(f"{path}:{number}: holds a lone surrogate escape ({surrogate}), half of "
                                 "a UTF-16 pair and not a character; fix or remove that record.")
            yield f"{path}:{number}", record
