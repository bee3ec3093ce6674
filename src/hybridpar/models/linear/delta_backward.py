"""FLA's gated delta rule and KDA backward without their forward, as ``models/mamba/fla_backward.py`` runs
simple GLA's: what FLA's autograd Function saves, recomputed from the op's inputs, then its backward.

Both Functions (fla-core 0.6.0, ``fla/ops/gated_delta_rule/chunk.py``, ``fla/ops/kda/chunk.py``), on
contiguous inputs (``input_guard``), chunk size 64, per-chunk cumulative log decays
``g' = chunk_local_cumsum(g, scale=1/ln 2)`` (fp32), run forward::

    gated delta rule   w, u, A = chunk_gated_delta_rule_fwd_intra(k, v, g', beta)      A [1, T, Hv, 64]
                       h, v', ht = chunk_gated_delta_rule_fwd_h(k, w, u, g', h0)
                       o = chunk_fwd_o(q, k, v', h, g')
    KDA                w, u, qg, kg, Aqk, Akk = chunk_kda_fwd_intra(q, k, v, g', beta)
                       h, v', ht = chunk_gated_delta_rule_fwd_h(kg, w, u, g', h0)
                       o = chunk_gla_fwd_o_gk(q, v', g', Aqk, h)

and save only ``g'``, the intra-chunk matrices (``A``; ``Aqk``, ``Akk``) and their inputs: their
backward (``chunk_gated_delta_rule_bwd``, ``chunk_kda_bwd``) recomputes ``w``, ``u`` and ``h`` itself. So
the backward here runs the cumsum and the intra-chunk step (whose ``w``, ``u`` it drops: FLA computes
``A`` inside that fused step, and another path to it need not give the same bits), then FLA's
backward; the forward's ``chunk_gated_delta_rule_fwd_h`` and output kernel no longer run. The same
kernels on the same inputs as autograd through FLA's forward: the same bits.

Each is ``(q, k, v, g, beta, do, dht, *, scale, initial_state, cu_seqlens) -> (dq, dk, dv, dg, dbeta, dh0)``
in FLA's dtypes, resolved once (``fla_backward.resolve_backward``): None where fla-core's functions are not the ones
checked or a backend of fla-core may take the rule (logged once; the op then differentiates the forward).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace

from torch import Tensor

from hybridpar.models.mamba.fla_backward import CHUNK, resolve_backward

__all__ = ["gdn_backward", "kda_backward"]

logger = logging.getLogger(__name__)
_GDN, _KDA, _KDA_FWD = "fla.ops.gated_delta_rule.chunk:", "fla.ops.kda.chunk:", "fla.ops.kda.chunk_fwd:"
_INDICES = ("cu_seqlens", "chunk_size", "cu_seqlens_cpu")
_CUMSUM = ("g", "chunk_size", "reverse", "scale", "cu_seqlens", "chunk_indices")
_NEEDED = {
    "gdn": {
        _GDN + "prepare_chunk_indices": _INDICES, _GDN + "chunk_local_cumsum": _CUMSUM,
        _GDN + "chunk_gated_delta_rule_fwd_intra": ("k", "v", "g", "beta", "cu_seqlens", "chunk_size",
                                                    "chunk_indices"),
        _GDN + "chunk_gated_delta_rule_bwd": ("q", "k", "v", "g", "beta", "A", "scale", "initial_state", "do", "dht",
                                              "state_v_first", "cu_seqlens", "cp_context", "chunk_indices",
                                              "use_gate_in_kernel", "g_input", "A_log", "dt_bias", "chunk_size"),
        _GDN + "input_guard": (), _GDN + "RCP_LN2": None},
    "kda": {
        _KDA + "prepare_chunk_indices": _INDICES, _KDA_FWD + "chunk_local_cumsum": _CUMSUM + ("use_graph",),
        _KDA_FWD + "chunk_kda_fwd_intra": ("q", "k", "v", "gk", "beta", "scale", "cu_seqlens", "chunk_size",
                                           "chunk_indices", "safe_gate", "disable_recompute", "use_graph"),
        _KDA + "chunk_kda_bwd": ("q", "k", "v", "beta", "Aqk", "Akk", "scale", "initial_state", "do", "dht", "g",
                                 "g_org", "state_v_first", "cu_seqlens", "chunk_indices", "chunk_size", "safe_gate",
                                 "lower_bound", "use_gate_in_kernel", "A_log", "dt_bias", "disable_recompute",
                                 "cp_context", "use_graph", "chunk_offsets"),
        _KDA + "input_guard": (), _KDA_FWD + "RCP_LN2": None},
}
_ENTRY = {"gdn": (_GDN + "chunk_gated_delta_rule", "gated_delta_rule"), "kda": (_KDA + "chunk_kda", None)}


def _gdn_backward(fla: SimpleNamespace, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, do: Tensor,
                  dht: Tensor | None, *, scale: float, initial_state: Tensor | None, cu_seqlens: Tensor) -> tuple:
    """``ChunkGatedDeltaRuleFunction.backward`` on what its forward saves: ``q, k [1, T, Hk, dk]``,
    ``v [1, T, Hv, dv]``, ``g, beta [1, T, Hv]``."""
    chunk_indices = fla.prepare_chunk_indices(cu_seqlens, CHUNK, cu_seqlens_cpu=None)  # the forward's cached call
    g_sum = fla.chunk_local_cumsum(g, chunk_size=CHUNK, scale=fla.RCP_LN2, cu_seqlens=cu_seqlens,
                                   chunk_indices=chunk_indices)
    _, _, A = fla.chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_sum, beta=beta, cu_seqlens=cu_seqlens,
                                                   chunk_indices=chunk_indices, chunk_size=CHUNK)
    dq, dk, dv, db, dg, dh0, _, _ = fla.chunk_gated_delta_rule_bwd(
        q=q, k=k, v=v, g=g_sum, beta=beta, A=A, scale=scale, initial_state=initial_state, do=do, dht=dht,
        cu_seqlens=cu_seqlens, cp_context=None, chunk_indices=chunk_indices, state_v_first=False,
        use_gate_in_kernel=False, g_input=None, A_log=None, dt_bias=None, chunk_size=CHUNK)
    return dq.to(q), dk.to(k), dv.to(v), dg.to(g_sum), db.to(beta), dh0


def _kda_backward(fla: SimpleNamespace, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, do: Tensor,
                  dht: Tensor | None, *, scale: float, initial_state: Tensor | None, cu_seqlens: Tensor) -> tuple:
    """``ChunkKDAFunction.backward`` on what its forward saves (``disable_recompute=False``): ``q, k [1, T, Hk, dk]``,
    ``v [1, T, Hv, dv]``, ``g [1, T, Hv, dk]``, ``beta [1, T, Hv]``."""
    chunk_indices = fla.prepare_chunk_indices(cu_seqlens=cu_seqlens, chunk_size=CHUNK, cu_seqlens_cpu=None)
    g_sum = fla.chunk_local_cumsum(g=g, scale=fla.RCP_LN2, chunk_size=CHUNK, cu_seqlens=cu_seqlens,
                                   chunk_indices=chunk_indices, use_graph=False)
    *_, Aqk, Akk = fla.chunk_kda_fwd_intra(q=q, k=k, v=v, gk=g_sum, beta=beta, scale=scale, cu_seqlens=cu_seqlens,
                                           chunk_size=CHUNK, chunk_indices=chunk_indices, safe_gate=False,
                                           disable_recompute=False, use_graph=False)
    dq, dk, dv, db, dg, dh0, _, _ = fla.chunk_kda_bwd(
        q=q, k=k, v=v, beta=beta, Aqk=Aqk, Akk=Akk, scale=scale, initial_state=initial_state, do=do, dht=dht,
        g=g_sum, g_org=None, state_v_first=False, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        chunk_size=CHUNK, safe_gate=False, lower_bound=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
        disable_recompute=False, cp_context=None, use_graph=False, chunk_offsets=None)
    return dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta), dh0


def gdn_backward() -> Callable | None:
    """``chunk_gated_delta_rule``'s backward without its forward (module docstring), or None."""
    return resolve_backward("gdn rule", _NEEDED["gdn"], _ENTRY["gdn"][0], _gdn_backward, logger, _ENTRY["gdn"][1])


def kda_backward() -> Callable | None:
    """``chunk_kda``'s backward without its forward (module docstring), or None."""
    return resolve_backward("kda rule", _NEEDED["kda"], _ENTRY["kda"][0], _kda_backward, logger, _ENTRY["kda"][1])
