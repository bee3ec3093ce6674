"""The gated delta rule through FLA's ``chunk_gated_delta_rule`` on CUDA, as two registered custom ops.

Our rule (``gated_delta.py``) and FLA's are the same recurrence per value head, state ``S [dk, dv]``,
``S <- exp(g_t) S``, ``S <- S + beta_t k_t (v_t - S^T k_t)^T``, ``o_t = S^T (dk**-0.5 q_t)``, with
value head ``h`` reading key head ``h // (Hv/Hk)`` (FLA's grouped values), so the mapping is a
change of layout only::

    chunk_gated_delta_rule(q, k [1, T, Hk, dk], v [1, T, Hv, dv], g, beta [1, T, Hv],
                           scale = dk**-0.5, initial_state [N, Hv, dk, dv], output_final_state,
                           cu_seqlens [N+1])

with every row laid end to end on one stream whose documents (row starts among them) are
``cu_seqlens``; the initial states enter and the final states leave each of those sequences. The
l2 norm of q and k, beta and the log decay ``g`` are computed before the op in float32 or wider
(``gdn_core.gdn_inputs``, not FLA's in-kernel versions); ``g`` and ``beta`` stay float32, ``q``,
``k``, ``v`` go in the activations' dtype (bf16 under mixed precision; FLA accumulates states in
float32 and returns final states in float32). FLA's kernel takes float32/bf16/fp16 only.

``hybridpar::fused_gated_delta_rule`` runs it without autograd and saves only its inputs;
``hybridpar::fused_gated_delta_rule_backward`` runs FLA's backward kernels on the intra-chunk matrix
its forward would have saved, recomputed (``delta_backward.py``; autograd through the forward where
fla-core's internals differ), both registered by ``delta_ops.register_rule_ops``, shared with KDA, the
pattern of ``models/mamba/fused_op.py``: ``torch.compile`` sees two opaque ops (FLA's entry point is
``torch.compiler.disable``-d, a graph break otherwise).

``choose_gdn_kernel`` says which runs (``models/mamba/fused.select_kernel``: the same rules, the
same ``use_mamba_kernel`` switch, logged once as ``gdn kernel: ...``). Tests register stand-ins
(``register_rule``), such as FLA's contract written out in float64.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from hybridpar.models.linear.delta_backward import gdn_backward
from hybridpar.models.linear.delta_ops import register_rule_ops
from hybridpar.models.mamba.fused import named_kernel, register_named, select_kernel
from hybridpar.models.mamba.fused_op import fla_gated_backward_refusal, import_fla

__all__ = ["choose_gdn_kernel", "fla_rule", "fla_rule_status", "fused_gated_delta_rule", "register_rule"]

logger = logging.getLogger(__name__)
_RULES: dict[str, Callable] = {}
_BACKWARDS: dict[str, Callable | None] = {}
_FLA: tuple[Callable | None, str] | None = None


def fla_rule() -> tuple[Callable | None, str]:
    """``(chunk_gated_delta_rule or None, why not)``: FLA's op if ``fla-core`` imports here, resolved once."""
    global _FLA
    if _FLA is None:
        _FLA = import_fla("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", "chunk_gated_delta_rule")
    return _FLA


def fla_rule_status() -> tuple[bool, str]:
    """``(FLA's rule imports here, why or why not)`` (resolved before tracing, see ``fused_op.fla_status``)."""
    op, note = fla_rule()
    return op is not None, note


def choose_gdn_kernel(x: Tensor) -> tuple[str, str]:
    """``(kernel, reason)`` for a gated delta rule on activations ``x`` (their device and dtype):
    ``"pure"`` or the rule ``fused_gated_delta_rule`` runs (``"fla"`` or a stand-in); logged once."""
    return select_kernel("gdn", x, fla_rule_status, logger, backward=fla_gated_backward_refusal)


def register_rule(name: str, rule: Callable, backward: Callable | None = None) -> None:
    """Make ``rule`` (``chunk_gated_delta_rule``'s signature) runnable as ``fused_gated_delta_rule(..., rule=name)``;
    ``backward`` (``delta_backward.gdn_backward``'s signature) gives its gradients without its forward, or,
    by default, autograd of ``rule``."""
    register_named(_RULES, name, rule, "gated delta rule")
    _BACKWARDS[name] = backward


def _kernel(name: str) -> Callable:
    return named_kernel(_RULES, name, fla_rule, "gated delta rule")


def _backward(name: str) -> Callable | None:
    return gdn_backward() if name == "fla" else _BACKWARDS[name]


# hybridpar::fused_gated_delta_rule and its backward (delta_ops.py: no autograd forward; the rule's backward alone)
_rule_op = register_rule_ops("fused_gated_delta_rule", _kernel, _backward)


def fused_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, cu_seqlens: Tensor,
                           initial_state: Tensor | None = None, output_final_state: bool = False,
                           rule: str = "fla") -> tuple[Tensor, Tensor | None]:
    """``q, k [1, T, Hk, dk]``, ``v [1, T, Hv, dv]``, ``g, beta [1, T, Hv]`` on one stream of
    sequences ``cu_seqlens [N+1]`` -> ``(o [1, T, Hv, dv] in v's dtype, final states [N, Hv, dk, dv]
    in fp32 or wider, or None)`` through the named rule (default: FLA's ``chunk_gated_delta_rule``);
    ``initial_state [N, Hv, dk, dv]`` enters each sequence."""
    batch, tokens, k_heads, dk = k.shape
    v_heads = v.shape[2]
    if batch != 1 or q.shape != k.shape or v.shape[:2] != (1, tokens) or v_heads % k_heads or \
            g.shape != (1, tokens, v_heads) or beta.shape != g.shape:
        raise ValueError(f"fused gated delta rule expects one stream: q, k [1, T, Hk, dk], v [1, T, Hv, dv] with "
                         f"Hv % Hk == 0, g, beta [1, T, Hv]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}; flatten rows first.")
    o, final = torch.ops.hybridpar.fused_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens,
                                                          output_final_state, rule)
    return o, (final if output_final_state else None)
