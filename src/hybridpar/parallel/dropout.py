"""Token-keyed dropout (``models/token_dropout.py``) on tensor-parallel inputs.

Under TP a dropout's input can be a DTensor: replicated, feature-sharded (a row-parallel
adapter's input ``[B, S, in/tp]``) or sequence-sharded (``[B, S/tp, D]`` under SP). Each rank masks
the block its local tensor holds with the masks of that block's global token and feature indices
(``compute_local_shape_and_global_offset``), so every rank applies one process's mask to its part.
DTensor's own dropout draws from its RNG tracker instead: masks unlike one process's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hybridpar.models.token_dropout import TokenDropout

__all__ = ["ShardedTokenDropout", "shard_token_dropouts"]


class ShardedTokenDropout(TokenDropout):
    """``TokenDropout`` that masks a DTensor's local block by its global indices (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor) or not self.training or self.p == 0.0:
            return super().forward(x)
        local = x.to_local()
        _, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
        masked = self.masked(local, tuple(x.shape), tuple(offset))  # [local shape]
        return DTensor.from_local(masked, x.device_mesh, x.placements, shape=x.shape, stride=x.stride())


def shard_token_dropouts(model: nn.Module) -> int:
    """Make every ``TokenDropout`` of ``model`` a ``ShardedTokenDropout`` (same state, a DTensor-aware
    forward); returns how many."""
    found = [m for m in model.modules() if type(m) is TokenDropout]
    for module in found:
        module.__class__ = ShardedTokenDropout
    return len(found)
