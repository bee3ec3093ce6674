"""Packed-sequence (THD) metadata: the one object every layer receives.

A packed batch is one row ``[1, T]`` holding several documents back to back. A dense
batch ``[B, S]`` is described the same way with a single document per row, every row
sharing the layout (``qkv_format="bshd"``). Layers read ``seq_idx`` (which document a
token belongs to) and ``position_ids`` (its position inside that document); under
context parallelism ``cp`` says where this rank's tokens sit in the global sequence.

``process_input_for_thd`` / ``split_batch_into_thd_chunks`` flatten a collated ``[B, S]``
batch to THD with the semantics of seed ``003_*`` (real ``cu_seqlens``, trailing-pad
absorption, ``cu_seqlens_padded`` only when padding sits between documents, layout-based
``padding_mask``); ``PackedSeqParams.from_batch`` turns one such row into the metadata.
Cases the seed leaves open: a row whose padded lengths sum to less than ``S`` gives the rest
to its last document (the packer's convention), so ``cu_seqlens_padded`` always ends at the
token count; without ``seq_lens`` each row is one document right-padded with the pad id.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hybridpar.data.seq_lens import lengths_from_seq_lens, lengths_from_token_ids

__all__ = [
    "SEQ_LENS_PADDING_VALUE",
    "ContextParallelLayout",
    "PackedSeqParams",
    "process_input_for_thd",
    "split_batch_into_thd_chunks",
    "seq_idx_from_cu_seqlens",
    "validate_cu_seqlens",
]

SEQ_LENS_PADDING_VALUE = -1000  # marks an empty slot in [B, max_packs] seq_lens


@dataclass
class ContextParallelLayout:
    """Where the tokens of one context-parallel rank sit in the global sequence.

    Built once per batch (``parallel/context/zigzag.py``); layers only index with it.

    - ``local_indices`` int64 ``[T_local]``: global index of each local token, local order.
    - ``gathered_indices`` int64 ``[T]``: ``local_indices`` of ranks ``0..cp-1`` concatenated,
      i.e. the global index of each token after an all-gather along the sequence.
    - ``gathered_to_sequence`` int64 ``[T]``: ``argsort(gathered_indices)``; ``x[:, g2s]``
      turns rank-major gathered order into sequence order, ``y[:, gathered_indices]`` back.
    - ``global_seq_idx`` int32 ``[1, T]``: document of each global token, sequence order.
    """

    cp_size: int
    cp_rank: int
    local_indices: Tensor
    gathered_indices: Tensor
    gathered_to_sequence: Tensor
    global_seq_idx: Tensor


@dataclass
class PackedSeqParams:
    """Document layout of a batch, built once and passed to every layer.

    - ``cu_seqlens`` int32 ``[n_docs + 1]``: real (unpadded) document starts, global.
    - ``cu_seqlens_padded`` int32 ``[n_docs + 1]``: padded document starts, global; equal to
      ``cu_seqlens`` when documents carry no padding. Padding belongs to the document it
      follows, so ``seq_idx`` is built from these.
    - ``max_seqlen``: longest padded document.
    - ``seq_idx`` int32 ``[1, T_local]``: document of each token this process holds.
    - ``position_ids`` int64 ``[1, T_local]``: position of each such token in its document.
    - ``qkv_format``: ``"thd"`` for a packed ``[1, T]`` row, ``"bshd"`` for dense rows.
    - ``cp``: this rank's place in the global sequence under context parallelism.
    - ``cache``: index tensors layers derive from this batch once and share (e.g. the
      attention block plan); an attribute, not a field, and a fresh one on every copy.
    """

    cu_seqlens: Tensor
    cu_seqlens_padded: Tensor
    max_seqlen: int
    seq_idx: Tensor
    position_ids: Tensor
    qkv_format: str = "thd"
    cp: ContextParallelLayout | None = None

    def __post_init__(self) -> None:
        # Not a dataclass field: every copy (``dataclasses.replace``, FSDP2's cast of forward
        # inputs under mixed precision, which replaces every field) starts with an empty cache.
        self.cache: dict = {}

    @property
    def total_tokens(self) -> int:
        """Global (padded) token count of one row."""
        return int(self.cu_seqlens_padded[-1])

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None = None, qkv_format: str = "thd"
    ) -> "PackedSeqParams":
        """Layout of one ``[1, T]`` row from its document boundaries (``T = cu[-1]``)."""
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.int32)
        cu_padded = cu_seqlens if cu_seqlens_padded is None else torch.as_tensor(cu_seqlens_padded, dtype=torch.int32)
        validate_cu_seqlens(cu_seqlens, "cu_seqlens")
        validate_cu_seqlens(cu_padded, "cu_seqlens_padded")
        if cu_padded.numel() != cu_seqlens.numel() or bool((cu_padded[1:] - cu_padded[:-1] < cu_seqlens[1:] - cu_seqlens[:-1]).any()):
            raise ValueError(
                f"cu_seqlens_padded {cu_padded.tolist()} must have one entry per document of cu_seqlens "
                f"{cu_seqlens.tolist()} and no padded length shorter than the real one; rebuild both from "
                "the same documents."
            )
        seq_idx = seq_idx_from_cu_seqlens(cu_padded)
        starts = cu_padded[:-1].long()
        positions = torch.arange(int(cu_padded[-1]), dtype=torch.long, device=cu_padded.device) - starts[seq_idx.long()]
        lengths = cu_padded[1:] - cu_padded[:-1]
        return cls(
            cu_seqlens=cu_seqlens,
            cu_seqlens_padded=cu_padded,
            max_seqlen=int(lengths.max()),
            seq_idx=seq_idx.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            qkv_format=qkv_format,
        )

    @classmethod
    def from_batch(cls, thd_batch: Mapping[str, Any], seq_lens_padding_value: int = SEQ_LENS_PADDING_VALUE) -> "PackedSeqParams":
        """Layout of one packed row from a THD batch (``process_input_for_thd`` output).

        Accepts one row (``input_ids`` ``[T]`` or ``[T, H]``) or a one-chunk stack (``[1, T]``,
        ``cu_seqlens`` ``[1, K]`` right-padded with the sentinel). A collated batch that still
        has ``seq_lens`` and no ``cu_seqlens`` is converted first. Checks that the padded
        boundaries end at the token count and that the batch's position ids restart at every
        document start (on real tokens).
        """
        if not isinstance(thd_batch, Mapping):
            raise ValueError(f"from_batch needs a dict batch, got {type(thd_batch).__name__}.")
        if "cu_seqlens" not in thd_batch:
            thd_batch = process_input_for_thd(thd_batch, seq_lens_padding_value)
        _require_keys(thd_batch, ("input_ids", "cu_seqlens"), "PackedSeqParams.from_batch")
        cu, cu_padded = thd_batch["cu_seqlens"], thd_batch.get("cu_seqlens_padded")
        input_ids, positions, padding = thd_batch["input_ids"], thd_batch.get("position_ids"), thd_batch.get("padding_mask")
        if cu.dim() == 2:  # stacked chunks [C, K]: only one chunk is one row
            if cu.shape[0] != 1:
                raise ValueError(
                    f"from_batch got {cu.shape[0]} stacked chunks (cu_seqlens shape {tuple(cu.shape)}); a PackedSeqParams "
                    "describes one row, so select a chunk first: {k: v[i] for k, v in batch.items()}."
                )
            cu, input_ids = cu[0], input_ids[0]
            cu_padded = None if cu_padded is None else cu_padded[0]
            positions = None if positions is None or positions.dim() != 2 else positions[0]
            padding = None if padding is None else padding[0]
        cu = cu[cu != seq_lens_padding_value]
        cu_padded = cu if cu_padded is None else cu_padded[cu_padded != seq_lens_padding_value]
        total = int(input_ids.shape[0])
        if cu_padded.numel() == 0 or int(cu_padded[-1]) != total:
            raise ValueError(
                f"padded cu_seqlens {cu_padded.tolist()} must end at the row's token count {total}; build the batch with "
                "process_input_for_thd from seq_lens_padded that cover the whole row."
            )
        params = cls.from_cu_seqlens(cu, cu_padded)
        if positions is not None and positions.dim() == 1:  # mRoPE ids [3, 1, T] are left to the model
            real = torch.ones(total, dtype=torch.bool) if padding is None else ~padding.bool()
            derived = params.position_ids[0]
            if not torch.equal(positions.long()[real], derived[real]):
                bad = int(torch.nonzero(positions.long()[real] != derived[real])[0])
                raise ValueError(
                    f"position_ids do not restart at every document start (first mismatch at real token {bad}: "
                    f"{int(positions[real][bad])} != {int(derived[real][bad])}); build them per document, as the packer does."
                )
        return params

    @classmethod
    def for_dense(cls, seq_len: int) -> "PackedSeqParams":
        """Layout shared by every row of a dense ``[B, S]`` batch: one document per row."""
        return cls.from_cu_seqlens(torch.tensor([0, seq_len], dtype=torch.int32), qkv_format="bshd")


def seq_idx_from_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """Document id of every token: ``searchsorted(cu[1:], positions, right=True)``, int32 ``[T]``."""
    positions = torch.arange(int(cu_seqlens[-1]), dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True).to(torch.int32)


def validate_cu_seqlens(cu_seqlens: Tensor, name: str = "cu_seqlens") -> None:
    """Raise ``ValueError`` unless ``cu_seqlens`` is 1-D, starts at 0 and strictly increases."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least two entries [0, ..., T], got shape {tuple(cu_seqlens.shape)}.")
    if int(cu_seqlens[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {cu_seqlens.tolist()}; prepend 0.")
    if bool((cu_seqlens[1:] <= cu_seqlens[:-1]).any()):
        raise ValueError(
            f"{name} must strictly increase (every document at least one token), got {cu_seqlens.tolist()}; "
            "drop empty documents before packing."
        )


def process_input_for_thd(
    batch: Mapping[str, Any],
    seq_lens_padding_value: int = SEQ_LENS_PADDING_VALUE,
    padding_token_id: int = 0,
) -> dict[str, Any]:
    """Flatten a collated ``[B, S]`` batch to one THD stream of ``T = B*S`` tokens.

    In: ``input_ids`` ``[B, S]`` (or embeddings ``[B, S, H]``), ``position_ids`` ``[B, S]``
    (or mRoPE ``[n, B, S]``), optional ``labels`` ``[B, S]``, ``seq_lens`` and
    ``seq_lens_padded`` ``[B, max_packs]`` with ``seq_lens_padding_value`` in empty slots.
    Out: ``input_ids`` ``[T]``/``[T, H]``, ``labels`` ``[T]``, ``position_ids`` ``[T]``/``[n, 1, T]``,
    ``cu_seqlens`` int32 (real lengths; trailing pack padding absorbed into the last document
    when every other boundary agrees), ``cu_seqlens_padded`` int32 only when it still differs,
    ``max_seqlen`` int32 scalar (widest ``cu_seqlens`` slot after absorption), ``padding_mask``
    bool ``[T]`` from the layout, and every other key unchanged (``seq_lens*`` are consumed).
    Without ``seq_lens`` each row is one document right-padded with ``padding_token_id``.
    """
    _require_keys(batch, ("input_ids", "position_ids"), "process_input_for_thd")
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, Tensor) or input_ids.dim() not in (2, 3):
        raise ValueError(
            f"input_ids must be a [B, S] token tensor or [B, S, H] embeddings, got "
            f"{tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__}; collate rows first."
        )
    rows, seq_len = int(input_ids.shape[0]), int(input_ids.shape[1])
    total = rows * seq_len
    labels = batch.get("labels")
    if labels is not None and tuple(labels.shape) != (rows, seq_len):
        raise ValueError(f"labels shape {tuple(labels.shape)} must match input_ids [B, S] = {(rows, seq_len)}.")

    if batch.get("seq_lens") is None:
        if batch.get("seq_lens_padded") is not None:
            raise ValueError("seq_lens_padded was given without seq_lens; pass the real lengths as seq_lens too.")
        real, padded = lengths_from_token_ids(input_ids, padding_token_id)
    else:
        real, padded = lengths_from_seq_lens(
            batch["seq_lens"], batch.get("seq_lens_padded"), rows, seq_len, seq_lens_padding_value
        )
    # real, padded: int64 [n_docs], document order; the padded lengths of each row sum to S.
    cu_real, cu_padded = _cumsum_from_zero(real), _cumsum_from_zero(padded)
    padding_mask = _padding_mask_from_layout(real, cu_padded)  # [T]

    # Absorption: when padding only trails the last document (cp = 1), that document owns it.
    if torch.equal(cu_real[:-1], cu_padded[:-1]) and int(cu_real[-1]) < total:
        cu_real = cu_padded.clone()

    result: dict[str, Any] = {
        "input_ids": input_ids.reshape(total, *input_ids.shape[2:]),  # [B, S(, H)] -> [T(, H)]
        "position_ids": _flatten_position_ids(batch["position_ids"], rows, seq_len),
        "cu_seqlens": cu_real,
    }
    if labels is not None:
        result["labels"] = labels.reshape(total)  # [B, S] -> [T]
    if not torch.equal(cu_real, cu_padded):
        result["cu_seqlens_padded"] = cu_padded
    result["max_seqlen"] = (cu_real[1:] - cu_real[:-1]).max().to(torch.int32)
    result["padding_mask"] = padding_mask
    for key, value in batch.items():
        if key not in result and key not in ("seq_lens", "seq_lens_padded"):
            result[key] = value
    return result


def split_batch_into_thd_chunks(
    batch: Mapping[str, Any],
    num_chunks: int,
    seq_lens_padding_value: int = SEQ_LENS_PADDING_VALUE,
    padding_token_id: int = 0,
) -> dict[str, Any]:
    """``process_input_for_thd`` on ``num_chunks`` equal slices of the batch, stacked.

    ``input_ids``/``labels``/``position_ids``/``padding_mask`` -> ``[C, T/C(, H)]`` (mRoPE ids
    -> ``[n, C, T/C]``); ``cu_seqlens`` -> ``[C, K]`` right-padded with the sentinel;
    ``cu_seqlens_padded`` likewise when any chunk emits it (a chunk that absorbed uses its
    ``cu_seqlens``); ``max_seqlen`` -> ``[C]``. Other tensors whose first dimension is ``B`` are
    sliced and stacked ``[C, B/C, ...]``; everything else comes from the batch unchanged.
    ``num_chunks <= 1`` returns the unchunked result.
    """
    if num_chunks <= 1:
        return process_input_for_thd(batch, seq_lens_padding_value, padding_token_id)
    _require_keys(batch, ("input_ids", "position_ids"), "split_batch_into_thd_chunks")
    rows = int(batch["input_ids"].shape[0])
    if rows % num_chunks != 0:
        raise ValueError(
            f"batch size {rows} is not divisible by num_chunks={num_chunks}; use a batch size that is a multiple "
            "of the number of chunks (micro-batches)."
        )
    size = rows // num_chunks
    sliced_keys = {
        key for key, value in batch.items()
        if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == rows and key != "position_ids"
    }

    def chunk(i: int) -> dict[str, Any]:
        piece = {key: (batch[key][i * size:(i + 1) * size] if key in sliced_keys else batch[key]) for key in batch}
        positions = batch["position_ids"]
        piece["position_ids"] = positions[:, i * size:(i + 1) * size] if positions.dim() == 3 else positions[i * size:(i + 1) * size]
        return process_input_for_thd(piece, seq_lens_padding_value, padding_token_id)

    chunks = [chunk(i) for i in range(num_chunks)]
    stacked: dict[str, Any] = {}
    for key in chunks[0]:
        if key == "cu_seqlens_padded":
            continue
        values = [c[key] for c in chunks]
        if key == "position_ids" and values[0].dim() == 3:
            stacked[key] = torch.cat(values, dim=1)  # C x [n, 1, T/C] -> [n, C, T/C]
        elif key == "cu_seqlens":
            stacked[key] = _stack_right_padded(values, seq_lens_padding_value)
        elif key in ("input_ids", "labels", "position_ids", "padding_mask", "max_seqlen") or key in sliced_keys:
            stacked[key] = torch.stack(values)
        else:
            stacked[key] = values[0]
    if any("cu_seqlens_padded" in c for c in chunks):
        stacked["cu_seqlens_padded"] = _stack_right_padded(
            [c.get("cu_seqlens_padded", c["cu_seqlens"]) for c in chunks], seq_lens_padding_value
        )
    return stacked


def _require_keys(batch: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    if not isinstance(batch, Mapping):
        raise ValueError(f"{where} needs a dict batch, got {type(batch).__name__}.")
    missing = [key for key in keys if batch.get(key) is None]
    if missing:
        raise ValueError(
            f"{where}: batch is missing {missing} (has {sorted(batch)}); collate with hybridpar.data.packing "
            "(collate_thd / collate_padded), which sets input_ids, labels, position_ids and seq_lens."
        )


def _cumsum_from_zero(lengths: Tensor) -> Tensor:
    """``[n]`` lengths -> int32 ``[n + 1]`` boundaries starting at 0."""
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, dim=0)]).to(torch.int32)


def _padding_mask_from_layout(real: Tensor, cu_padded: Tensor) -> Tensor:
    """True where slot ``t`` of document ``d`` lies past the document's ``real[d]`` tokens; ``[T]``."""
    positions = torch.arange(int(cu_padded[-1]), dtype=torch.long, device=cu_padded.device)
    doc = torch.searchsorted(cu_padded[1:].long(), positions, right=True)  # [T]
    return (positions - cu_padded.long()[doc]) >= real[doc]


def _flatten_position_ids(position_ids: Tensor, rows: int, seq_len: int) -> Tensor:
    """``[B, S] -> [T]``; mRoPE ``[n, B, S] -> [n, 1, T]`` (a batch axis of 1 kept for HF mRoPE)."""
    if position_ids.dim() == 2 and tuple(position_ids.shape) == (rows, seq_len):
        return position_ids.reshape(rows * seq_len)
    if position_ids.dim() == 3 and tuple(position_ids.shape[1:]) == (rows, seq_len):
        return position_ids.reshape(position_ids.shape[0], 1, rows * seq_len)
    raise ValueError(
        f"position_ids shape {tuple(position_ids.shape)} must be [B, S] = {(rows, seq_len)} or mRoPE "
        f"[n, B, S]; build them with the collator."
    )


def _stack_right_padded(tensors: list[Tensor], value: int) -> Tensor:
    """C x ``[k_c]`` -> ``[C, max k]``, right-padded with ``value``."""
    width = max(int(t.numel()) for t in tensors)
    return torch.stack([torch.cat([t, t.new_full((width - t.numel(),), value)]) for t in tensors])
