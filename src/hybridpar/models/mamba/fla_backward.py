"""FLA's chunked backward without its forward: what FLA's autograd Function saves, recomputed from the
fused op's inputs, then FLA's own backward on it.

FLA's ``chunk_simple_gla`` (fla-core 0.6.0, ``fla/ops/simple_gla/chunk.py``) is an autograd Function.
Its forward, on ``q, k [1, T, H, N]``, ``v [1, T, H, P]``, ``g [1, T, H]``, made contiguous (``input_guard``)::

    chunk_indices = prepare_chunk_indices(cu_seqlens, 64)
    g'            = chunk_local_cumsum(g, 64, scale=1/ln 2)      per-chunk cumulative log decays, fp32
    h, ht         = chunk_fwd_h(k, v, g', h0)                    chunk states, final states
    o             = chunk_fwd_o(q, k, v, g', h)

saves ``(q, k, v, g', h0, chunk_indices)``; its backward, given ``do`` and ``dht``, runs
``chunk_simple_gla_bwd`` (``chunk_fwd_h`` again in fp32, ``chunk_bwd_dh``, ``chunk_bwd_dqkwg``,
``chunk_bwd_dv``) and a reverse ``chunk_local_cumsum`` of ``dg``. Differentiating a recomputed forward
ran ``chunk_fwd_h`` and ``chunk_fwd_o`` for nothing: ``o`` is never needed and the backward recomputes
``h``. ``simple_gla_backward`` runs the forward's cumsum and the backward alone, the same kernels on the
same inputs, so the same bits.

``fla_internals`` checks, once, that fla-core's functions are the ones this reproduces (names and the
keywords passed) and that no fla-core backend may take the entry point from its Triton Function (its
backward is then its own); otherwise the fused op keeps differentiating the forward, logged once.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from types import SimpleNamespace

from torch import Tensor

__all__ = ["CHUNK", "fla_internals", "resolve_backward", "simple_gla_backward"]

logger = logging.getLogger(__name__)
CHUNK = 64  # FLA's chunk size when none is passed (simple GLA, the gated delta rule, KDA)
_RESOLVED: dict[str, Callable | None] = {}  # resolve_backward's, by name
_GLA = "fla.ops.simple_gla.chunk:"
_NEEDED = {
    _GLA + "prepare_chunk_indices": ("cu_seqlens", "chunk_size", "cu_seqlens_cpu"),
    _GLA + "chunk_local_cumsum": ("g", "chunk_size", "reverse", "scale", "cu_seqlens", "chunk_indices"),
    _GLA + "chunk_simple_gla_bwd": ("q", "k", "v", "g", "g_gamma", "initial_state", "do", "dht", "scale",
                                    "state_v_first", "cu_seqlens", "chunk_size", "chunk_indices"),
    _GLA + "input_guard": (),
    _GLA + "RCP_LN2": None,
}


def fla_internals(needed: dict[str, tuple[str, ...] | None], entry: str,
                  operation: str | None = None) -> tuple[SimpleNamespace | None, str]:
    """``(fla-core's objects by name, "")`` where every ``needed`` ``"module:name"`` exists and, for a
    function (a tuple), takes each keyword listed, and no fla-core backend enabled here may run the entry
    point ``entry`` (``"module:name"``, dispatched by function or by ``operation``) in place of its Triton
    Function; else ``(None, why)``. Imports fla."""
    found = {}
    try:
        for path, keywords in {**needed, entry: None}.items():
            module, name = path.split(":")
            found[name] = getattr(importlib.import_module(module), name, None)
            if found[name] is None:
                return None, f"fla-core has no {module}.{name}"
            missing = [k for k in keywords or () if k not in inspect.signature(found[name]).parameters]
            if missing:
                return None, f"fla-core's {module}.{name} takes no {', '.join(missing)}"
        takers = _backends_taking(found[entry.split(":")[1]], operation)
    except Exception as error:  # fla missing, or its backend registry laid out otherwise
        return None, f"fla-core's internals could not be checked ({type(error).__name__}: {str(error)[:80]})"
    if takers:
        return None, f"fla-core's {', '.join(takers)} backend may run {entry} with its own backward"
    return SimpleNamespace(**found), ""


def _backends_taking(entry: Callable, operation: str | None) -> list[str]:
    """fla-core's backends, available and enabled here, that its dispatcher may pick for ``entry``."""
    from fla import backends

    if backends._DISPATCH_DISABLED:
        return []
    registries = [backends._function_registries.get(inspect.unwrap(entry)),
                  backends._operation_registries.get(operation) if operation else None]
    active = [registry.get_active() for registry in registries if registry is not None]
    return [backend.backend_type for backend in active if backend is not None]


def _simple_gla_backward(fla: SimpleNamespace, q: Tensor, k: Tensor, v: Tensor, g: Tensor, do: Tensor,
                         dht: Tensor | None, *, scale: float, initial_state: Tensor | None, cu_seqlens: Tensor,
                         state_v_first: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dg, dh0)``: ``ChunkSimpleGLAFunction.backward`` on what its forward saves."""
    chunk_indices = fla.prepare_chunk_indices(cu_seqlens, CHUNK, cu_seqlens_cpu=None)  # the forward's cached call
    g_sum = fla.chunk_local_cumsum(g, chunk_size=CHUNK, scale=fla.RCP_LN2, cu_seqlens=cu_seqlens,
                                   chunk_indices=chunk_indices)  # [1, T, H] fp32
    dq, dk, dv, dg, dh0 = fla.chunk_simple_gla_bwd(
        q=q, k=k, v=v, g=g_sum, g_gamma=None, initial_state=initial_state, do=do, dht=dht, scale=scale,
        cu_seqlens=cu_seqlens, chunk_size=CHUNK, chunk_indices=chunk_indices, state_v_first=state_v_first)
    dg = fla.chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, cu_seqlens=cu_seqlens,
                                chunk_indices=chunk_indices).to(g_sum)
    return dq.to(q), dk.to(k), dv.to(v), dg, dh0


def resolve_backward(name: str, needed: dict, entry: str, backward: Callable, log: logging.Logger,
                     operation: str | None = None) -> Callable | None:
    """``backward(fla, ...)`` bound to fla-core's objects ``needed`` (``fla_internals``), its inputs made
    contiguous as FLA's Function makes them; None where the internals are not the ones checked, logged
    once on ``log`` as ``"{name} backward: ..."``. Resolved once per ``name``."""
    if name not in _RESOLVED:
        fla, why = fla_internals(needed, entry, operation)
        if fla is None:
            log.info("%s backward: autograd through FLA's forward (%s)", name, why)
        _RESOLVED[name] = None if fla is None else fla.input_guard(functools.partial(backward, fla))
    return _RESOLVED[name]


def simple_gla_backward() -> Callable | None:
    """``chunk_simple_gla``'s backward without its forward, ``(q, k, v, g, do, dht, *, scale, initial_state,
    cu_seqlens, state_v_first) -> (dq, dk, dv, dg, dh0)``, or None (``resolve_backward``)."""
    return resolve_backward("mamba scan", _NEEDED, _GLA + "chunk_simple_gla", _simple_gla_backward, logger)
