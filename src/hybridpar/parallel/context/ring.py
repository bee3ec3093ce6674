"""Attention CP "ring": K and V travel around the group, partial results merge by logsumexp.

Rank ``r`` holds queries ``Q_r`` and keys/values ``KV_r`` (zigzag chunks ``r`` and
``2P-1-r`` of every document, so causal work is balanced). At step ``t = 0..P-1`` it holds
``KV_s`` of rank ``s = (r - t) mod P``, passes it on to rank ``r+1`` while it computes, with
the blockwise core on the global positions and documents of both sides, the partial result
``(o_t, lse_t)`` of ``Q_r`` over ``KV_s``. The partials merge exactly::

    lse = log sum_t exp(lse_t)        out = sum_t exp(lse_t - lse) * o_t

(a query that sees no key of ``KV_s`` has ``lse_t = -inf`` and gets nothing from it).
FlashAttention-2's backward needs only the final ``out`` and ``lse``, so it splits the same
way: at step ``t`` the rank adds ``KV_s``'s share to ``dQ_r`` and computes its queries' share
of ``dKV_s``; that accumulator travels with ``KV_s`` and one more hop after the last step
brings it home to rank ``s``.

Bytes each rank sends per attention layer (``e`` bytes per element of k, v; ``e_c`` of the
compute dtype, float32 or float64, in which dK, dV accumulate)::

    forward   (P-1) * e   * B * (S/P) * 2*Hkv * Dh     K, V: P-1 hops
    backward  (P-1) * e   * B * (S/P) * 2*Hkv * Dh     K, V again
            +   P   * e_c * B * (S/P) * 2*Hkv * Dh     dK, dV: P hops

Forward traffic equals "allgather"; the gain is memory: a rank holds its own and one
incoming block of ``S/P`` keys, never all ``S``. Ring runs the pure-PyTorch core on every
device (it needs each step's logsumexp and a backward that takes the final one) and in eager
mode only (its point-to-point exchange is Python code ``torch.compile`` breaks on). Building
the ``P`` block plans costs ``P`` small host syncs per batch, cached on ``packed``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hybridpar.data.thd import ContextParallelLayout, PackedSeqParams
from hybridpar.models.attention.layout import block_plan, cached
from hybridpar.models.attention.blockwise import blockwise_backward, blockwise_forward
from hybridpar.models.attention.sinks import sink_gradient, with_sinks
from hybridpar.parallel.comm.collectives import ring_shift
from hybridpar.parallel.context.attention_base import AttentionStrategy

__all__ = ["RingAttention"]

_KV_TAG, _GRAD_TAG = 0, 1  # the two shifts of a backward step are in flight together


def _merge(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor]:
    """``out, part [B, S, Hq, Dh]``, ``lse, part_lse [B, Hq, S]`` -> their exact combination."""
    merged = torch.logaddexp(lse, part_lse)
    safe = merged.masked_fill(merged == float("-inf"), 0.0)  # no key seen yet: both weights 0
    weight = lambda x: torch.exp(x - safe).transpose(1, 2)[..., None]  # noqa: E731 - [B, Hq, S] -> [B, S, Hq, 1]
    return out * weight(lse) + part * weight(part_lse), merged


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, strategy, q_pos, q_doc, steps, scale, window, softcap):
        group, num_kv_heads = strategy.cp_group, k.shape[2]
        dtype = torch.promote_types(q.dtype, torch.float32)
        blocks = strategy.core_options
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        options = (scale, window, blocks["block_size"], blocks["keys_per_step"], softcap)
        kv = torch.cat([k, v], dim=2)  # [B, S/P, 2*Hkv, Dh]
        out = lse = None
        for t, (k_pos, k_doc, plan) in enumerate(steps):
            shift = ring_shift(kv, group, _KV_TAG) if t + 1 < len(steps) else None  # [B, S/P, 2*Hkv, Dh] -> rank r+1
            k_s, v_s = kv.split(num_kv_heads, dim=2)
            part, part_lse = blockwise_forward(q, k_s, v_s, q_pos, q_doc, k_pos, k_doc, plan, *options)
            out, lse = (part.to(dtype), part_lse) if out is None else _merge(out, lse, part.to(dtype), part_lse)
            kv = shift.wait() if shift is not None else kv  # KV of rank r-t-1
        if sinks is not None:  # once, on the merged result: a zero-valued key every query sees
            out, lse = with_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, q_doc, sinks)
        ctx.strategy, ctx.steps, ctx.options = strategy, steps, options
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_pos, q_doc, sinks = ctx.saved_tensors
        group, num_kv_heads, steps = ctx.strategy.cp_group, k.shape[2], ctx.steps
        dtype = torch.promote_types(q.dtype, torch.float32)
        dout = dout.contiguous()
        kv = torch.cat([k, v], dim=2)  # [B, S/P, 2*Hkv, Dh]
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dkv = None  # the accumulator of the block this rank holds, received from rank r-1
        for t, (k_pos, k_doc, plan) in enumerate(steps):
            shift = ring_shift(kv, group, _KV_TAG) if t + 1 < len(steps) else None
            k_s, v_s = kv.split(num_kv_heads, dim=2)
            dq_s, dk_s, dv_s = blockwise_backward(dout, q, k_s, v_s, out, lse, q_pos, q_doc, k_pos, k_doc, plan,
                                                  *ctx.options)
            dq += dq_s
            share = torch.cat([dk_s, dv_s], dim=2).to(dtype)  # [B, S/P, 2*Hkv, Dh]
            dkv = share if dkv is None else dkv.add_(share)
            dkv = ring_shift(dkv, group, _GRAD_TAG).wait()  # with the block to rank r+1; home after the last step
            kv = shift.wait() if shift is not None else kv
        dk, dv = dkv.split(num_kv_heads, dim=2)
        dsinks = None if sinks is None else sink_gradient(dout, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(), dsinks, *(None,) * 7


class RingAttention(AttentionStrategy):
    """K, V around the CP ring; each step attends local queries to one rank's keys and merges."""

    name = "ring"

    def _steps(self, packed: PackedSeqParams, layout: ContextParallelLayout, device, window: int | None):
        """Query positions/documents and, per step ``t``, the keys' positions, documents and plan."""

        def build():
            held = layout.gathered_indices.to(device).view(self.cp_size, -1)  # [P, S/P]: global index per rank
            doc = layout.global_seq_idx[0].to(device)  # [S]
            q_pos, q_doc = layout.local_indices.to(device), packed.seq_idx[0].to(device)
            steps = []
            for t in range(self.cp_size):
                k_pos = held[(self.cp_rank - t) % self.cp_size]
                k_doc = doc.index_select(0, k_pos)
                steps.append((k_pos, k_doc, block_plan(q_pos, q_doc, k_pos, k_doc, **self.core_options,
                                                       sliding_window=window)))
            return q_pos, q_doc, steps

        return cached(packed.cache, ("attention.ring", str(device), *self.core_options.values(), window), build)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, packed: PackedSeqParams | None = None, *,
                 scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                 sinks: Tensor | None = None) -> Tensor:
        options = self.call_options(scale, sliding_window, softcap, sinks, q.shape[2])
        layout = self._layout_or_none(q, k, v, packed)
        if layout is None:
            return self._single_process(q, k, v, packed, options)
        q_pos, q_doc, steps = self._steps(packed, layout, q.device, sliding_window)
        return _Ring.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks, self, q_pos, q_doc, steps, scale,
                           sliding_window, softcap)  # [B, S/P, Hq, Dh]
