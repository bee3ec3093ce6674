"""Which keys a query may see: per token, per block, and the block plan of a batch.

Every query ``i`` and key ``j`` carries a global position ``pos`` (its index in the global
row; positions of one document are consecutive) and a document id ``doc``. Key ``j`` is
visible to query ``i`` iff::

    doc(j) == doc(i)  and  pos(j) <= pos(i)  [and  pos(i) - pos(j) < W  with a sliding window W]

Nothing here assumes tokens are in sequence order, so the same rule serves one process,
the all-gathered keys of context parallelism, and any permutation of them.

Blocks. Cut queries and keys into blocks of ``b`` tokens (the last one shorter) and take,
per block, the range of positions ``[p_min, p_max]`` and of documents ``[d_min, d_max]``.
For a query block ``Q`` and a key block ``K``::

    maybe visible  <=  [d_min(Q), d_max(Q)] meets [d_min(K), d_max(K)]
                       and p_min(K) <= p_max(Q)   [and p_min(Q) - p_max(K) < W]
    all visible    <=  d_min(Q) = d_max(Q) = d_min(K) = d_max(K)
                       and p_max(K) <= p_min(Q)   [and p_max(Q) - p_min(K) < W]

"maybe" is a superset of the pairs with any visible key (exact when tokens are in
sequence order); the core skips every other pair and applies the token rule only on
pairs that are not "all visible". The pair tables are ``[S_q/b, S_k/b]`` booleans.

The plan lists the work as steps ``(query block, key start, key end, all_visible)``: runs of
consecutive key blocks of one query block row with the same kind, cut at
``keys_per_step`` keys, so one step is one large matrix product. Building it reads the
block ranges to the host once (the one host sync per batch); callers cache it in
``AttentionLayout.cache`` so every layer of a step shares it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "AttentionLayout",
    "block_plan",
    "block_ranges",
    "block_visibility",
    "cached",
    "check_block_sizes",
    "check_sliding_window",
    "cu_seqlens_of_rows",
    "invisible",
]

# Plan columns.
Q_BLOCK, K_START, K_END, ALL_VISIBLE = range(4)


@dataclass
class AttentionLayout:
    """Global position and document of every query and key of a row (shared by its batch).

    - ``q_pos``, ``k_pos`` int64 ``[S_q]``, ``[S_k]``; ``q_doc``, ``k_doc`` integer ids.
    - ``cu_seqlens`` int32 ``[n_docs + 1]`` and ``max_seqlen``: set only when queries and keys
      are the same row in sequence order (documents back to back), which fused varlen
      kernels need.
    - ``cache``: per-batch derived data (block plans, FlexAttention block masks), filled
      lazily by the kernels so every layer of a step shares it.
    """

    q_pos: Tensor
    q_doc: Tensor
    k_pos: Tensor
    k_doc: Tensor
    cu_seqlens: Tensor | None = None
    max_seqlen: int | None = None
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def sequence(cls, doc: Tensor, cu_seqlens: Tensor | None = None, max_seqlen: int | None = None) -> "AttentionLayout":
        """Self-attention over one row in sequence order: positions ``0..S-1``, ``doc [S]``."""
        pos = torch.arange(doc.numel(), dtype=torch.int64, device=doc.device)
        return cls(pos, doc, pos, doc, cu_seqlens, max_seqlen)

    @property
    def sequence_ordered(self) -> bool:
        return self.cu_seqlens is not None


def invisible(q_pos: Tensor, q_doc: Tensor, k_pos: Tensor, k_doc: Tensor, sliding_window: int | None = None) -> Tensor:
    """True where the key is NOT visible to the query (the rule above; broadcasts)."""
    hidden = (q_doc != k_doc) | (k_pos > q_pos)
    if sliding_window is not None:
        hidden = hidden | (q_pos - k_pos >= sliding_window)
    return hidden


def check_block_sizes(block_size: int, keys_per_step: int) -> None:
    """Raise ``ValueError`` unless ``1 <= block_size <= keys_per_step``."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"attention block_size must be an int >= 1, got {block_size!r}; use e.g. 128-512 on CPU.")
    if not isinstance(keys_per_step, int) or keys_per_step < block_size:
        raise ValueError(
            f"attention keys_per_step {keys_per_step!r} must be an int >= block_size {block_size}; "
            "use a multiple of block_size (e.g. 4 * block_size)."
        )


def check_sliding_window(sliding_window: int | None) -> None:
    """Raise ``ValueError`` unless ``sliding_window`` is None or an int >= 1."""
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(
            f"sliding_window must be None (no window) or an int >= 1 (keys at most W-1 positions back), "
            f"got {sliding_window!r}."
        )


def cached(cache: dict, key, build):
    """``cache[key]``, built on first use; built afresh, not stored, while ``torch.compile`` traces."""
    if torch.compiler.is_compiling():
        return build()
    if key not in cache:
        cache[key] = build()
    return cache[key]


def block_ranges(pos: Tensor, doc: Tensor, block_size: int) -> Tensor:
    """Per block of ``block_size`` tokens: int64 ``[n_blocks, 4]`` = (pos min, pos max, doc min, doc max)."""
    n = pos.numel()
    n_blocks = -(-n // block_size)
    pad = n_blocks * block_size - n  # repeat the last token: min/max unchanged
    pos, doc = pos.long(), doc.long()
    if pad:
        pos = torch.cat([pos, pos[-1:].expand(pad)])
        doc = torch.cat([doc, doc[-1:].expand(pad)])
    pos, doc = pos.view(n_blocks, block_size), doc.view(n_blocks, block_size)
    return torch.stack([pos.amin(1), pos.amax(1), doc.amin(1), doc.amax(1)], dim=1)


def block_visibility(q_ranges: Tensor, k_ranges: Tensor, sliding_window: int | None = None) -> tuple[Tensor, Tensor]:
    """``(maybe, all)`` boolean ``[n_q_blocks, n_k_blocks]`` from the block ranges (formulas above)."""
    qp_min, qp_max, qd_min, qd_max = (c[:, None] for c in q_ranges.unbind(1))
    kp_min, kp_max, kd_min, kd_max = (c[None, :] for c in k_ranges.unbind(1))
    maybe = (qd_min <= kd_max) & (kd_min <= qd_max) & (kp_min <= qp_max)
    every = (qd_min == qd_max) & (kd_min == kd_max) & (qd_min == kd_min) & (kp_max <= qp_min)
    if sliding_window is not None:
        maybe = maybe & (qp_min - kp_max < sliding_window)
        every = every & (qp_max - kp_min < sliding_window)
    return maybe, every & maybe


def block_plan(
    q_pos: Tensor, q_doc: Tensor, k_pos: Tensor, k_doc: Tensor, block_size: int, keys_per_step: int,
    sliding_window: int | None = None,
) -> Tensor:
    """The steps of blockwise attention: CPU int64 ``[n_steps, 4]``, sorted by query block.

    Columns: query block, first key, end key (exclusive), 1 if every pair is visible. The
    block ranges are computed where the tensors live, then read to the host in one copy.
    """
    n_q_blocks = -(-q_pos.numel() // block_size)
    ranges = torch.cat([block_ranges(q_pos, q_doc, block_size), block_ranges(k_pos, k_doc, block_size)])
    ranges = ranges.cpu()  # the one host sync of a batch's plan
    maybe, every = block_visibility(ranges[:n_q_blocks], ranges[n_q_blocks:], sliding_window)
    kind = maybe.long() + every.long()  # 0 skip, 1 token rule needed, 2 all visible
    q_block, k_block = torch.nonzero(kind, as_tuple=True)  # row-major: by query block, then key block
    kinds = kind[q_block, k_block]
    if q_block.numel() == 0:
        return torch.zeros(0, 4, dtype=torch.int64)
    new = torch.ones_like(q_block, dtype=torch.bool)
    new[1:] = (q_block[1:] != q_block[:-1]) | (k_block[1:] != k_block[:-1] + 1) | (kinds[1:] != kinds[:-1])
    run_start = torch.nonzero(new).flatten()  # [n_runs]
    offset = torch.arange(q_block.numel()) - run_start[torch.cumsum(new.long(), 0) - 1]
    new |= offset % max(1, keys_per_step // block_size) == 0  # cut long runs into steps
    first = torch.nonzero(new).flatten()
    last = torch.cat([first[1:], first.new_tensor([q_block.numel()])]) - 1
    k_end = torch.clamp((k_block[last] + 1) * block_size, max=k_pos.numel())
    return torch.stack([q_block[first], k_block[first] * block_size, k_end, (kinds[first] == 2).long()], dim=1)


def cu_seqlens_of_rows(cu_seqlens: Tensor, rows: int) -> Tensor:
    """Boundaries of ``rows`` copies of one row laid end to end (``[B, S] -> [B*S]``): int32."""
    seq_len = cu_seqlens[-1:]
    starts = cu_seqlens[:-1][None, :] + seq_len * torch.arange(rows, device=cu_seqlens.device, dtype=cu_seqlens.dtype)[:, None]
    return torch.cat([starts.flatten(), seq_len * rows]).to(torch.int32)
