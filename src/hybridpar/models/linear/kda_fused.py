"""The Kimi Delta Attention (KDA) rule through FLA's ``chunk_kda`` on CUDA, as two registered custom ops.

Our rule (``kda.py``) and FLA's are the same recurrence per value head, state ``S [dk, dv]``,
``S <- diag(exp(g_t)) S``, ``S <- S + beta_t k_t (v_t - S^T k_t)^T``, ``o_t = S^T (dk**-0.5 q_t)``,
with a log decay ``g_t [dk]`` per key channel, so the mapping is a change of layout only::

    chunk_kda(q, k [1, T, Hk, dk], v [1, T, Hv, dv], g [1, T, Hv, dk], beta [1, T, Hv],
              scale = dk**-0.5, initial_state [N, Hv, dk, dv] (float32), output_final_state,
              cu_seqlens [N+1])

with every row laid end to end on one stream whose documents (row starts among them) are
``cu_seqlens``; the initial states enter and the final states leave each of those sequences (FLA
gives states at sequence boundaries only, which is all the CP ``state`` strategy asks: its padded
segments are sequences). The l2 norm of q and k, beta and the log decay ``g`` are computed before
the op in float32 or wider (``kda_core.kda_inputs``), not by FLA's ``use_qk_l2norm_in_kernel`` /
``use_gate_in_kernel`` / ``use_beta_sigmoid_in_kernel``: the pure and fused paths then share every
step but the rule, and autograd of our own code gives the gradients of ``A_log`` and ``dt_bias``.
``g`` and ``beta`` stay float32, ``q``, ``k``, ``v`` go in the activations' dtype (bf16 under mixed
precision); FLA wants float32 initial states and returns float32 final states.

``hybridpar::fused_kda_rule`` runs it without autograd and saves only its inputs;
``hybridpar::fused_kda_rule_backward`` recomputes it with autograd on and differentiates (FLA's
backward kernels), the pattern of ``gdn_fused.py``: ``torch.compile`` sees two opaque ops (FLA's
entry point is ``torch.compiler.disable``-d, a graph break otherwise).

``choose_kda_kernel`` says which runs (``models/mamba/fused.select_kernel``: the rules of the Mamba2
and gated DeltaNet kernels, the same ``use_mamba_kernel`` switch, logged once as ``kda kernel: ...``).
Tests register stand-ins (``register_rule``), such as FLA's contract written out in float64.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from hybridpar.models.mamba.fused import select_kernel
from hybridpar.models.mamba.fused_op import autograd_on, import_fla
from hybridpar.models.precision import autocast_off

__all__ = ["choose_kda_kernel", "fla_kda_status", "fused_kda_rule", "register_kda_rule"]

logger = logging.getLogger(__name__)
_RULES: dict[str, Callable] = {}
_FLA: tuple[Callable | None, str] | None = None


def fla_kda() -> tuple[Callable | None, str]:
    """``(chunk_kda or None, why not)``: FLA's op if ``fla-core`` imports here, resolved once."""
    global _FLA
    if _FLA is None:
        _FLA = import_fla("fla.ops.kda", "chunk_kda", "chunk_kda")
    return _FLA


def fla_kda_status() -> tuple[bool, str]:
    """``(FLA's chunk_kda imports here, why or why not)`` (resolved before tracing)."""
    op, note = fla_kda()
    return op is not None, note


def choose_kda_kernel(x: Tensor) -> tuple[str, str]:
    """``(kernel, reason)`` for a KDA rule on activations ``x`` (their device and dtype): ``"pure"``
    or the rule ``fused_kda_rule`` runs (``"fla"`` or a stand-in); logged once."""
    return select_kernel("kda", x, fla_kda_status, logger)


def register_kda_rule(name: str, rule: Callable) -> None:
    """Make ``rule`` (``chunk_kda``'s signature) runnable as ``fused_kda_rule(..., rule=name)``."""
    if name == "fla":
        raise ValueError("the KDA rule name 'fla' is FLA's kernel; register a stand-in under another name.")
    _RULES[name] = rule


def _kernel(name: str) -> Callable:
    if name == "fla":
        op, why = fla_kda()
        if op is None:
            raise ValueError(f"the fused KDA rule 'fla' cannot run: {why}.")
        return op
    if name not in _RULES:
        raise ValueError(f"fused KDA rule {name!r} is not registered; known: {['fla', *_RULES]}.")
    return _RULES[name]


def _math(q, k, v, g, beta, initial_state, cu_seqlens, want_final, rule):
    """``(o [1, T, Hv, dv] in v's dtype, final states [N, Hv, dk, dv] in fp32 or wider, or None)``."""
    fp = torch.promote_types(v.dtype, torch.float32)
    if initial_state is not None and rule == "fla":
        initial_state = initial_state.float()  # FLA asserts float32 states
    o, final = _kernel(rule)(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=initial_state,
                             output_final_state=want_final, cu_seqlens=cu_seqlens.long())
    return o.to(v.dtype), (final.to(fp) if want_final else None)


@torch.library.custom_op("hybridpar::fused_kda_rule", mutates_args=())
def _rule_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
             cu_seqlens: Tensor, want_final: bool, rule: str) -> tuple[Tensor, Tensor]:
    with torch.no_grad(), autocast_off():
        o, final = _math(q, k, v, g, beta, initial_state, cu_seqlens, want_final, rule)
    return o, (final if final is not None else v.new_empty(0, dtype=torch.promote_types(v.dtype, torch.float32)))


@_rule_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, want_final, rule):
    fp = torch.promote_types(v.dtype, torch.float32)
    if not want_final:
        return torch.empty_like(v), v.new_empty(0, dtype=fp)
    return torch.empty_like(v), v.new_empty(cu_seqlens.shape[0] - 1, v.shape[2], k.shape[3], v.shape[3], dtype=fp)


@torch.library.custom_op("hybridpar::fused_kda_rule_backward", mutates_args=())
def _rule_backward_op(grad_o: Tensor, grad_final: Tensor | None, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                      beta: Tensor, initial_state: Tensor | None, cu_seqlens: Tensor, rule: str,
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    inputs = (q, k, v, g, beta, initial_state)
    with autograd_on(), autocast_off():
        leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
        o, final = _math(*leaves, cu_seqlens, grad_final is not None, rule)
        outputs, grads_out = [o], [grad_o]
        if final is not None:
            outputs.append(final)
            grads_out.append(grad_final)
        wanted = [leaf for leaf in leaves if leaf is not None]
        found = iter(torch.autograd.grad(outputs, wanted, grads_out, allow_unused=True))
    grads = [None if leaf is None else next(found) for leaf in leaves]
    return tuple(q.new_empty(0) if t is None else (torch.zeros_like(t) if d is None else d.to(t.dtype))
                 for d, t in zip(grads, inputs))


@_rule_backward_op.register_fake
def _(grad_o, grad_final, q, k, v, g, beta, initial_state, cu_seqlens, rule):
    return tuple(q.new_empty(0) if t is None else torch.empty_like(t) for t in (q, k, v, g, beta, initial_state))


def _setup_context(ctx, inputs, output):
    *tensors, want_final, rule = inputs
    ctx.save_for_backward(*tensors)  # q, k, v, g, beta, initial_state, cu_seqlens
    ctx.options = (want_final, rule)


def _backward(ctx, grad_o, grad_final):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    want_final, rule = ctx.options
    if grad_o is None:
        grad_o = torch.zeros_like(v)
    if want_final and grad_final is None:
        grad_final = v.new_zeros(cu_seqlens.shape[0] - 1, v.shape[2], k.shape[3], v.shape[3],
                                 dtype=torch.promote_types(v.dtype, torch.float32))
    grads = torch.ops.hybridpar.fused_kda_rule_backward(
        grad_o.contiguous(), grad_final.contiguous() if want_final else None, q, k, v, g, beta, initial_state,
        cu_seqlens, rule)
    grads = [None if t is None else d for d, t in zip(grads, (q, k, v, g, beta, initial_state))]
    return (*grads, None, None, None)  # cu_seqlens, want_final, rule


_rule_op.register_autograd(_backward, setup_context=_setup_context)


def fused_kda_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, cu_seqlens: Tensor,
                   initial_state: Tensor | None = None, output_final_state: bool = False,
                   rule: str = "fla") -> tuple[Tensor, Tensor | None]:
    """``q, k [1, T, Hk, dk]``, ``v [1, T, Hv, dv]``, ``g [1, T, Hv, dk]``, ``beta [1, T, Hv]`` on one
    stream of sequences ``cu_seqlens [N+1]`` -> ``(o [1, T, Hv, dv] in v's dtype, final states
    [N, Hv, dk, dv] in fp32 or wider, or None)`` through the named rule (default: FLA's
    ``chunk_kda``); ``initial_state [N, Hv, dk, dv]`` enters each sequence."""
    batch, tokens, k_heads, dk = k.shape
    v_heads = v.shape[2]
    if batch != 1 or q.shape != k.shape or v.shape[:2] != (1, tokens) or v_heads % k_heads or \
            g.shape != (1, tokens, v_heads, dk) or beta.shape != (1, tokens, v_heads):
        raise ValueError(f"fused KDA rule expects one stream: q, k [1, T, Hk, dk], v [1, T, Hv, dv] with Hv % Hk == 0, "
                         f"g [1, T, Hv, dk], beta [1, T, Hv]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}; flatten rows first.")
    o, final = torch.ops.hybridpar.fused_kda_rule(q, k, v, g, beta, initial_state, cu_seqlens, output_final_state, rule)
    return o, (final if output_final_state else None)
