"""``OpOutputs``: a dispatch mode recording every op dispatched and the shape of every tensor it returns.

Memory tests use it to show what never exists (``largest``: an ``[S_q, S_k]`` score matrix or
mask; ``shapes``: any output of a forbidden shape), collectives and custom ops' inner ops included;
``ops`` (every op, in order) counts the launches a GPU would make, and shows which ops ran.
``kept_for_backward`` counts the bytes autograd saves for backward (distinct storages).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpOutputs", "kept_for_backward"]


class OpOutputs(TorchDispatchMode):
    """``with OpOutputs() as outputs: ...``; then ``outputs.shapes`` ``[(op name, shape), ...]`` and
    ``outputs.ops`` ``[op name, ...]``."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out

    @property
    def largest(self) -> int:
        """The most elements of any op output (0 if none)."""
        return max((math.prod(shape) for _, shape in self.shapes), default=0)


@contextlib.contextmanager
def kept_for_backward():
    """``with kept_for_backward() as kept: ...``; then ``sum(kept.values())`` is the bytes autograd saved
    for backward inside, each storage once (``{storage pointer: nbytes}``; parameters included)."""
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield kept
