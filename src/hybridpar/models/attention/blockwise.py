"""Blockwise document-causal attention with an online softmax (FlashAttention-2), pure PyTorch.

Shapes: ``q [B, S_q, Hq, Dh]``, ``k, v [B, S_k, Hkv, Dh]``, ``Hq = G * Hkv``; query head
``h`` reads kv head ``h // G``. Queries are viewed as ``[B, Hkv, (token, g), Dh]`` so a
block of ``n`` query tokens is one ``[n*G, Dh]`` matrix per kv head: GQA without copying
K or V. Visibility comes from global positions and document ids (``attention/layout.py``).

Forward, for one query block ``Q`` (``s = scale``) over its plan steps ``K_1, K_2, ...``
(runs of key blocks; invisible pairs are never computed)::

    S   = s * Q K_t^T   (-inf where the token rule hides a key, on partial steps only)
    m'  = max(m, rowmax S)          alpha = exp(m - m')       P = exp(S - m')
    l   = alpha * l + rowsum P      acc = alpha * acc + P V_t       m = m'
    out = acc / l                   lse = m + log l          (no visible key: out 0, lse -inf)

Backward, recomputing ``P = exp(S - lse)`` per step, with ``D = rowsum(dout * out)``::

    dV_t += P^T dout     dP = dout V_t^T     dS = P * (dP - D)
    dQ   += s * dS K_t    dK_t += s * dS^T Q

Logit soft-capping (Gemma2, ``softcap = c``) replaces the scores before the mask and softmax,
``S <- c * tanh(S / c)``; backward multiplies ``dS`` by its derivative ``1 - tanh(S / c)^2``.

The forward saves only q, k, v, out, lse and the (small, integer) positions, document ids
and plan. Working memory per step is ``B * Hq * block_size * keys_per_step`` scores, so
memory is linear in sequence length. Low-precision inputs are computed in float32.

Block sizes (CPU): ``block_size = 256`` tokens decides what can be skipped (a document
boundary wastes at most one block per query block); ``keys_per_step = 1024`` keys are
multiplied at once, so one step is a ``[256*G, Dh] x [Dh, 1024]`` product: large enough
that Python overhead is a few percent, small enough (12 MiB of float32 scores for 12
heads) to stay in cache-friendly, constant working memory. Measured in
``benchmarks/attention_memory.py``.

Under ``torch.compile`` ``blockwise_attention`` calls a ``torch.library.custom_op`` with
``register_autograd``: dynamo sees one opaque op per direction (no graph breaks); inside,
Python loops over the plan freely. In eager mode the same two functions run through a
``torch.autograd.Function``. The plan is a CPU tensor, so reading it costs no device sync;
when none is passed it is built inside (one host sync of the block ranges; the compiled
path builds it again in backward).
"""

from __future__ import annotations

import math
from itertools import groupby

import torch
from torch import Tensor

from hybridpar.models.precision import full_precision
from hybridpar.models.attention.layout import (
    ALL_VISIBLE,
    K_END,
    K_START,
    Q_BLOCK,
    block_plan,
    check_block_sizes,
    check_sliding_window,
    invisible,
)

__all__ = [
    "BLOCK_SIZE",
    "KEYS_PER_STEP",
    "blockwise_attention",
    "blockwise_backward",
    "blockwise_forward",
    "check_qkv",
    "check_softcap",
]

BLOCK_SIZE = 256
KEYS_PER_STEP = 1024


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _steps_by_query_block(plan: Tensor):
    """``(query block, [(k_start, k_end, all_visible), ...])`` for every query block with work."""
    rows = plan.tolist()  # a CPU tensor: no device sync
    for q_block, steps in groupby(rows, key=lambda row: row[Q_BLOCK]):
        yield q_block, [(row[K_START], row[K_END], bool(row[ALL_VISIBLE])) for row in steps]


def _heads_major(x: Tensor, start: int, end: int, num_kv_heads: int, dtype: torch.dtype) -> Tensor:
    """Tokens ``[start, end)`` of ``x [B, S, Hq, Dh]`` as ``[B, Hkv, (end-start)*G, Dh]`` (a copy)."""
    batch, _, num_heads, head_dim = x.shape
    n, group = end - start, num_heads // num_kv_heads
    block = x[:, start:end].view(batch, n, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    out = torch.empty(batch, num_kv_heads, n, group, head_dim, dtype=dtype, device=x.device).copy_(block)
    return out.view(batch, num_kv_heads, n * group, head_dim)


def _tokens_major(block: Tensor, n: int) -> Tensor:
    """Inverse of ``_heads_major`` for a block: ``[B, Hkv, n*G, Dh] -> [B, n, Hkv*G, Dh]`` (a view)."""
    batch, num_kv_heads, rows, head_dim = block.shape
    return block.view(batch, num_kv_heads, n, rows // n, head_dim).permute(0, 2, 1, 3, 4).flatten(2, 3)


def _hide(scores: Tensor, q_pos, q_doc, k_pos, k_doc, window: int | None) -> Tensor:
    """Set hidden ``[B, Hkv, n*G, K]`` scores to -inf in place (token rule, broadcast over G)."""
    batch, num_kv_heads, rows, keys = scores.shape
    n = q_pos.numel()
    hidden = invisible(q_pos[:, None], q_doc[:, None], k_pos[None, :], k_doc[None, :], window)  # [n, K]
    scores.view(batch, num_kv_heads, n, rows // n, keys).masked_fill_(hidden[:, None, :], float("-inf"))
    return scores


def _prepare(q, k, v, q_pos, q_doc, k_pos, k_doc, plan, window, block_size, keys_per_step):
    """``(compute dtype, block plan, k_t, v_t [B, Hkv, S_k, Dh])``: what forward and backward both start from."""
    dtype = _compute_dtype(q.dtype)
    if plan is None:
        plan = block_plan(q_pos, q_doc, k_pos, k_doc, block_size, keys_per_step, window)
    return dtype, plan, k.transpose(1, 2).to(dtype).contiguous(), v.transpose(1, 2).to(dtype).contiguous()


def _cap(scores: Tensor, softcap: float | None) -> Tensor | None:
    """Soft-cap ``scores`` in place (``c * tanh(S / c)``); returns ``tanh(S / c)`` for backward (None: no cap)."""
    if softcap is None:
        return None
    tanh = torch.tanh(scores / softcap)
    scores.copy_(tanh).mul_(softcap)
    return tanh


@full_precision
def blockwise_forward(q, k, v, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size, keys_per_step,
                      softcap=None):
    """``(out [B, S_q, Hq, Dh], lse [B, Hq, S_q])`` over these keys, no autograd (the ops' forward).

    ``lse`` is in the compute dtype, ``-inf`` (and ``out`` 0) where a query sees no key here, so
    partial results over disjoint key sets merge by ``lse = logaddexp(lse_1, lse_2)``.
    """
    batch, seq_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    dtype, plan, k_t, v_t = _prepare(q, k, v, q_pos, q_doc, k_pos, k_doc, plan, window, block_size, keys_per_step)
    out = torch.zeros_like(q)  # query blocks without any visible key stay 0
    lse = torch.full((batch, num_heads, seq_q), float("-inf"), dtype=dtype, device=q.device)
    lse_blocks = lse.view(batch, num_kv_heads, -1, seq_q)  # [B, Hkv, G, S_q]
    for q_block, steps in _steps_by_query_block(plan):
        start, end = q_block * block_size, min((q_block + 1) * block_size, seq_q)
        q_b = _heads_major(q, start, end, num_kv_heads, dtype).mul_(scale)  # [B, Hkv, n*G, Dh]
        for step, (k_start, k_end, all_visible) in enumerate(steps):
            scores = torch.matmul(q_b, k_t[:, :, k_start:k_end].transpose(-1, -2))  # [B, Hkv, n*G, K]
            _cap(scores, softcap)
            if not all_visible:
                _hide(scores, q_pos[start:end], q_doc[start:end], k_pos[k_start:k_end], k_doc[k_start:k_end], window)
            m_new = scores.amax(-1) if step == 0 else torch.maximum(m, scores.amax(-1))
            # rows that have seen no visible key yet keep m = -inf; exponentiate them against 0
            m_safe = m_new if all_visible else m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = scores.sub_(m_safe[..., None]).exp_()
            if step == 0:
                l, acc = p.sum(-1), torch.matmul(p, v_t[:, :, k_start:k_end])  # [B, Hkv, n*G], [B, Hkv, n*G, Dh]
            else:
                alpha = torch.exp(m - m_safe)
                l = l.mul_(alpha).add_(p.sum(-1))
                acc = acc.mul_(alpha[..., None]).add_(torch.matmul(p, v_t[:, :, k_start:k_end]))
            m = m_new
        m_safe = m.masked_fill(m == float("-inf"), 0.0)
        out[:, start:end] = _tokens_major(acc / l.masked_fill(l == 0, 1.0)[..., None], end - start)
        lse_blocks[..., start:end] = (m_safe + l.log()).view(batch, num_kv_heads, end - start, -1).transpose(-1, -2)
    return out, lse


@full_precision
def blockwise_backward(dout, q, k, v, out, lse, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size,
                       keys_per_step, softcap=None):
    """``(dq, dk, dv)`` of these keys' share, given the final ``out`` and ``lse`` (no autograd).

    FlashAttention-2's backward needs only the final ``out`` and ``lse``, so it splits over
    disjoint key sets: their ``dq`` add up, and each set gets its own ``dk, dv``.
    """
    batch, seq_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    dtype, plan, k_t, v_t = _prepare(q, k, v, q_pos, q_doc, k_pos, k_doc, plan, window, block_size, keys_per_step)
    dk_t, dv_t = torch.zeros_like(k_t), torch.zeros_like(v_t)
    dq = torch.zeros_like(q)
    lse_safe = lse.masked_fill(lse == float("-inf"), 0.0).view(batch, num_kv_heads, -1, seq_q)  # [B, Hkv, G, S_q]
    for q_block, steps in _steps_by_query_block(plan):
        start, end = q_block * block_size, min((q_block + 1) * block_size, seq_q)
        q_b = _heads_major(q, start, end, num_kv_heads, dtype).mul_(scale)  # [B, Hkv, n*G, Dh]
        do_b = _heads_major(dout, start, end, num_kv_heads, dtype)
        delta = (do_b * _heads_major(out, start, end, num_kv_heads, dtype)).sum(-1)  # [B, Hkv, n*G]
        lse_b = lse_safe[..., start:end].transpose(-1, -2).reshape(batch, num_kv_heads, -1)  # [B, Hkv, n*G]
        dq_b = torch.zeros_like(q_b)
        for k_start, k_end, all_visible in steps:
            k_s, v_s = k_t[:, :, k_start:k_end], v_t[:, :, k_start:k_end]  # [B, Hkv, K, Dh]
            scores = torch.matmul(q_b, k_s.transpose(-1, -2))  # [B, Hkv, n*G, K]
            tanh = _cap(scores, softcap)
            if not all_visible:
                _hide(scores, q_pos[start:end], q_doc[start:end], k_pos[k_start:k_end], k_doc[k_start:k_end], window)
            p = scores.sub_(lse_b[..., None]).exp_()
            dv_t[:, :, k_start:k_end] += torch.matmul(p.transpose(-1, -2), do_b)
            ds = torch.matmul(do_b, v_s.transpose(-1, -2)).sub_(delta[..., None]).mul_(p)  # dS
            if tanh is not None:  # through the cap: d(c tanh(S/c))/dS = 1 - tanh^2
                ds.mul_(tanh.square_().neg_().add_(1.0))
            dq_b += torch.matmul(ds, k_s)
            dk_t[:, :, k_start:k_end] += torch.matmul(ds.transpose(-1, -2), q_b)  # q_b carries the scale
        dq[:, start:end] = _tokens_major(dq_b.mul_(scale), end - start)
    dk = torch.empty_like(k).copy_(dk_t.transpose(1, 2))  # [B, Hkv, S_k, Dh] -> [B, S_k, Hkv, Dh], contiguous
    return dq, dk, torch.empty_like(v).copy_(dv_t.transpose(1, 2))


# ---------------------------------------------------------------- the ops torch.compile sees


@torch.library.custom_op("hybridpar::blockwise_attention_fwd", mutates_args=())
def _forward_op(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, q_doc: Tensor, k_pos: Tensor, k_doc: Tensor,
    plan: Tensor | None, scale: float, window: int | None, block_size: int, keys_per_step: int, softcap: float | None,
) -> tuple[Tensor, Tensor]:
    return blockwise_forward(q, k, v, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size, keys_per_step,
                             softcap)


@_forward_op.register_fake
def _(q, k, v, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size, keys_per_step, softcap):
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_compute_dtype(q.dtype))


@torch.library.custom_op("hybridpar::blockwise_attention_bwd", mutates_args=())
def _backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_pos: Tensor, q_doc: Tensor,
    k_pos: Tensor, k_doc: Tensor, plan: Tensor | None, scale: float, window: int | None, block_size: int,
    keys_per_step: int, softcap: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    return blockwise_backward(dout, q, k, v, out, lse, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size,
                              keys_per_step, softcap)


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size, keys_per_step, softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size, keys_per_step, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_pos, q_doc, k_pos, k_doc, plan)
    ctx.options = (scale, window, block_size, keys_per_step, softcap)
    ctx.mark_non_differentiable(lse)


def _backward_rule(ctx, dout, _dlse):
    q, k, v, out, lse, q_pos, q_doc, k_pos, k_doc, plan = ctx.saved_tensors
    dq, dk, dv = _backward_op(dout.contiguous(), q, k, v, out, lse, q_pos, q_doc, k_pos, k_doc, plan, *ctx.options)
    return dq, dk, dv, *(None,) * 10


_forward_op.register_autograd(_backward_rule, setup_context=_setup_context)


class _BlockwiseAttention(torch.autograd.Function):
    """The eager entry: the same forward and backward as the ops, without the op dispatcher.

    (A custom op's first call imports ``torch._dynamo``, seconds per process; eager
    training and every test rank would pay it for nothing.)
    """

    @staticmethod
    def forward(ctx, q, k, v, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size, keys_per_step, softcap):
        if plan is None:
            plan = block_plan(q_pos, q_doc, k_pos, k_doc, block_size, keys_per_step, window)
        out, lse = blockwise_forward(q, k, v, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size, keys_per_step,
                                     softcap)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, q_doc, k_pos, k_doc, plan)
        ctx.options = (scale, window, block_size, keys_per_step, softcap)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_pos, q_doc, k_pos, k_doc, plan = ctx.saved_tensors
        dq, dk, dv = blockwise_backward(dout.contiguous(), q, k, v, out, lse, q_pos, q_doc, k_pos, k_doc, plan,
                                        *ctx.options)
        return dq, dk, dv, *(None,) * 10


# ---------------------------------------------------------------- public entry


def check_softcap(softcap: float | None) -> None:
    """Raise ``ValueError`` unless ``softcap`` is None or a finite number > 0."""
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"attention logit soft-capping {softcap!r} must be None or a finite number > 0 (the scores "
                         "become softcap * tanh(scores / softcap)).")


def check_qkv(q: Tensor, k: Tensor, v: Tensor, where: str = "attention") -> None:
    """Raise ``ValueError`` unless ``q [B, S_q, Hq, Dh]``, ``k, v [B, S_k, Hkv, Dh]`` with ``Hkv | Hq``."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{where} expects q [B, S_q, Hq, Dh] and k, v [B, S_k, Hkv, Dh] (same B and Dh), got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}; reshape the projections to [batch, tokens, heads, head_dim]."
        )
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads {num_heads} must be a positive multiple of kv heads {num_kv_heads} (grouped-query "
            "attention); choose num_attention_heads divisible by num_key_value_heads."
        )


def blockwise_attention(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, q_doc: Tensor, k_pos: Tensor, k_doc: Tensor,
    plan: Tensor | None = None, *, scale: float | None = None, sliding_window: int | None = None,
    block_size: int = BLOCK_SIZE, keys_per_step: int = KEYS_PER_STEP, softcap: float | None = None,
) -> Tensor:
    """Document-causal attention ``[B, S_q, Hq, Dh]`` of ``q`` over ``k, v``, never ``[S_q, S_k]``.

    ``q_pos, q_doc [S_q]`` and ``k_pos, k_doc [S_k]`` are global positions and document ids
    (any token order). ``plan`` is ``attention_layout.block_plan(...)`` for the same
    arguments, built once per batch; without it the op builds its own (one host sync).
    ``scale`` defaults to ``1/sqrt(Dh)``; ``sliding_window`` ``W`` also hides keys ``W`` or
    more positions back; ``softcap`` ``c`` caps the scores at ``c * tanh(S / c)``.
    """
    check_qkv(q, k, v, "blockwise_attention")
    check_block_sizes(block_size, keys_per_step)
    if q_pos.shape != (q.shape[1],) or q_doc.shape != (q.shape[1],) or k_pos.shape != (k.shape[1],) or k_doc.shape != (k.shape[1],):
        raise ValueError(
            f"positions and document ids must be 1-D, one per token: q_pos {tuple(q_pos.shape)}, q_doc "
            f"{tuple(q_doc.shape)} for {q.shape[1]} queries, k_pos {tuple(k_pos.shape)}, k_doc {tuple(k_doc.shape)} "
            f"for {k.shape[1]} keys; pass one row of ids (they are shared by the batch)."
        )
    check_sliding_window(sliding_window)
    check_softcap(softcap)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    args = (q.contiguous(), k.contiguous(), v.contiguous(), q_pos, q_doc, k_pos, k_doc, plan, scale, sliding_window,
            block_size, keys_per_step, None if softcap is None else float(softcap))
    if torch.compiler.is_compiling():
        return _forward_op(*args)[0]
    return _BlockwiseAttention.apply(*args)
