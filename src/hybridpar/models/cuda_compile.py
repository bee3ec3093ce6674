"""The elementwise steps inside our custom ops, compiled on CUDA.

A custom op (the fused Mamba op, the LM head loss) is one opaque node to ``torch.compile``: what runs
inside it stays eager even in a compiled model, one kernel per aten op, each a pass over memory. The
steps around its kernels (scalings, skips, one-hot scatters, the reductions of their gradients) are
pure functions of their tensors; ``run_compiled`` runs such a function through ``torch.compile``
(inductor, ``fullgraph``) on CUDA, where inductor fuses it into a kernel or a few, and eagerly
elsewhere: on CPU the eager form is the exact reference. A function written for both keeps its eager
form's in-place writes behind ``eager_mode()`` and is functional while traced.

If compiling a function fails, its eager form runs from then on, and the reason is logged once:
the eager form is exact, so a compiler failure never stops training. ``compile_steps`` chooses the
backend on any device (tests compile with ``aot_eager`` on CPU).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

__all__ = ["compiled_backend", "compile_steps", "eager_mode", "run_compiled"]

logger = logging.getLogger(__name__)
_AUTO = object()
_BACKEND: object = _AUTO  # _AUTO: inductor on CUDA, eager elsewhere; None: eager; else a torch.compile backend
_COMPILED: dict[tuple, Callable] = {}  # (step name, backend) -> its compiled form
_FAILED: set[str] = set()  # steps whose compiling failed: eager from then on


def eager_mode() -> bool:
    """True when running eagerly: a step may then write its own intermediates in place."""
    return not torch.compiler.is_compiling()


def compiled_backend(device: torch.device):
    """The ``torch.compile`` backend steps on ``device`` run under (None: eager)."""
    if _BACKEND is _AUTO:
        return "inductor" if device.type == "cuda" else None
    return _BACKEND


@contextlib.contextmanager
def compile_steps(backend):
    """Within the block steps run compiled with ``backend`` (a name or a callable) on any device; None: eager."""
    global _BACKEND
    outer, _BACKEND = _BACKEND, backend
    try:
        yield
    finally:
        _BACKEND = outer


def run_compiled(name: str, step: Callable, device: torch.device, *args):
    """``step(*args)``, compiled where ``compiled_backend(device)`` names a backend; ``name`` identifies
    the step in the cache and the log."""
    backend = compiled_backend(device)
    if backend is None or name in _FAILED or torch.compiler.is_compiling():  # traced: the outer compile fuses it
        return step(*args)
    key = (name, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(step, backend=backend, fullgraph=True)
    try:
        return _COMPILED[key](*args)
    except Exception as error:  # noqa: BLE001 - a compiler failure must not stop training: eager is exact
        _FAILED.add(name)
        cause = getattr(error, "inner_exception", None) or error  # dynamo wraps a backend's error
        logger.warning("compiling %s with %s failed (%s: %s); running it eagerly from now on", name,
                       getattr(backend, "__name__", backend), type(cause).__name__,
                       (str(cause).splitlines() or [""])[0][:160])
        return step(*args)
