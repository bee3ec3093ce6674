"""State-passing context parallelism for Mamba1 mixers (Mamba, FalconMamba, Jamba): ``StatePassingMamba1``.

The same segments and seams as the Mamba2 ``"state"`` strategy (``mamba_state.py``): each rank
holds two zigzag chunks of every document of every row, a *segment* each (``S = 2 * B * n_docs``).
The selective scan (``models/linear/selective_scan.py``) is linear in the state entering a segment:
per channel ``c`` and state ``n``, with ``a_t = exp(dt_t[c] A[c, n])``::

    h_t = (prod_{s<=t} a_s) h0 + h_t|zero,     y_t = y_t|zero + C_t . (prod_{s<=t} a_s) h0

so each rank (1) takes the ``K-1`` conv inputs before every segment from one all-gather of every
segment's last ``K-1`` inputs ``[S, K-1, d_inner]`` (``mamba_state._conv_halo``), runs the conv,
the activation and the per-token ``x_proj`` / norms / ``dt_proj`` on its own tokens, (2) scans its
segments from a zero state, keeping per segment ``h_end [d, n]`` and the total decay
``a_seg = exp(A * sum dt) [d, n]``, (3) all-gathers ``[S, 2*d*n]`` of them and composes the
entering states in global chunk order, ``h0_{j+1} = a_seg_j h0_j + h_end_j``
(``mamba_state._entering_states``), and (4) scans again with ``h0`` entering each segment.
Backward is autograd through ``comm.all_gather`` (reduce-scatter).

Bytes each rank sends per Mamba1 layer, forward (the backward the same)::

    (P-1) * 2*B*n_docs * ((K-1) * d_inner * e + 2 * d_inner * d_state * e_s)

independent of ``L``. Channels need no divisibility; document lengths are multiples of ``2P``
(the packer pads them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.mamba1_mixers import local_selective_core, mamba1_mixers, selective_inputs
from hybridpar.models.linear.selective_scan import reset_conv, selective_scan
from hybridpar.parallel.comm.collectives import all_gather
from hybridpar.parallel.context.core import ContextParallelCore
from hybridpar.parallel.context.mamba_state import _conv_halo, _entering_states, segment_plan

__all__ = ["StatePassingMamba1", "apply_mamba1_cp", "mamba1_state_bytes_per_layer"]


def mamba1_state_bytes_per_layer(batch: int, n_docs: int, cp: int, d_inner: int, d_state: int, conv_kernel: int,
                                 element_size: int, state_element_size: int) -> int:
    """Forward bytes one rank sends per Mamba1 layer (module docstring)."""
    per_segment = (conv_kernel - 1) * d_inner * element_size + 2 * d_inner * d_state * state_element_size
    return (cp - 1) * 2 * batch * n_docs * per_segment


def _local(t: Tensor | None) -> Tensor | None:
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


class StatePassingMamba1(ContextParallelCore):
    """The ``core`` of a switched Mamba1 mixer under CP: conv halo, scan, state passing, scan."""

    name = "state"

    def __call__(self, module: nn.Module, x: Tensor, packed: PackedSeqParams | None = None) -> Tensor:
        if self.cp_size == 1:
            return local_selective_core(module, x, packed)
        batch, local_len, width = x.shape
        self.checked_layout(packed, local_len)
        weight, bias = _local(module.conv1d.weight).squeeze(1), _local(module.conv1d.bias)  # [d, K], [d]
        plan = segment_plan(packed, batch, self.cp_size, self.cp_rank, weight.shape[1], x.device)  # once per batch
        stream = x.reshape(batch * local_len, width).to(weight.dtype)  # rows back to back: [T, d]
        halo = _conv_halo(stream, plan, weight.shape[1], self.cp_group)  # [S, K-1, d]
        starts = plan.cu_segments[:-1]
        conv_out = module.act(reset_conv(stream, weight, bias, plan.cu_segments, None if halo is None else starts,
                                         halo).to(x.dtype))
        dt, B, C = selective_inputs(module, conv_out)  # [T, d], [T, n], [T, n]
        A = -torch.exp(_local(module.A_log).to(dt.dtype))  # [d, n]
        u, B, C = conv_out.to(dt.dtype), B.to(dt.dtype), C.to(dt.dtype)
        _, h_end = selective_scan(u, dt, A, B, C, None, plan.cu_segments, return_final_states=True)  # [S, d, n]
        dt_sum = dt.new_zeros(plan.num_segments, width).index_add(0, plan.token_segment, dt)  # [S, d]
        decay = torch.exp(dt_sum[:, :, None] * A)  # [S, d, n] a_seg
        payload = torch.cat([h_end.flatten(1), decay.flatten(1)], dim=1)  # [S, 2*d*n]
        gathered = all_gather(payload, self.cp_group, 0)  # [S, 2dn] -> [P*S, 2dn], rank-major
        states, decays = gathered.reshape(self.cp_size, plan.num_docs, 2, 2, -1).unbind(3)  # [P, D, 2, d*n] each
        h0 = _entering_states(states[..., None], decays, plan).view(plan.num_segments, width, -1)  # [S, d, n]
        y = selective_scan(u, dt, A, B, C, _local(module.D).to(dt.dtype), plan.cu_segments, h0, starts)  # [T, d]
        return y.view(batch, local_len, width)


def apply_mamba1_cp(model: nn.Module, cp_group: dist.ProcessGroup | None) -> nn.Module:
    """Install ``StatePassingMamba1`` as ``core`` of every Mamba1 mixer ``install_mamba1_core`` switched."""
    mixers = mamba1_mixers(model)
    if mixers:
        core = StatePassingMamba1(cp_group)
        for _, module in mixers:
            module.core = core
    return model
