"""Built-in data: a byte tokenizer, synthetic long-range memory tasks, and text files.

Every source returns documents in the form ``pack_documents`` / ``collate_padded`` take:
a token list (labels are the next tokens), or ``{"input_ids": [...], "labels": [...]}`` with
labels already shifted (``labels[t]`` is the target predicted at position ``t``, -100 where
there is none). Nothing is downloaded.

- ``ByteTokenizer``: token id = byte value, vocabulary 256, so the tiny model (vocab 256)
  trains on raw text. The specials are ASCII control codes: pad = NUL (0), bos = STX (2),
  eos = ETX (3). Text that contains those bytes is rejected (or, with ``errors="drop"``,
  stripped), so a special never stands for content.
- ``MQARTask``: multi-query associative recall (Zoology): key-value pairs, then the keys
  queried again far later; the target is the bound value. ``SelectiveCopyTask``: content
  tokens scattered among blanks, then a separator; the target is the content in order.
  Both draw variable-length documents from a seeded generator and keep every id below
  ``vocab_size``; ``answer_accuracy`` scores a model on the answer positions.
- ``text_documents``, ``jsonl_documents``: local files through the byte tokenizer;
  ``hf_documents``: Hugging Face ``datasets`` on local files (optional dependency).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from hybridpar.data.packing import IGNORE_INDEX

__all__ = [
    "ByteTokenizer",
    "MQARTask",
    "SelectiveCopyTask",
    "TASKS",
    "answer_counts",
    "answer_accuracy",
    "text_documents",
    "jsonl_documents",
    "hf_documents",
]


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256); pad/bos/eos are the control bytes NUL/STX/ETX."""

    pad_id: int = 0
    bos_id: int = 2
    eos_id: int = 3
    vocab_size: int = 256
    errors: str = "raise"  # or "drop": strip the reserved control bytes from the text

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = True) -> list[int]:
        data = text.encode("utf-8")
        reserved = bytes((self.pad_id, self.bos_id, self.eos_id))
        if any(b in data for b in reserved):
            if self.errors != "drop":
                at = next(i for i, b in enumerate(data) if b in reserved)
                raise ValueError(
                    f"text contains reserved control byte {data[at]} (pad/bos/eos) at byte {at}; strip it or use "
                    "ByteTokenizer(errors='drop')."
                )
            data = bytes(b for b in data if b not in reserved)
        return [self.bos_id] * add_bos + list(data) + [self.eos_id] * add_eos

    def decode(self, ids: Iterable[int]) -> str:
        specials = {self.pad_id, self.bos_id, self.eos_id}
        return bytes(int(i) for i in ids if int(i) not in specials).decode("utf-8", errors="replace")


def _range(value: int | tuple[int, int], name: str) -> tuple[int, int]:
    low, high = (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))
    if low < 1 or high < low:
        raise ValueError(f"{name}={value!r} must be a positive int or an inclusive range (low, high) with low <= high.")
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
            raise ValueError(
                f"need 2*pairs + 2*queries = {2 * self.pairs[1] + 2 * queries} <= min_len={self.min_len} <= "
                f"max_len={self.max_len}; raise min_len or lower num_kv_pairs."
            )
        if self.filler not in ("blank", "random"):
            raise ValueError(f"filler={self.filler!r} must be 'blank' or 'random'.")

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
            raise ValueError(
                f"need 2*num_tokens + 1 = {2 * self.tokens[1] + 1} <= min_len={self.min_len} <= max_len={self.max_len}; "
                "raise min_len or lower num_tokens."
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
    sum them over ranks before dividing.
    """
    if logits.shape[:-1].numel() != labels.numel():
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} cover different token counts; pass the "
            "labels of the same (local) tokens."
        )
    labels = labels.reshape(-1).to(logits.device)  # [N]
    answered = labels != ignore_index
    correct = (logits.reshape(-1, logits.shape[-1]).argmax(dim=-1) == labels) & answered
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


def read_text_file(path: Path) -> str:
    """A file's text as UTF-8 (``\\r\\n`` read as ``\\n``); a ValueError names the file, line and byte."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        looks = "looks binary" if b"\0" in data[:8192] else "is not UTF-8 text"
        raise ValueError(
            f"{path}:{line}: byte {error.start} (0x{data[error.start]:02x}) is not UTF-8; the file {looks}: convert it "
            "to UTF-8 (e.g. iconv -f latin1 -t utf-8) or point data.path at a text file."
        ) from None
    return text.replace("\r\n", "\n")


def _encode_at(tokenizer: ByteTokenizer, text: str, path: Path, line: int, add_bos: bool, add_eos: bool) -> list[int]:
    """Tokens of ``text`` (which starts at ``line`` of ``path``); reserved bytes are named by line."""
    try:
        return tokenizer.encode(text, add_bos, add_eos)
    except ValueError:
        data = text.encode("utf-8")
        reserved = bytes((tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id))
        at = next(i for i, b in enumerate(data) if b in reserved)
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
    parts, line = [], 1
    for part in text.split("\n\n"):  # paragraphs: separated by a blank line
        parts.append((line, part))
        line += part.count("\n") + 2
    return parts


def text_documents(
    paths: str | Path | Iterable[str | Path],
    split: str = "file",
    tokenizer: ByteTokenizer | None = None,
    add_bos: bool = False,
    add_eos: bool = True,
) -> list[list[int]]:
    """Documents from plain UTF-8 text files: one per file (``"file"``), per non-empty line
    (``"line"``) or per blank-line-separated paragraph (``"paragraph"``). Errors name the file
    and line."""
    if split not in TEXT_SPLITS:
        raise ValueError(f"split={split!r} must be one of {list(TEXT_SPLITS)}.")
    tokenizer = tokenizer or ByteTokenizer()
    docs = []
    for path in _paths(paths):
        for line, part in _text_parts(read_text_file(path), split):
            if part.strip():
                docs.append(_encode_at(tokenizer, part, path, line, add_bos, add_eos))
    return docs


def jsonl_documents(
    paths: str | Path | Iterable[str | Path],
    text_field: str = "text",
    tokenizer: ByteTokenizer | None = None,
    add_bos: bool = False,
    add_eos: bool = True,
) -> list[list[int]]:
    """Documents from JSON-lines files, one per record, from its ``text_field`` string.
    Errors name the file and line."""
    tokenizer = tokenizer or ByteTokenizer()
    docs = []
    for path in _paths(paths):
        for number, line in enumerate(read_text_file(path).split("\n"), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno}); every line must be one "
                    "JSON object such as {\"text\": \"...\"}: fix or remove that line."
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(
                    f"{path}:{number} has no string field {text_field!r} (keys: "
                    f"{sorted(record) if isinstance(record, dict) else type(record).__name__}); pass text_field= "
                    "(data.task_options.text_field) or fix the record."
                )
            docs.append(_encode_at(tokenizer, record[text_field], path, number, add_bos, add_eos))
    return docs


_HF_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".csv": "csv", ".parquet": "parquet"}


def hf_documents(
    data_files: str | Path | Iterable[str | Path],
    text_field: str = "text",
    builder: str | None = None,
    split: str = "train",
    tokenizer: ByteTokenizer | None = None,
    add_bos: bool = False,
    add_eos: bool = True,
) -> list[list[int]]:
    """Documents from local files through Hugging Face ``datasets`` (``load_dataset(builder,
    data_files=...)``, builder inferred from the extension). Needs ``pip install datasets``."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            "hf_documents needs the optional Hugging Face 'datasets' package: pip install datasets "
            "(or read local files with text_documents / jsonl_documents)."
        ) from error
    files = [str(p) for p in _paths(data_files)]
    builder = builder or _HF_BUILDERS.get(Path(files[0]).suffix)
    if builder is None:
        raise ValueError(f"cannot infer the datasets builder of {files[0]}; pass builder= one of {sorted(set(_HF_BUILDERS.values()))}.")
    dataset = datasets.load_dataset(builder, data_files=files, split=split)
    if text_field not in dataset.column_names:
        raise ValueError(f"dataset columns {dataset.column_names} have no {text_field!r}; pass text_field=.")
    tokenizer = tokenizer or ByteTokenizer()
    return [tokenizer.encode(text, add_bos, add_eos) for text in dataset[text_field] if text]
