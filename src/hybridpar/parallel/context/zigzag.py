"""DualChunkSwap ("zigzag") index math for context parallelism, dense and packed.

Context parallel splits every (padded) document of length ``L`` into ``2*cp`` chunks of
``c = L / (2*cp)`` tokens; rank ``r`` keeps chunk ``r`` then chunk ``2*cp-1-r`` (an early and
a late chunk, so causal work is balanced). A dense sequence of length ``S`` is one document.
A packed row applies this per document, documents in order, so rank ``r``'s local row is::

    [doc0 chunk r, doc0 chunk 2cp-1-r, doc1 chunk r, doc1 chunk 2cp-1-r, ...]

and each rank holds ``L_d / cp`` tokens of document ``d``: local document starts are
``cu_seqlens_padded / cp``. Local position ``p`` of document ``d`` (start ``s_d``) maps to::

    global = s_d + r*c_d + p                  if p < c_d      (first chunk)
    global = s_d + (2cp-1-r)*c_d + (p - c_d)  otherwise       (second chunk)

Everything here is pure index math on tensors, built once per batch with vectorized ops
(no Python loop over documents) and carried by ``PackedSeqParams.cp``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from hybridpar.data.thd import ContextParallelLayout, PackedSeqParams, seq_idx_from_cu_seqlens, validate_cu_seqlens

__all__ = ["zigzag_indices", "build_cp_layout", "localize", "validate_zigzag_lengths"]


def _as_cu_seqlens(seq_len_or_cu_seqlens_padded: int | Tensor) -> Tensor:
    """An int ``S`` becomes ``[0, S]``; a tensor is checked as padded cu_seqlens. Returns int64."""
    if isinstance(seq_len_or_cu_seqlens_padded, Tensor):
        cu = seq_len_or_cu_seqlens_padded.to(torch.int64)
        validate_cu_seqlens(cu, "cu_seqlens_padded")
        return cu
    seq_len = int(seq_len_or_cu_seqlens_padded)
    if seq_len < 1:
        raise ValueError(f"sequence length must be a positive int, got {seq_len_or_cu_seqlens_padded!r}.")
    return torch.tensor([0, seq_len], dtype=torch.int64)


def _validate_cp(cp_size: int, cp_rank: int) -> None:
    if int(cp_size) < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}.")
    if not 0 <= int(cp_rank) < int(cp_size):
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}.")


def validate_zigzag_lengths(seq_len_or_cu_seqlens_padded: int | Tensor, cp_size: int) -> Tensor:
    """Check every (padded) document length is a multiple of ``2*cp``; return int64 cu_seqlens.

    Raises ``ValueError`` naming the first bad document, its length and the fix.
    """
    cu = _as_cu_seqlens(seq_len_or_cu_seqlens_padded)
    if int(cp_size) < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}.")
    if cp_size == 1:
        return cu
    lengths = cu[1:] - cu[:-1]
    bad = torch.nonzero(lengths % (2 * cp_size)).flatten()
    if bad.numel() > 0:
        doc = int(bad[0])
        length = int(lengths[doc])
        if isinstance(seq_len_or_cu_seqlens_padded, Tensor):
            what = f"padded document {doc} of cu_seqlens_padded {cu.tolist()} has length {length}, which is"
            fix = (
                f"pad every document to a multiple of {2 * cp_size} (the packer does this with "
                f"cp_size={cp_size})"
            )
        else:
            what = f"sequence length {length} is"
            fix = f"pad or truncate the sequence to a multiple of {2 * cp_size}, or use packed params"
        raise ValueError(
            f"{what} not divisible by 2*cp = {2 * cp_size} (context parallel splits each "
            f"document into 2*cp equal chunks); {fix}."
        )
    return cu


def _zigzag_indices_for_ranks(cu: Tensor, cp_size: int, ranks: Tensor) -> Tensor:
    """Global indices held by each rank in ``ranks``: int64 ``[len(ranks), T/cp]`` (validated ``cu``)."""
    starts = cu[:-1]  # [n_docs]
    chunk = (cu[1:] - cu[:-1]) // (2 * cp_size)  # [n_docs] tokens per chunk
    cu_local = cu // cp_size  # [n_docs + 1] local document starts
    local_pos = torch.arange(int(cu_local[-1]), dtype=torch.int64, device=cu.device)  # [T/cp]
    doc = torch.searchsorted(cu_local[1:].contiguous(), local_pos, right=True)  # [T/cp]
    p = local_pos - cu_local[doc]  # position inside the rank's part of its document
    c = chunk[doc]
    second = p >= c  # in the late chunk 2cp-1-r
    r = ranks.to(torch.int64).view(-1, 1)  # [R, 1]
    chunk_id = torch.where(second, 2 * cp_size - 1 - r, r)  # [R, T/cp]
    return starts[doc] + chunk_id * c + torch.where(second, p - c, p)  # [R, T/cp]


def zigzag_indices(seq_len_or_cu_seqlens_padded: int | Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Global token indices rank ``cp_rank`` holds, in its local order: int64 ``[T/cp]``.

    An int is a dense sequence length; a 1-D tensor is packed ``cu_seqlens_padded``.
    """
    _validate_cp(cp_size, cp_rank)
    cu = validate_zigzag_lengths(seq_len_or_cu_seqlens_padded, cp_size)
    ranks = torch.tensor([cp_rank], dtype=torch.int64, device=cu.device)
    return _zigzag_indices_for_ranks(cu, cp_size, ranks)[0]


def build_cp_layout(cu_seqlens_padded_or_seq_len: int | Tensor, cp_size: int, cp_rank: int) -> ContextParallelLayout:
    """This rank's ``ContextParallelLayout``: local, gathered (rank-major) and inverse indices."""
    _validate_cp(cp_size, cp_rank)
    cu = validate_zigzag_lengths(cu_seqlens_padded_or_seq_len, cp_size)
    ranks = torch.arange(cp_size, dtype=torch.int64, device=cu.device)
    all_ranks = _zigzag_indices_for_ranks(cu, cp_size, ranks)  # [cp, T/cp]
    gathered = all_ranks.reshape(-1)  # [T], order of an all-gather along the sequence
    gathered_to_sequence = torch.empty_like(gathered)
    gathered_to_sequence[gathered] = torch.arange(gathered.numel(), dtype=torch.int64, device=cu.device)  # argsort
    return ContextParallelLayout(
        cp_size=int(cp_size),
        cp_rank=int(cp_rank),
        local_indices=all_ranks[cp_rank].clone(),
        gathered_indices=gathered,
        gathered_to_sequence=gathered_to_sequence,
        # thd's helper builds its positions on the CPU, so hand it CPU cu_seqlens: [T] -> [1, T] on cu's device
        global_seq_idx=seq_idx_from_cu_seqlens(cu.to("cpu", torch.int32)).to(cu.device).unsqueeze(0),
    )


def localize(packed: PackedSeqParams, cp_size: int, cp_rank: int) -> PackedSeqParams:
    """This rank's view of a global ``PackedSeqParams``.

    Keeps the global ``cu_seqlens``/``cu_seqlens_padded``/``max_seqlen``; ``seq_idx`` and
    ``position_ids`` become ``[1, T/cp]`` (gathered at the local indices); ``cp`` is the layout.
    """
    if packed.cp is not None:
        raise ValueError(
            f"packed params are already localized (cp_size={packed.cp.cp_size}, cp_rank={packed.cp.cp_rank}); "
            "pass the global PackedSeqParams built by the collator, not a rank's view."
        )
    total = packed.total_tokens
    if packed.seq_idx.shape[-1] != total or packed.position_ids.shape[-1] != total:
        raise ValueError(
            f"packed seq_idx {tuple(packed.seq_idx.shape)} / position_ids {tuple(packed.position_ids.shape)} must "
            f"cover all cu_seqlens_padded[-1] = {total} tokens; build them with PackedSeqParams.from_cu_seqlens."
        )
    device = packed.seq_idx.device  # build the layout where the batch lives: layers index with it every step
    layout = build_cp_layout(packed.cu_seqlens_padded.to(device), cp_size, cp_rank)
    local = layout.local_indices
    return dataclasses.replace(
        packed,
        seq_idx=packed.seq_idx.index_select(-1, local),  # [1, T] -> [1, T/cp]
        position_ids=packed.position_ids.index_select(-1, local.to(packed.position_ids.device)),  # [1, T/cp]
        cp=layout,
    )
