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
``hybridpar::fused_kda_rule_backward`` runs FLA's backward kernels on the intra-chunk matrices its
forward would have saved, recomputed (``delta_backward.py``; autograd through the forward where
fla-core's internals differ), both registered by ``delta_ops.register_rule_ops`` as the gated DeltaNet's
are: ``torch.compile`` sees two opaque ops (FLA's entry point is ``torch.compiler.disable``-d, a graph
break otherwise).

``choose_kda_kernel`` says which runs (``models/mamba/fused.select_kernel``: the rules of the Mamba2
and gated DeltaNet kernels, the same ``use_mamba_kernel`` switch, logged once as ``kda kernel: ...``).
Tests register stand-ins (``register_rule``), such as FLA's contract written out in float64.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from hybridpar.models.linear.delta_backward import kda_backward
from hybridpar.models.linear.delta_ops import register_rule_ops
from hybridpar.models.mamba.fused import named_kernel, register_named, select_kernel
from hybridpar.models.mamba.fused_op import import_fla

__all__ = ["choose_kda_kernel", "fla_kda_status", "fused_kda_rule", "register_kda_rule"]

logger = logging.getLogger(__name__)
_RULES: dict[str, Callable] = {}
_BACKWARDS: dict[str, Callable | None] = {}
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


def register_kda_rule(name: str, rule: Callable, backward: Callable | None = None) -> None:
    """Make ``rule`` (``chunk_kda``'s signature) runnable as ``fused_kda_rule(..., rule=name)``; ``backward``
    (``delta_backward.kda_backward``'s signature) gives its gradients without its forward, or, by default,
    autograd of ``rule``."""
    register_named(_RULES, name, rule, "KDA rule")
    _BACKWARDS[name] = backward


def _kernel(name: str) -> Callable:
    return named_kernel(_RULES, name, fla_kda, "KDA rule")


def _backward(name: str) -> Callable | None:
    return kda_backward() if name == "fla" else _BACKWARDS[name]


# hybridpar::fused_kda_rule and its backward (delta_ops.py: no autograd forward; the rule's backward alone)
_rule_op = register_rule_ops("fused_kda_rule", _kernel, _backward, float32_states=True)


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
