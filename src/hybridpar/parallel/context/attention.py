"""Context-parallel attention: strategies for the ``Attention.core`` seam.

Each rank holds ``S/P`` tokens of every row (``P`` = CP size, zigzag order, see
``zigzag.py``) and calls ``core(q, k, v, packed)`` with ``q [B, S/P, Hq, Dh]``,
``k, v [B, S/P, Hkv, Dh]`` (after RoPE) and its localized ``PackedSeqParams``. A
strategy owns no parameters, so gradients land on the model's own projections.

The single-process core computes, for every query token ``i``,
``out_i = sum_j softmax_j(q_i . k_j / sqrt(Dh) | M_ij) v_j`` with the visibility
``M_ij = [doc(j) == doc(i)] and [j <= i]`` over global indices ``i, j``. Both strategies
compute exactly this with the blockwise core (``models/attention_kernels.attention_core``,
which never builds ``M``: it skips key blocks no query of a block can see and applies the
rule token by token only on the blocks that need it); they differ in what travels.

``"allgather"`` (``AllGatherAttention``): all-gather ``K, V`` so every rank has all ``S``
keys, in rank-major gathered order, and put them in sequence order
(``cp.gathered_to_sequence``; a local ``index_select``, so key blocks hold consecutive
positions and skip well). Rank ``r`` attends its ``S/P`` queries (global positions
``cp.local_indices``, documents ``seq_idx``) to them (positions ``0..S-1``, documents
``cp.global_seq_idx``), so the token order of the queries never matters. In backward the
``index_select`` scatters ``dK, dV`` back to gathered order and the all-gather's backward
reduce-scatters them to their owners.

``"ulysses"`` (``UlyssesAttention``): one all-to-all turns sequence-sharded
``[B, S/P, H*Dh]`` into head-sharded ``[B, S, H/P*Dh]`` for ``q``, ``k`` and ``v`` at once;
``cp.gathered_to_sequence`` puts the gathered tokens in sequence order, the rank runs the
single-process document-causal core on its ``Hq/P`` query heads over the whole
sequence (sequence order: on CUDA the varlen kernel applies), the result goes back to
gathered order and a second all-to-all returns
``[B, S/P, Hq*Dh]``. Needs ``Hq % P == 0``. KV heads travel as ``Hkv' = lcm(Hkv, P)``
heads (each repeated ``Hkv'/Hkv`` times; ``Hkv' = Hkv`` when ``P`` divides ``Hkv``), so that
rank ``r`` receives kv heads ``[r Hkv'/P, (r+1) Hkv'/P)`` and its query head ``h`` uses
local kv head ``(h - r Hq/P) // (Hq/Hkv')``, i.e. original kv head ``h // (Hq/Hkv)``.

``"ring"`` (``cp_ring.RingAttention``): K, V travel around the group point to point and
partial results merge by their logsumexp; the math and its bytes are in ``context/ring.py``.

No tensor of ``[S/P, S]`` or ``[S, S]`` elements exists on any path: the largest
working tensor is one step of scores, ``B * Hq * block_size * keys_per_step``.

Bytes each rank sends per attention layer (``e`` bytes per element, counted as
``comm.CommStats`` does: all-gather ``(P-1)`` x shard, reduce-scatter and all-to-all
``(P-1)/P`` x the rank's buffer)::

    allgather  forward   (P-1)   * e * B * (S/P) * 2*Hkv * Dh              all-gather of [k|v]
               backward  (P-1)/P * e * B *  S    * 2*Hkv * Dh              reduce-scatter of d[k|v]
                         = the forward count
    ulysses    forward   (P-1)/P * e * B * (S/P) * (Hq + 2*Hkv') * Dh      all-to-all of [q|k|v]
                       + (P-1)/P * e * B * (S/P) * Hq * Dh                 all-to-all of out
                       = (P-1)/P * e * B * (S/P) * (2*Hq + 2*Hkv') * Dh
               backward  the same two all-to-alls transposed: the forward count

"allgather" grows with ``S`` whatever ``P`` is; "ulysses" shrinks as ``S/P`` (see
``reference/peers-and-anchors.md`` B.2(c)).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.attention.mixer import Attention
from hybridpar.models.attention.kernels import attention_core
from hybridpar.models.attention.layout import AttentionLayout, cached
from hybridpar.parallel.comm.collectives import all_gather, hidden_to_seq, seq_to_hidden
from hybridpar.parallel.context.attention_base import AttentionStrategy, global_sequence_layout
from hybridpar.parallel.context.ring import RingAttention

__all__ = [
    "AllGatherAttention",
    "RingAttention",
    "UlyssesAttention",
    "STRATEGIES",
    "apply_attention_cp",
    "attention_cp_bytes_per_layer",
    "ulysses_kv_heads",
]


def ulysses_kv_heads(num_kv_heads: int, cp_size: int) -> int:
    """KV heads that travel in the ulysses all-to-all: ``lcm(Hkv, P)`` (``Hkv`` when ``P | Hkv``)."""
    return math.lcm(num_kv_heads, cp_size)


def attention_cp_bytes_per_layer(
    strategy: str, batch: int, seq_len: int, cp: int, num_heads: int, num_kv_heads: int, head_dim: int,
    element_size: int,
) -> float:
    """Bytes one rank sends per attention layer in the forward pass (allgather, ulysses: the backward
    sends as many; ring: see ``context/ring.py``)."""
    if cp == 1:
        return 0.0
    if strategy == "allgather":
        return (cp - 1) * element_size * batch * (seq_len / cp) * 2 * num_kv_heads * head_dim
    if strategy == "ulysses":
        width = 2 * num_heads + 2 * ulysses_kv_heads(num_kv_heads, cp)
        return (cp - 1) / cp * element_size * batch * (seq_len / cp) * width * head_dim
    if strategy == "ring":  # the forward equals allgather's; its backward sends K, V and dK, dV (context/ring.py)
        return (cp - 1) * element_size * batch * (seq_len / cp) * 2 * num_kv_heads * head_dim
    raise ValueError(f"unknown attention context-parallel strategy {strategy!r}; choose one of {sorted(STRATEGIES)}.")


class AllGatherAttention(AttentionStrategy):
    """All-gather K, V over CP; local queries attend to all keys by global positions and documents."""

    name = "allgather"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, packed: PackedSeqParams | None = None, *,
                 scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                 sinks: Tensor | None = None) -> Tensor:
        options = self.call_options(scale, sliding_window, softcap, sinks, q.shape[2])
        layout = self._layout_or_none(q, k, v, packed)
        if layout is None:
            return self._single_process(q, k, v, packed, options)
        num_kv_heads = k.shape[2]
        device = q.device
        kv = torch.cat([k, v], dim=2)  # 2 x [B, S/P, Hkv, Dh] -> [B, S/P, 2*Hkv, Dh]
        kv = all_gather(kv, self.cp_group, 1)  # [B, S/P, 2*Hkv, Dh] -> [B, S, 2*Hkv, Dh], gathered order
        to_sequence = layout.gathered_to_sequence.to(device)  # [S]
        k_all, v_all = (x.index_select(1, to_sequence) for x in kv.split(num_kv_heads, dim=2))  # [B, S, Hkv, Dh]

        def build() -> AttentionLayout:
            keys = global_sequence_layout(packed, layout, device)
            return AttentionLayout(layout.local_indices.to(device), packed.seq_idx[0].to(device), keys.k_pos, keys.k_doc)

        attention_layout = cached(packed.cache, ("attention.allgather", str(device)), build)
        return attention_core(q, k_all, v_all, attention_layout, **options)  # [B, S/P, Hq, Dh]


class UlyssesAttention(AttentionStrategy):
    """All-to-all sequence -> heads, full-sequence attention on Hq/P heads, all-to-all back."""

    name = "ulysses"

    def validate_heads(self, num_heads: int, num_kv_heads: int) -> None:
        super().validate_heads(num_heads, num_kv_heads)
        if num_heads % self.cp_size:
            divisors = [p for p in range(1, num_heads + 1) if num_heads % p == 0]
            raise ValueError(
                f"ulysses attention splits query heads over the context-parallel group, but {num_heads} query "
                f"head{'s' * (num_heads != 1)} (per tensor-parallel rank) {'are' if num_heads != 1 else 'is'} not "
                f"divisible by cp={self.cp_size}; use the \"allgather\" "
                f"strategy, or a cp that divides the heads (one of {divisors})."
            )

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, packed: PackedSeqParams | None = None, *,
                 scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                 sinks: Tensor | None = None) -> Tensor:
        options = self.call_options(scale, sliding_window, softcap, sinks, q.shape[2])
        layout = self._layout_or_none(q, k, v, packed)
        if layout is None:
            return self._single_process(q, k, v, packed, options)
        batch, local_len, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[2]
        kv_heads = ulysses_kv_heads(num_kv_heads, self.cp_size)
        if kv_heads != num_kv_heads:  # kv head j of the exchange is original head j // (Hkv'/Hkv)
            k = k.repeat_interleave(kv_heads // num_kv_heads, dim=2)  # [B, S/P, Hkv, Dh] -> [B, S/P, Hkv', Dh]
            v = v.repeat_interleave(kv_heads // num_kv_heads, dim=2)
        flat = [x.reshape(batch, local_len, -1) for x in (q, k, v)]  # [B, S/P, H*Dh], heads contiguous
        q_h, k_h, v_h = seq_to_hidden(flat, self.cp_group, seq_dim=1, hidden_dim=-1)  # -> [B, S, H/P*Dh]
        device = q.device
        to_sequence = layout.gathered_to_sequence.to(device)  # [S]
        to_gathered = layout.gathered_indices.to(device)  # [S]
        seq_len = to_sequence.numel()
        q_h, k_h, v_h = (
            x.index_select(1, to_sequence).view(batch, seq_len, -1, head_dim) for x in (q_h, k_h, v_h)
        )  # [B, S, H/P, Dh], sequence order
        if sinks is not None:  # this rank's heads after the exchange: query heads [r*Hq/P, (r+1)*Hq/P)
            options["sinks"] = sinks.chunk(self.cp_size)[self.cp_rank]
        out = attention_core(q_h, k_h, v_h, global_sequence_layout(packed, layout, device), **options)
        out = out.reshape(batch, seq_len, -1).index_select(1, to_gathered)  # [B, S, Hq/P*Dh], gathered order
        (out,) = hidden_to_seq([out], self.cp_group, seq_dim=1, hidden_dim=-1)  # -> [B, S/P, Hq*Dh]
        return out.view(batch, local_len, num_heads, head_dim)


STRATEGIES = {"allgather": AllGatherAttention, "ulysses": UlyssesAttention, "ring": RingAttention}


def _local_heads(attention: Attention) -> tuple[int, int]:
    """Query and kv heads this rank computes (after any tensor-parallel sharding of the projections)."""

    def rows(linear: nn.Linear) -> int:
        weight = linear.weight
        weight = weight.to_local() if hasattr(weight, "to_local") else weight  # DTensor under TP
        return weight.shape[0] // attention.head_dim

    return rows(attention.q_proj), rows(attention.k_proj)


def apply_attention_cp(model: nn.Module, cp_group: dist.ProcessGroup | None, strategy: str = "allgather") -> nn.Module:
    """Install a CP strategy as ``core`` of every ``Attention`` in ``model``; returns ``model``.

    Head counts are checked on every module before any is changed, so a bad layout raises
    ``ValueError`` here, long before a collective could hang.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown attention context-parallel strategy {strategy!r}; choose one of {sorted(STRATEGIES)}.")
    attentions = [(name, m) for name, m in model.named_modules() if isinstance(m, Attention)]
    core = STRATEGIES[strategy](cp_group)
    for name, attention in attentions:
        num_heads, num_kv_heads = _local_heads(attention)
        try:
            core.validate_heads(num_heads, num_kv_heads)
        except ValueError as error:
            raise ValueError(f"attention module {name or '<root>'!r}: {error}") from None
    for _, attention in attentions:
        attention.core = core
    return model
