"""The two custom ops a fused delta rule runs as, shared by the gated DeltaNet (``gdn_fused.py``) and Kimi
Delta Attention (``kda_fused.py``) on FLA's kernels.

``hybridpar::<name>`` runs the rule without autograd and saves only its inputs (q, k, v, g, beta, the
initial states, ``cu_seqlens``); ``hybridpar::<name>_backward`` runs the rule's backward alone where it
has one (FLA's, ``delta_backward.py``: none of the rule's forward kernels but what its backward reads),
or recomputes the rule with autograd on and differentiates it (a stand-in registered without a
backward, or an fla-core whose internals differ). ``torch.compile`` sees two opaque ops with
fake kernels (FLA's entry points are ``torch.compiler.disable``-d: a graph break otherwise). Both rules
take ``(q, k, v, g, beta, scale=, initial_state=, output_final_state=, cu_seqlens=)`` on one stream
``[1, T, ...]``: ``o [1, T, Hv, dv]`` in v's dtype, final states ``[N, Hv, dk, dv]`` in float32 or wider.

Both ops floor ``g`` where ``exp(g)`` is 0 in its dtype (``recurrence.underflow_log``, -104.3 in float32; no
value changes, and ``d g`` is 0 there as the floor's gradient says): FLA's kernels take ``exp`` of
differences of float32 within-chunk cumsums of ``g``, and after one saturated decay (-7e6) every later
step of the chunk was lost in the cumsum's rounding (``o`` 0.5 relative off float64 under triton's
interpreter; floored, 1e-5), as in the Mamba op (``models/mamba/fused_op.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from hybridpar.models.mamba.fused_op import autograd_on
from hybridpar.models.mamba.recurrence import underflow_log
from hybridpar.models.precision import autocast_off

__all__ = ["register_rule_ops"]


def register_rule_ops(name: str, kernel: Callable[[str], Callable], rule_backward: Callable[[str], Callable | None],
                      float32_states: bool = False):
    """Register ``hybridpar::{name}`` and ``hybridpar::{name}_backward`` over ``kernel(rule)`` (the rule a
    name stands for: ``"fla"`` or a registered stand-in) and ``rule_backward(rule)`` (its backward without its
    forward, ``delta_backward.py``'s signature, or None: autograd of the rule); ``float32_states``: FLA's
    kernel asserts float32 initial states. Returns the forward op ``(q, k, v, g, beta, initial_state,
    cu_seqlens, want_final, rule) -> (o, final states or an empty tensor)``."""

    def states(initial_state, rule):
        wants_float32 = initial_state is not None and float32_states and rule == "fla"
        return initial_state.float() if wants_float32 else initial_state

    def floored(g):  # the module docstring
        return g.clamp_min(underflow_log(g.dtype))

    def math(q, k, v, g, beta, initial_state, cu_seqlens, want_final, rule):
        fp = torch.promote_types(v.dtype, torch.float32)
        o, final = kernel(rule)(q, k, v, floored(g), beta, scale=q.shape[-1] ** -0.5,
                                initial_state=states(initial_state, rule), output_final_state=want_final,
                                cu_seqlens=cu_seqlens.long())
        return o.to(v.dtype), (final.to(fp) if want_final else None)

    def final_shape(q, v, cu_seqlens):
        return cu_seqlens.shape[0] - 1, v.shape[2], q.shape[3], v.shape[3]

    @torch.library.custom_op(f"hybridpar::{name}", mutates_args=())
    def rule_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                cu_seqlens: Tensor, want_final: bool, rule: str) -> tuple[Tensor, Tensor]:
        with torch.no_grad(), autocast_off():
            o, final = math(q, k, v, g, beta, initial_state, cu_seqlens, want_final, rule)
        return o, (final if final is not None else v.new_empty(0, dtype=torch.promote_types(v.dtype, torch.float32)))

    @rule_op.register_fake
    def _(q, k, v, g, beta, initial_state, cu_seqlens, want_final, rule):
        fp = torch.promote_types(v.dtype, torch.float32)
        final = v.new_empty(final_shape(q, v, cu_seqlens), dtype=fp) if want_final else v.new_empty(0, dtype=fp)
        return torch.empty_like(v), final

    @torch.library.custom_op(f"hybridpar::{name}_backward", mutates_args=())
    def backward_op(grad_o: Tensor, grad_final: Tensor | None, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                    beta: Tensor, initial_state: Tensor | None, cu_seqlens: Tensor, rule: str,
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        inputs = (q, k, v, g, beta, initial_state)
        direct = rule_backward(rule)
        if direct is not None:  # grad_o [1, T, Hv, dv] and grad_final [N, Hv, dk, dv] (None: no final states)
            with torch.no_grad(), autocast_off():
                grads = list(direct(q, k, v, floored(g), beta, grad_o, grad_final, scale=q.shape[-1] ** -0.5,
                                    initial_state=states(initial_state, rule), cu_seqlens=cu_seqlens.long()))
                grads[3] = grads[3].masked_fill(g < underflow_log(g.dtype), 0)  # the floor's gradient: 0 where it acts
        else:
            with autograd_on(), autocast_off():
                leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
                o, final = math(*leaves, cu_seqlens, grad_final is not None, rule)
                outputs, grads_out = [o], [grad_o]
                if final is not None:
                    outputs.append(final)
                    grads_out.append(grad_final)
                wanted = [leaf for leaf in leaves if leaf is not None]
                found = iter(torch.autograd.grad(outputs, wanted, grads_out, allow_unused=True))
            grads = [None if leaf is None else next(found) for leaf in leaves]
        return tuple(q.new_empty(0) if t is None else (torch.zeros_like(t) if d is None else d.to(t.dtype))
                     for d, t in zip(grads, inputs))

    @backward_op.register_fake
    def _(grad_o, grad_final, q, k, v, g, beta, initial_state, cu_seqlens, rule):
        return tuple(q.new_empty(0) if t is None else torch.empty_like(t) for t in (q, k, v, g, beta, initial_state))

    def setup_context(ctx, inputs, output):
        *tensors, want_final, rule = inputs
        ctx.save_for_backward(*tensors)  # q, k, v, g, beta, initial_state, cu_seqlens
        ctx.options = (want_final, rule)

    def backward(ctx, grad_o, grad_final):
        q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
        want_final, rule = ctx.options
        if grad_o is None:
            grad_o = torch.zeros_like(v)
        if want_final and grad_final is None:
            grad_final = v.new_zeros(final_shape(q, v, cu_seqlens), dtype=torch.promote_types(v.dtype, torch.float32))
        grads = backward_op(grad_o.contiguous(), grad_final.contiguous() if want_final else None, q, k, v, g, beta,
                            initial_state, cu_seqlens, rule)
        grads = [None if t is None else d for d, t in zip(grads, (q, k, v, g, beta, initial_state))]
        return (*grads, None, None, None)  # cu_seqlens, want_final, rule

    rule_op.register_autograd(backward, setup_context=setup_context)
    return rule_op
