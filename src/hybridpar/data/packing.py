"""Sequence packing for context parallelism, and the THD / padded (BSHD) collators.

A document is a list of token ids, or a mapping ``{"input_ids": [...], "labels": [...]}``
whose labels are already aligned (see below). ``pack_documents`` places documents into
rows of ``pack_size`` tokens with best-fit decreasing bin packing:

- each document is padded to a multiple of ``2*cp`` (``pad_id`` tokens, label -100) so the
  zigzag split of context parallelism cuts every document into ``2*cp`` equal chunks; at
  ``cp_size=1`` there is no per-document padding (as in NeMo), which keeps the
  trailing-pad absorption of ``process_input_for_thd`` on its fast path;
- position ids restart at 0 for every document and keep counting through its padding;
- ``seq_lens`` holds the real lengths, ``seq_lens_padded`` the padded ones, with the
  pack-level padding added to the last document, so ``seq_lens_padded`` sums to ``pack_size``;
- documents longer than ``pack_size`` are split into ``pack_size`` pieces (``overlong="split"``),
  dropped (``"drop"``) or rejected (``"error"``); splits, drops and empty documents are
  reported in one ``warnings.warn``, never silently.

Label convention (the trainer relies on it): labels are **already shifted**. For a token
list ``d``, ``labels[t] = d[t + 1]`` and -100 at the document's last token, so
``loss = sum(CE(logits[t], labels[t]) for labels[t] != -100) / count``, with no further
shift and no target ever taken from the next document. A mapping document supplies its own
aligned labels (e.g. -100 everywhere but the answers of a synthetic task). Padding is
always -100. A split piece keeps the labels of its span, so a piece's last token still
predicts the first token of the next piece.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from hybridpar.config_rules import Notice, quoted, shorten
from hybridpar.data.thd import SEQ_LENS_PADDING_VALUE

__all__ = [
    "IGNORE_INDEX",
    "Document",
    "document_tokens_and_labels",
    "document_pad_multiple",
    "pack_documents",
    "collate_thd",
    "collate_padded",
    "padding_fraction",
]

IGNORE_INDEX = -100


class _DocumentKind(type):
    def __instancecheck__(cls, value) -> bool:  # the forms pack_documents takes (their values are checked there)
        return isinstance(value, (Tensor, Mapping)) or (isinstance(value, Sequence) and not isinstance(value, (str, bytes)))


class Document(metaclass=_DocumentKind):
    """One document: token ids (a list or a 1-D tensor) or a mapping ``{"input_ids": [...], "labels": [...]}`` with
    labels already aligned (module docstring); ``isinstance(x, Document)`` says whether ``x`` has one of these forms.

    ``Document(input_ids, labels=None)`` builds the mapping, checked as ``pack_documents`` checks it: int64 ``[n]``
    ``input_ids`` and ``labels`` (by default each token's next, -100 at the last). It was a ``typing.Union`` alias, so
    ``hp.Document(ids)`` was Python's "Cannot instantiate typing.Union" and ``isinstance`` a TypeError."""

    def __new__(cls, input_ids, labels=None) -> dict[str, Tensor]:
        tokens, labels = document_tokens_and_labels({"input_ids": input_ids, "labels": labels})
        return {"input_ids": tokens, "labels": labels}

PACK_KEYS = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded")


def _token_ids(ids, labels: bool = False) -> Tensor:
    """``ids`` (``labels``: a document's labels) as int64 ``[n]``; ValueError for text, a float (1.5 was cut to 1)
    or a negative id (an embedding row counted from the end: trained on silently; a label other than -100 was a
    cross-entropy error at the first step, a device assert on a GPU)."""
    what = "labels" if labels else "token ids"
    if isinstance(ids, (str, bytes)):
        subject = "a document's labels are" if labels else "a document is"
        raise ValueError(f"{subject} token ids, not text ({quoted(ids, 60)}); encode it with a tokenizer first "
                         "(e.g. tokenizer.document(text)).")
    try:
        tensor = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"a document's {what} {quoted(ids, 60)} are not a list of integers ({shorten(str(error), 100)}); "
                         f"pass integer {what}.") from None
    if tensor.dim() > 1 and tensor.shape[:-1].numel() > 1:  # a [B, S] batch was joined into one document
        raise ValueError(f"a document's {what} have shape {list(tensor.shape)}: its {tensor.shape[:-1].numel()} rows would "
                         "be joined into one document, each row reading the ones before it; pass each row as a document "
                         "of its own (e.g. docs=list(batch)).")
    tensor = tensor.flatten()
    if tensor.numel() == 0:
        return tensor.to(torch.long)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"a document's {what} are {str(tensor.dtype).removeprefix('torch.')}, not integers "
                         f"({quoted(ids, 60)}); pass integer {what} (a float would be cut to an integer).")
    negative = tensor[(tensor < 0) & (tensor != IGNORE_INDEX)] if labels else tensor[tensor < 0]
    if negative.numel():
        raise ValueError(f"a document holds the negative {what[:-1]} {int(negative[0])} ({quoted(ids, 60)}); "
                         + ("a label is a token id in [0, vocab_size) or -100 (no target): fix the labels." if labels else
                            "token ids are in [0, vocab_size): fix the ids (-100 belongs in labels, not input_ids)."))
    return tensor.to(torch.long)


def document_tokens_and_labels(doc: Document) -> tuple[Tensor, Tensor]:
    """``(input_ids, labels)`` int64 ``[n]`` of one document; labels shifted as described above."""
    if isinstance(doc, Mapping):
        if "input_ids" not in doc:
            raise ValueError(f"a mapping document needs 'input_ids', got keys {sorted(doc)}; pass {{'input_ids': [...]}}.")
        tokens = _token_ids(doc["input_ids"])
        if doc.get("labels") is not None:
            labels = _token_ids(doc["labels"], labels=True)
            if labels.numel() != tokens.numel():
                raise ValueError(
                    f"document labels have {labels.numel()} entries but input_ids {tokens.numel()}; give one "
                    "(already shifted) label per token, -100 where there is no target."
                )
            return tokens, labels
    else:
        tokens = _token_ids(doc)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:-1] = tokens[1:]  # labels[t] = next token of the same document
    return tokens, labels


def document_pad_multiple(cp_size: int) -> int:
    """Per-document padding multiple: ``2*cp`` under context parallelism, 1 without."""
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {quoted(cp_size)}.")
    return 1 if cp_size == 1 else 2 * cp_size


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_documents(
    docs: Iterable[Document],
    pack_size: int,
    cp_size: int = 1,
    pad_id: int = 0,
    overlong: str = "split",
    pad_to_multiple_of: int | None = None,
    one_per_row: bool = False,
) -> list[dict[str, Tensor]]:
    """Pack documents into rows of ``pack_size`` tokens (best-fit decreasing).

    Returns one dict per pack: ``input_ids``, ``labels``, ``position_ids`` int64 ``[pack_size]``;
    ``seq_lens``, ``seq_lens_padded`` int64 ``[n_docs_in_pack]``; ``document_index`` int64
    ``[n_docs_in_pack]`` (index of each piece's source document in ``docs``) and
    ``document_offset`` (where the piece starts in that document; 0 unless split). Documents keep
    their input order inside a pack; packs are ordered by their first document.
    ``pad_to_multiple_of`` overrides the per-document multiple (default ``2*cp``, 1 at cp=1).
    ``one_per_row=True`` gives every document (piece) a row of its own, padded to ``pack_size``:
    for models whose token mixers cannot reset at document boundaries (``train/packing_rule.py``).
    """
    from hybridpar.models.arguments import python_number

    def integer(value) -> bool:  # 1.5 was cut to 1
        return isinstance(value, int) and not isinstance(value, bool)

    pack_size, cp_size, pad_id, pad_to_multiple_of = map(python_number, (pack_size, cp_size, pad_id, pad_to_multiple_of))
    if not integer(pad_id) or pad_id < 0:
        raise ValueError(f"pad_id={quoted(pad_id)} must be a token id, an integer >= 0 (a negative id is outside the "
                         "embedding); pass e.g. pad_id=0.")
    if pad_to_multiple_of is not None and (not integer(pad_to_multiple_of) or pad_to_multiple_of < 1):
        raise ValueError(f"pad_to_multiple_of={quoted(pad_to_multiple_of)} must be None (2*cp_size) or an integer >= 1; "
                         "pass e.g. pad_to_multiple_of=2.")
    if docs is None or isinstance(docs, (str, bytes, Mapping)):
        raise ValueError(f"docs={quoted(docs, 60)} must be a list of documents (one document is [ids] or "
                         "[{'input_ids': ...}]).")
    multiple = document_pad_multiple(cp_size) if pad_to_multiple_of is None else pad_to_multiple_of
    if not integer(pack_size) or not 1 <= pack_size <= 2**31 - 1:  # True packed rows of one token; 2**40 a torch OOM
        raise ValueError(f"pack_size must be an int in [1, 2**31-1] (cu_seqlens are int32), got {quoted(pack_size)}.")
    if pack_size % multiple != 0:
        source = f"2*cp_size with cp_size={cp_size}" if pad_to_multiple_of is None else "pad_to_multiple_of"
        raise ValueError(
            f"pack_size={pack_size} is not a multiple of {multiple} ({source}); context "
            f"parallelism needs every padded document, the last one included, divisible by it: use pack_size="
            f"{_round_up(pack_size, multiple)}."
        )
    if overlong not in ("split", "drop", "error"):
        raise ValueError(f"overlong={quoted(overlong)} is not one of 'split', 'drop', 'error'.")

    pieces: list[tuple[int, int, Tensor, Tensor]] = []  # (document index, offset, tokens, labels), input order
    split = dropped = empty = dropped_tokens = 0
    for index, doc in enumerate(docs):
        tokens, labels = document_tokens_and_labels(doc)
        length = tokens.numel()
        if length == 0:
            empty += 1
        elif length <= pack_size:
            pieces.append((index, 0, tokens, labels))
        elif overlong == "error":
            raise ValueError(
                f"document {index} has {length} tokens, more than pack_size={pack_size}; raise pack_size or pass "
                "overlong='split' or 'drop'."
            )
        elif overlong == "drop":
            dropped, dropped_tokens = dropped + 1, dropped_tokens + length
        else:
            split += 1
            pieces.extend((index, s, tokens[s:s + pack_size], labels[s:s + pack_size]) for s in range(0, length, pack_size))
    if split or dropped or empty:
        warnings.warn(
            f"pack_documents(pack_size={pack_size}): split {split} documents longer than the pack into pieces, "
            f"dropped {dropped} such documents ({dropped_tokens} tokens), skipped {empty} empty documents.",
            Notice, stacklevel=2,
        )

    if one_per_row:
        bins = [[j] for j in range(len(pieces))]
    else:
        bins = _best_fit_decreasing([_round_up(t.numel(), multiple) for _, _, t, _ in pieces], pack_size)
    bins.sort(key=lambda members: members[0])
    return [_build_pack([pieces[j] for j in members], pack_size, multiple, pad_id) for members in bins]


def _best_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices (each sorted): largest item first into the fullest bin it fits."""
    free: list[tuple[int, int]] = []  # sorted (free space, bin id)
    bins: list[list[int]] = []
    for item in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        slot = bisect.bisect_left(free, (sizes[item], -1))  # tightest bin with enough room
        if slot == len(free):
            bins.append([item])
            room, bin_id = capacity, len(bins) - 1
        else:
            room, bin_id = free.pop(slot)
            bins[bin_id].append(item)
        if room - sizes[item] > 0:
            bisect.insort(free, (room - sizes[item], bin_id))
    return [sorted(members) for members in bins]


def _build_pack(pieces: list[tuple[int, int, Tensor, Tensor]], pack_size: int, multiple: int, pad_id: int) -> dict[str, Tensor]:
    input_ids = torch.full((pack_size,), pad_id, dtype=torch.long)
    labels = torch.full((pack_size,), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.empty(pack_size, dtype=torch.long)
    seq_lens, seq_lens_padded, document_index, document_offset = [], [], [], []
    offset = 0
    for index, start, tokens, piece_labels in pieces:
        length = tokens.numel()
        padded = _round_up(length, multiple)
        input_ids[offset:offset + length] = tokens
        labels[offset:offset + length] = piece_labels
        seq_lens.append(length)
        seq_lens_padded.append(padded)
        document_index.append(index)
        document_offset.append(start)
        offset += padded
    seq_lens_padded[-1] += pack_size - offset  # pack-level padding belongs to the last document
    start = 0
    for padded in seq_lens_padded:  # positions restart per document, run through its padding
        position_ids[start:start + padded] = torch.arange(padded)
        start += padded
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.long),
        "seq_lens_padded": torch.tensor(seq_lens_padded, dtype=torch.long),
        "document_index": torch.tensor(document_index, dtype=torch.long),
        "document_offset": torch.tensor(document_offset, dtype=torch.long),
    }


def collate_thd(packs: Sequence[Mapping[str, Tensor]], seq_lens_padding_value: int = SEQ_LENS_PADDING_VALUE) -> dict[str, Any]:
    """Stack packs into the THD batch of ``process_input_for_thd``.

    ``input_ids``/``labels``/``position_ids`` ``[B, pack_size]``; ``seq_lens``/``seq_lens_padded``
    ``[B, max_packs]`` right-padded with the sentinel; ``qkv_format = "thd"``.
    """
    if isinstance(packs, Mapping):  # one pack was a KeyError: 0
        raise ValueError("collate_thd takes a list of packs and got one pack (a dict); pass [pack], or the list "
                         "pack_documents returns.")
    if not packs:
        raise ValueError("collate_thd got no packs; pass at least one pack from pack_documents.")
    missing = [key for key in PACK_KEYS if key not in packs[0]]
    if missing:
        raise ValueError(f"packs are missing {missing}; build them with pack_documents.")
    sizes = sorted({int(p["input_ids"].numel()) for p in packs})
    if len(sizes) != 1:
        raise ValueError(f"packs have different lengths {sizes}; pack every row with the same pack_size.")
    width = max(int(p["seq_lens"].numel()) for p in packs)

    def lengths(key: str) -> Tensor:
        out = torch.full((len(packs), width), seq_lens_padding_value, dtype=torch.long)  # [B, max_packs]
        for row, pack in enumerate(packs):
            out[row, :pack[key].numel()] = pack[key]
        return out

    return {
        "input_ids": torch.stack([p["input_ids"] for p in packs]),  # B x [pack] -> [B, pack]
        "labels": torch.stack([p["labels"] for p in packs]),
        "position_ids": torch.stack([p["position_ids"] for p in packs]),
        "seq_lens": lengths("seq_lens"),
        "seq_lens_padded": lengths("seq_lens_padded"),
        "qkv_format": "thd",
    }


def collate_padded(docs: Sequence[Document], pad_id: int = 0, pad_to_multiple_of: int = 1) -> dict[str, Any]:
    """One document per row, right-padded to the longest (rounded up to ``pad_to_multiple_of``;
    use ``2*cp`` under context parallelism).

    ``input_ids``/``labels``/``position_ids`` ``[B, L]`` (labels shifted, -100 on padding),
    ``seq_lens`` ``[B, 1]`` real lengths, ``seq_lens_padded`` ``[B, 1]`` = L, ``qkv_format = "bshd"``.
    """
    if not docs:
        raise ValueError("collate_padded got no documents; pass at least one.")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}.")
    pairs = [document_tokens_and_labels(doc) for doc in docs]
    lengths = [tokens.numel() for tokens, _ in pairs]
    if min(lengths) == 0:
        raise ValueError(f"document {lengths.index(0)} is empty; drop empty documents before collating.")
    width = _round_up(max(lengths), pad_to_multiple_of)
    input_ids = torch.full((len(docs), width), pad_id, dtype=torch.long)  # [B, L]
    labels = torch.full((len(docs), width), IGNORE_INDEX, dtype=torch.long)
    for row, (tokens, doc_labels) in enumerate(pairs):
        input_ids[row, :tokens.numel()] = tokens
        labels[row, :tokens.numel()] = doc_labels
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": torch.arange(width).expand(len(docs), width).clone(),
        "seq_lens": torch.tensor(lengths, dtype=torch.long)[:, None],
        "seq_lens_padded": torch.full((len(docs), 1), width, dtype=torch.long),
        "qkv_format": "bshd",
    }


def padding_fraction(rows: Iterable[Mapping[str, Tensor]]) -> float:
    """Share of token slots that hold no real token, over packs or collated batches."""
    real = slots = 0
    for row in rows:
        real += int(row["seq_lens"][row["seq_lens"] > 0].sum())
        slots += int(row["input_ids"].numel())
    return 1.0 - real / slots if slots else 0.0
