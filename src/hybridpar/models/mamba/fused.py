"""Which Mamba2 core runs: the pure-PyTorch op (``core.py``) or FLA's fused scan (``fused_op.py``).

``choose_kernel`` says which and why (logged once per kernel and reason): ``fla`` on CUDA for
float32/bf16/fp16 when ``fla-core`` imports (``pip install 'hybridpar[gpu]'``), initial states
only at document starts and final states only at document ends, and, when autograd records, where
FLA's backward runs (``fused_op.fla_gated_backward_refusal``: not on Hopper with triton < 3.7.1);
otherwise the pure-PyTorch op.
``use_mamba_kernel("pure" | "fla" | "auto")`` forces a choice (benchmarks compare both in one
process); ``"fla"`` where it cannot run is a ``ValueError``. ``use_stand_in(name)`` runs the fused
path on any device with a registered stand-in for FLA's kernel (tests: FLA's contract on CPU).

``select_kernel`` is the same choice for every fused core (``"mamba"`` here, ``"gdn"``: the gated
delta rule, ``models/linear/gdn_fused.py``; ``"kda"``: Kimi Delta Attention, ``models/linear/kda_fused.py``):
one ``use_mamba_kernel`` switch, a stand-in per family, one log line per family, kernel and reason
(``gdn kernel: fla (fla-core 0.6.0 ...)``).

Under ``torch.compile`` the state-boundary check (a host sync) moves into the fused op, which
refuses states it cannot take; the choice itself reads only devices, dtypes and module state.
mamba_ssm's ``mamba_chunk_scan_combined`` is not wired: its package imports compiled CUDA
extensions that a machine without a build toolchain and network (our GPU runs) cannot build.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import Tensor

from hybridpar.models.mamba.fused_op import fla_gated_backward_refusal, fla_status, states_at_boundaries

__all__ = ["MODES", "choose_kernel", "kernel_for", "select_kernel", "use_mamba_kernel", "use_stand_in",
           "mamba_kernel_mode", "stand_in", "register_named", "named_kernel"]

logger = logging.getLogger(__name__)

MODES = ("auto", "pure", "fla")
_mode = "auto"
_stand_ins: dict[str, str | None] = {}
_LOGGED: set[tuple[str, str, str]] = set()


def mamba_kernel_mode() -> str:
    return _mode


def stand_in(family: str) -> str | None:
    """The stand-in ``use_stand_in`` set for ``family`` (None: the real kernels)."""
    return _stand_ins.get(family)


@contextlib.contextmanager
def use_mamba_kernel(mode: str):
    """Within the block, ``mamba_conv_scan`` runs ``mode``: ``auto`` (the rules above), ``pure`` or ``fla``."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"Mamba kernel mode {mode!r} is unknown; choose one of {list(MODES)}.")
    previous, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = previous


@contextlib.contextmanager
def use_stand_in(name: str, family: str = "mamba"):
    """Within the block, the fused path of ``family`` (``"mamba"``, ``"gdn"``, ``"kda"``; the norms'
    ``"rmsnorm"`` and ``"gated_norm"``, ``models/norm_kernels.py``) runs on any device with
    the kernel registered as ``name`` (``fused_op.register_scan``, ``linear/gdn_fused.register_rule``,
    ``linear/kda_fused.register_kda_rule`` for ``"kda"``)
    in place of FLA's: how tests compile and check it on CPU (``"fla"``: FLA's own, interpreted)."""
    previous = _stand_ins.get(family)
    _stand_ins[family] = name
    try:
        yield
    finally:
        _stand_ins[family] = previous


def register_named(registry: dict, name: str, kernel, what: str, taken: tuple[str, ...] = ("fla",)) -> None:
    """``registry[name] = kernel``, a stand-in ``what`` (``"gated delta rule"``...) tests run in place of FLA's."""
    if name in taken:
        raise ValueError(f"the {what} name {name!r} is taken by a built-in kernel; register a stand-in under another name.")
    registry[name] = kernel


def named_kernel(registry: dict, name: str, fla: Callable[[], tuple[object | None, str]], what: str):
    """The kernel ``name``: FLA's for ``"fla"`` (``fla()`` gives ``(op or None, why not)``) or a registered one."""
    if name == "fla":
        op, why = fla()
        if op is None:
            raise ValueError(f"the fused {what} 'fla' cannot run: {why}.")
        return op
    if name not in registry:
        raise ValueError(f"fused {what} {name!r} is not registered; known: {['fla', *registry]}.")
    return registry[name]


def kernel_for(device_type: str, dtype: torch.dtype, fla_available: bool, fla_note: str = "",
               mode: str = "auto") -> tuple[str, str]:
    """``(kernel, reason)`` from the inputs' device and dtype (no tensor is read)."""
    if mode == "pure":
        return "pure", "use_mamba_kernel('pure')"
    if device_type != "cuda":
        return "pure", f"device {device_type}"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "pure", f"dtype {dtype} has no fused kernel"
    if not fla_available:
        return "pure", fla_note or "fla-core is not installed; pip install 'hybridpar[gpu]'"
    return "fla", fla_note or "fla-core chunk_simple_gla + causal_conv1d"


def select_kernel(family: str, x: Tensor, status: Callable[[], tuple[bool, str]], log: logging.Logger,
                  problem: Callable[[], str | None] | None = None,
                  backward: Callable[[], str | None] | None = None) -> tuple[str, str]:
    """``(kernel, reason)`` for a core of ``family`` (``"mamba"``, ``"gdn"``) on activations ``x``, by
    the rules of ``kernel_for`` under the mode of ``use_mamba_kernel`` (one switch for every fused
    core), the family's stand-in, ``problem()`` (eager only: why these inputs cannot take the
    fused op) and, where autograd records, ``backward()`` (why FLA's backward cannot run on this
    machine); logged once per family, kernel and reason on ``log``."""
    stand_in = _stand_ins.get(family)
    if stand_in is not None and _mode != "pure":
        kernel, reason = stand_in, f"stand-in {stand_in!r} for FLA's kernel"
    else:
        available, note = status() if x.device.type == "cuda" and _mode != "pure" else (False, "")
        kernel, reason = kernel_for(x.device.type, x.dtype, available, note, _mode)
        refused = backward() if kernel == "fla" and backward is not None and torch.is_grad_enabled() else None
        if refused:
            kernel, reason = "pure", refused
    if kernel != "pure" and problem is not None and not torch.compiler.is_compiling():  # compiled: the op checks
        found = problem()
        if found:
            kernel, reason = "pure", found
    if _mode == "fla" and kernel == "pure":
        raise ValueError(f"use_mamba_kernel('fla') cannot run here: {reason}; use 'auto' to fall back to the "
                         "pure-PyTorch core.")
    if (family, kernel, reason) not in _LOGGED and not torch.compiler.is_compiling():
        _LOGGED.add((family, kernel, reason))
        log.info("%s kernel: %s (%s; %s on %s)", family, kernel, reason, x.dtype, x.device)
    return kernel, reason


def choose_kernel(xBC: Tensor, cu_docs: Tensor, init_at: Tensor | None, final_at: Tensor | None) -> tuple[str, str]:
    """``(kernel, reason)`` for these inputs, logged once per kernel and reason. ``kernel`` is
    ``"pure"`` or the name of the scan ``fused_conv_scan`` runs (``"fla"``, or a stand-in)."""
    return select_kernel("mamba", xBC, fla_status, logger, lambda: states_at_boundaries(cu_docs, init_at, final_at),
                         fla_gated_backward_refusal)
