"""Mamba2 mixer with the parameter names and shapes of transformers' ``Mamba2Mixer``.

    u [B, L, D] -> in_proj -> [z | xBC | dt]
                 xBC, dt -> core (conv1d + SSD scan) -> y [B, L, H*P]
                 y, z -> gated grouped RMSNorm -> out_proj -> [B, L, D]

``Mamba2Mixer.core`` is the seam: a callable ``core(mixer, xBC, dt, packed) -> y``.
The default runs ``mamba_core.mamba_conv_scan`` on the tokens this process holds; context-parallel
strategies replace it from outside. Head and group counts are read from the tensors,
so a tensor-parallel shard (heads split, groups split) runs the same code.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from hybridpar.models.blocks import GatedRMSNorm
from hybridpar.models.mamba.core import mamba_conv_scan, shared_row_documents


def local_conv_scan(mixer: "Mamba2Mixer", xBC: Tensor, dt: Tensor, packed=None) -> Tensor:
    """The single-process core: conv + scan (``mamba_core``) over this process's tokens, in
    sequence order; packed documents reset the conv and the state."""
    batch, seq_len, _ = xBC.shape
    return mamba_conv_scan(
        xBC, dt, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.dt_bias, mixer.A_log, mixer.D,
        head_dim=mixer.head_dim, state_size=mixer.ssm_state_size, chunk_size=mixer.chunk_size,
        cu_docs=shared_row_documents(packed, batch, seq_len, xBC.device), dt_limit=mixer.time_step_limit,
    )


def replicated_groups(n_groups: int, tp: int) -> bool:
    """Whether the single B/C group is held whole by every one of ``tp > 1`` ranks (``tp_groups``)."""
    return tp > 1 and n_groups == 1


def tp_groups(n_groups: int, tp: int) -> int:
    """B/C groups one of ``tp`` ranks holds when the mixer is sharded by heads: ``n_groups / tp``,
    or the single group whole on every rank (0: this ``tp`` cannot shard the groups)."""
    if n_groups % tp == 0:
        return n_groups // tp
    return n_groups if n_groups == 1 else 0


class Mamba2Mixer(nn.Module):
    """Mamba2 token mixer (SSD), parameter-compatible with transformers' ``Mamba2Mixer``."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        n_groups: int = 1,
        state_size: int = 128,
        conv_kernel: int = 4,
        chunk_size: int = 256,
        use_conv_bias: bool = True,
        use_bias: bool = False,
        norm_eps: float = 1e-5,
        time_step_limit: tuple[float, float] = (0.0, float("inf")),
        time_step_min: float = 0.001,
        time_step_max: float = 0.1,
        time_step_floor: float = 1e-4,
    ):
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(
                f"mamba num_heads={num_heads} is not divisible by n_groups={n_groups}; every group must "
                "serve the same number of heads, so pick n_groups dividing num_heads."
            )
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.n_groups = n_groups
        self.ssm_state_size = state_size
        self.conv_kernel_size = conv_kernel
        self.chunk_size = chunk_size
        self.time_step_limit = tuple(time_step_limit)
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.in_proj = nn.Linear(hidden_size, self.intermediate_size + self.conv_dim + num_heads, bias=use_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel_size=conv_kernel, groups=self.conv_dim,
            padding=conv_kernel - 1, bias=use_conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        self.norm = GatedRMSNorm(self.intermediate_size, self.intermediate_size // n_groups, eps=norm_eps)
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=use_bias)
        self.core = local_conv_scan
        self._init_ssm_parameters(time_step_min, time_step_max, time_step_floor)

    @torch.no_grad()
    def _init_ssm_parameters(self, dt_min: float, dt_max: float, dt_floor: float) -> None:
        """mamba_ssm's init: A in [1, 16], dt log-uniform in [dt_min, dt_max], D = 1."""
        if self.A_log.is_meta:  # shapes only (planning, preflight): nothing to initialize
            return
        self.A_log.copy_(torch.log(torch.empty(self.num_heads).uniform_(1, 16)))
        self.D.fill_(1.0)
        dt = torch.exp(torch.rand(self.num_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def split_sizes(self, projection_width: int) -> tuple[int, int, int]:
        """Widths of ``(z, xBC, dt)`` in an ``in_proj`` output of this width: the full mixer or one
        TP rank's heads, with its share of the B/C groups (``tp_groups``: a single group whole).

        Per rank the width is ``(2 d + H) / s + 2 g N`` with ``g = G / s``, or ``g = G = 1``: solved
        for the shard count ``s`` in O(1) (it runs on every forward)."""
        heads_part, bc = 2 * self.intermediate_size + self.num_heads, 2 * self.ssm_state_size
        candidates = [divmod(heads_part + self.n_groups * bc, projection_width)]  # groups split with heads
        if self.n_groups == 1 and projection_width > bc:
            candidates.append(divmod(heads_part, projection_width - bc))  # the single group whole
        for shards, remainder in candidates:
            groups = tp_groups(self.n_groups, shards) if shards else 0
            if not remainder and groups and self.num_heads % shards == 0:
                heads = self.num_heads // shards
                d_inner = heads * self.head_dim
                if 2 * d_inner + groups * bc + heads == projection_width:
                    return d_inner, d_inner + groups * bc, heads
        raise ValueError(
            f"in_proj output width {projection_width} is not the mixer's or one TP rank's share of it (heads "
            f"{self.num_heads}, groups {self.n_groups}); shard the mixer by heads and groups."
        )

    def forward(self, hidden_states: Tensor, packed=None) -> Tensor:
        projected = self.in_proj(hidden_states)  # [B, L, 2*d_inner + 2*G*N + H]
        z, xBC, dt = torch.split(projected, self.split_sizes(projected.shape[-1]), dim=-1)
        y = self.core(self, xBC, dt, packed)  # [B, L, d_inner]
        return self.out_proj(self.norm(y, z))
