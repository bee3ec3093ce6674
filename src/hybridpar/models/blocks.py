"""Building blocks shared by every layer kind: RMSNorm, the MLP, the residual block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = {
    "relu2": lambda x: F.relu(x).square(),
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32 or wider."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        compute_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        x = hidden_states.to(compute_dtype)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(hidden_states.dtype)


class GatedRMSNorm(nn.Module):
    """Mamba2's norm: ``rmsnorm(y * silu(z))`` over groups of ``group_size`` channels.

    Grouping by ``d_inner / n_groups`` keeps each group inside one tensor-parallel shard,
    so sharding the mixer by heads needs no extra all-reduce. Same math and parameter
    name as transformers' ``MambaRMSNormGated``.
    """

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, hidden_states: Tensor, gate: Tensor) -> Tensor:
        compute_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        x = hidden_states.to(compute_dtype) * F.silu(gate.to(compute_dtype))
        *prefix, width = x.shape
        x = x.view(*prefix, width // self.group_size, self.group_size)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x.view(*prefix, width)
        return self.weight * x.to(hidden_states.dtype)


class MLP(nn.Module):
    """Feed-forward block: ``down(act(up(x)))``, or ``down(act(gate(x)) * up(x))`` when gated."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "relu2", gated: bool = False, bias: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"mlp activation {activation!r} is unknown; use one of {sorted(ACTIVATIONS)}.")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias) if gated else None
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = ACTIVATIONS[activation]

    def forward(self, hidden_states: Tensor, packed=None) -> Tensor:
        up = self.up_proj(hidden_states)
        if self.gate_proj is not None:
            return self.down_proj(self.act(self.gate_proj(hidden_states)) * up)
        return self.down_proj(self.act(up))


class ResidualBlock(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x), packed)``.

    The mixer is a Mamba2 mixer, an attention layer or an MLP; each takes
    ``(hidden_states [B, S, D], packed)`` and returns ``[B, S, D]``.
    """

    def __init__(self, norm: nn.Module, mixer: nn.Module, kind: str):
        super().__init__()
        self.norm = norm
        self.mixer = mixer
        self.kind = kind

    def forward(self, hidden_states: Tensor, packed=None) -> Tensor:
        return hidden_states + self.mixer(self.norm(hidden_states), packed)
