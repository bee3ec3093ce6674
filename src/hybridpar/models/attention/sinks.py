"""Attention sinks (GPT-OSS): one learned logit per query head that takes part in the softmax and
adds nothing to the output, on top of the blockwise core.

A sink ``s_h`` is a key every query sees, with score ``s_h`` and value 0. With the core's
``out_i`` and ``lse_i`` over the real keys of query ``i`` (head ``h``)::

    L_i    = logaddexp(lse_i, s_h)                 the softmax's normaliser, sink included
    out'_i = out_i * exp(lse_i - L_i)              the real keys' weights shrink; the sink adds 0

FlashAttention-2's backward needs only the final output and normaliser, and a zero-valued key
changes neither formula, so ``dq, dk, dv`` are the core's backward run with ``out'`` and ``L``.
The sink's own gradient, with ``D_i = rowsum(dout_i * out'_i)`` and ``p_i = exp(s_h - L_i)`` its
probability, is ``ds_h = sum_i p_i * (dout_i . 0 - D_i) = -sum_i p_i D_i`` (over the batch too).
A query that sees no key gets ``out' = 0`` (all its weight on the sink), as transformers' eager
attention gives it.

Under ``torch.compile`` dynamo sees two custom ops (forward, backward), as for the blockwise core:
no graph break. Single-device math. The context-parallel strategies whose queries see every key
in one core call use it as it is (allgather; ulysses on its rank's heads' sinks); ring attention
applies ``with_sinks`` once to its merged result and adds ``sink_gradient`` in backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridpar.models.attention.blockwise import _compute_dtype, blockwise_backward, blockwise_forward
from hybridpar.models.attention.layout import block_plan

__all__ = ["check_sinks", "sink_attention", "with_sinks", "sink_gradient"]


def check_sinks(sinks: Tensor, num_heads: int, where: str = "attention") -> None:
    """Raise ``ValueError`` unless ``sinks`` is a floating ``[Hq]`` tensor (one logit per query head)."""
    if not isinstance(sinks, Tensor) or sinks.shape != (num_heads,) or not sinks.is_floating_point():
        shape = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise ValueError(f"{where}: attention sinks must be one floating logit per query head, shape ({num_heads},), "
                         f"got {shape}; pass the module's sinks parameter for its local heads.")


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(out', L)``: ``out [B, S, Hq, Dh]``, ``lse [B, Hq, S]`` (compute dtype) with the sinks added."""
    s = sinks.to(lse.dtype)[None, :, None]  # [1, Hq, 1]
    total = torch.logaddexp(lse, s)  # [B, Hq, S]; lse = -inf gives s
    keep = torch.exp(lse - total).transpose(1, 2)[..., None]  # [B, S, Hq, 1]
    return (out.to(lse.dtype) * keep).to(out.dtype), total


def sink_gradient(dout: Tensor, out: Tensor, total: Tensor, sinks: Tensor) -> Tensor:
    """``ds [Hq] = -sum_{b,i} exp(s_h - L_i) D_i``, ``D_i = rowsum(dout_i * out'_i)``; ``dout, out'
    [B, S, Hq, Dh]``, ``L [B, Hq, S]`` (module docstring)."""
    delta = (dout.to(total.dtype) * out.to(total.dtype)).sum(-1).transpose(1, 2)  # D [B, Hq, S]
    p_sink = torch.exp(sinks.to(total.dtype)[None, :, None] - total)  # [B, Hq, S]
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)  # [Hq]


def _forward(q, k, v, sinks, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size, keys_per_step, softcap):
    """``(out' [B, S, Hq, Dh], L [B, Hq, S])`` (no autograd)."""
    if plan is None:
        plan = block_plan(q_pos, q_doc, k_pos, k_doc, block_size, keys_per_step, window)
    out, lse = blockwise_forward(q, k, v, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size, keys_per_step,
                                 softcap)
    return with_sinks(out, lse, sinks)


def _backward(dout, q, k, v, sinks, out, total, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size,
              keys_per_step, softcap):
    """``(dq, dk, dv, dsinks)`` (no autograd)."""
    if plan is None:
        plan = block_plan(q_pos, q_doc, k_pos, k_doc, block_size, keys_per_step, window)
    dq, dk, dv = blockwise_backward(dout, q, k, v, out, total, q_pos, q_doc, k_pos, k_doc, plan, scale, window,
                                    block_size, keys_per_step, softcap)
    return dq, dk, dv, sink_gradient(dout, out, total, sinks)


# ---------------------------------------------------------------- the ops torch.compile sees (no graph break)


@torch.library.custom_op("hybridpar::sink_attention_fwd", mutates_args=())
def _forward_op(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, q_pos: Tensor, q_doc: Tensor, k_pos: Tensor, k_doc: Tensor,
    plan: Tensor | None, scale: float, window: int | None, block_size: int, keys_per_step: int, softcap: float | None,
) -> tuple[Tensor, Tensor]:
    out, total = _forward(q, k, v, sinks, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size, keys_per_step,
                          softcap)
    return out, total


@_forward_op.register_fake
def _(q, k, v, sinks, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size, keys_per_step, softcap):
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_compute_dtype(q.dtype))


@torch.library.custom_op("hybridpar::sink_attention_bwd", mutates_args=())
def _backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, out: Tensor, total: Tensor, q_pos: Tensor,
    q_doc: Tensor, k_pos: Tensor, k_doc: Tensor, plan: Tensor | None, scale: float, window: int | None,
    block_size: int, keys_per_step: int, softcap: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward(dout, q, k, v, sinks, out, total, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size,
                     keys_per_step, softcap)


@_backward_op.register_fake
def _(dout, q, k, v, sinks, out, total, q_pos, q_doc, k_pos, k_doc, plan, scale, window, block_size, keys_per_step,
      softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(sinks)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, sinks, q_pos, q_doc, k_pos, k_doc, plan, *options = inputs
    ctx.save_for_backward(q, k, v, sinks, *output, q_pos, q_doc, k_pos, k_doc, plan)
    ctx.options = tuple(options)
    ctx.mark_non_differentiable(output[1])


def _backward_rule(ctx, dout, _dtotal):
    grads = _backward_op(dout.contiguous(), *ctx.saved_tensors, *ctx.options)
    return *grads, *(None,) * 10


_forward_op.register_autograd(_backward_rule, setup_context=_setup_context)


class _SinkAttention(torch.autograd.Function):
    """The eager entry: the ops' forward and backward without the op dispatcher (as
    ``blockwise._BlockwiseAttention``: a custom op's first call imports dynamo)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, q_pos, q_doc, k_pos, k_doc, plan, *options):
        if plan is None:
            plan = block_plan(q_pos, q_doc, k_pos, k_doc, *options[2:4], options[1])
        out, total = _forward(q, k, v, sinks, q_pos, q_doc, k_pos, k_doc, plan, *options)
        ctx.save_for_backward(q, k, v, sinks, out, total, q_pos, q_doc, k_pos, k_doc, plan)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, dout):
        return *_backward(dout.contiguous(), *ctx.saved_tensors, *ctx.options), *(None,) * 10


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, q_pos: Tensor, q_doc: Tensor, k_pos: Tensor,
                   k_doc: Tensor, plan: Tensor | None, *, scale: float, sliding_window: int | None, block_size: int,
                   keys_per_step: int, softcap: float | None) -> Tensor:
    """``blockwise_attention`` (same arguments, checked by its caller) with ``sinks [Hq]`` (module docstring)."""
    check_sinks(sinks, q.shape[2])
    args = (q.contiguous(), k.contiguous(), v.contiguous(), sinks, q_pos, q_doc, k_pos, k_doc, plan, scale,
            sliding_window, block_size, keys_per_step, softcap)
    if torch.compiler.is_compiling():
        return _forward_op(*args)[0]
    return _SinkAttention.apply(*args)
