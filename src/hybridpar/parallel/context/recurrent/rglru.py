"""State-passing context parallelism for RecurrentGemma's RG-LRU blocks (``StatePassingRglru``).

The ``core`` of a switched RG-LRU block (``models/hf/mixers/rglru.py``: depthwise causal conv, then
the RG-LRU ``h_t = a_t h_{t-1} + m_t i_t x_t``) under CP, on the segments of Mamba1's state passing
(``mamba_state.py``: every document of every row cut into ``2P`` zigzag chunks, rank ``r`` holding
chunks ``r`` and ``2P-1-r``, ``S = 2 * B * n_docs`` segments back to back in its token stream). The
recurrence is the selective scan with one state per channel (``models/linear/rglru.py``), linear in
the state ``h0 [Cd]`` entering a segment::

    h_t = (prod_{s<=t} a_s) h0 + h_t|zero,       prod_{s<=t} a_s = exp(A sum_{s<=t} r_s)

so each rank (1) takes the ``K-1`` conv inputs before every segment from one all-gather of every
segment's last ``K-1`` inputs ``[S, K-1, Cd]`` (``conv_halo``), runs the conv and the per-token gates
on its own tokens, (2) scans its segments from a zero state, keeping per segment ``h_end [Cd]`` and
the total decay ``a_seg = exp(A sum r) [Cd]``, (3) all-gathers ``[S, 2 Cd]`` of them and composes the
entering states in global chunk order, ``h0_{j+1} = a_seg_j h0_j + h_end_j`` (``entering_states``),
and (4) scans again with ``h0`` entering each segment. The normaliser ``m_t`` resets at a document's
first token only: the first token of chunk 0 (rank 0's early segments), never at another seam.
Backward is autograd through ``comm.all_gather`` (reduce-scatter).

Bytes each rank sends per RG-LRU block, forward (the backward the same)::

    (P-1) * 2*B*n_docs * ((K-1) * Cd * e + 2 * Cd * e_s)

independent of ``L``. Channels need no divisibility; document lengths are multiples of ``2P``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.mixers.mamba1 import document_conv
from hybridpar.models.hf.mixers.rglru import local_rglru_core, rglru_blocks, rglru_parameters
from hybridpar.models.linear.rglru import rglru_inputs
from hybridpar.models.linear.selective_scan import document_resets, selective_scan
from hybridpar.parallel.context.core import ContextParallelCore, install_core
from hybridpar.parallel.context.recurrent.mamba_state import conv_halo, exchange_elementwise_states, segment_plan

__all__ = ["StatePassingRglru", "apply_rglru_cp", "rglru_state_bytes_per_layer"]


def rglru_state_bytes_per_layer(batch: int, n_docs: int, cp: int, width: int, conv_kernel: int, element_size: int,
                                state_element_size: int) -> int:
    """Forward bytes one rank sends per RG-LRU block (module docstring)."""
    return (cp - 1) * 2 * batch * n_docs * ((conv_kernel - 1) * width * element_size + 2 * width * state_element_size)


class StatePassingRglru(ContextParallelCore):
    """The ``core`` of a switched RG-LRU block under CP: conv halo, scan, state passing, scan."""

    name = "state"

    def prepare(self, block: nn.Module, packed: PackedSeqParams, batch: int, device) -> None:
        segment_plan(packed, batch, self.cp_size, self.cp_rank, block.conv_1d.kernel_size[0], device)

    def __call__(self, block: nn.Module, x: Tensor, packed: PackedSeqParams | None = None) -> Tensor:
        if self.cp_size == 1:
            return local_rglru_core(block, x, packed)
        batch, local_len, width = x.shape
        self.checked_layout(packed, local_len)
        kernel = block.conv_1d.kernel_size[0]
        plan = segment_plan(packed, batch, self.cp_size, self.cp_rank, kernel, x.device)  # once per batch
        stream = x.reshape(batch * local_len, width)  # rows back to back: [T, Cd]
        halo = conv_halo(stream, plan, kernel, self.cp_group)  # [S, K-1, Cd]
        starts = plan.cu_segments[:-1]
        conv = document_conv(stream, block.conv_1d, plan.cu_segments, None if halo is None else starts, halo)
        reset = document_resets(plan.cu_segments, conv.shape[0], x.device)  # a zero state at every segment
        first = reset.clone() if self.cp_rank == 0 else torch.zeros_like(reset)  # chunk 0: a document's first token
        first[starts[1::2]] = False  # a late chunk (2P-1-r > 0) never starts a document
        u, r, A = rglru_inputs(conv[None], *rglru_parameters(block), first=first)  # [1, T, Cd] x2, [Cd, 1]
        gated = dict(B=u.new_ones(1, u.shape[1], 1), reset=reset, scale_by_dt=False)
        _, h_end = _scan(u, r, A, final_at=plan.cu_segments[1:] - 1, **gated)  # [S, Cd, 1]
        dtype = h_end.dtype  # the scan's compute dtype (fp32 for bf16 activations)
        r_sum = r.new_zeros(plan.num_segments, width, dtype=dtype).index_add(0, plan.token_segment, r[0].to(dtype))
        decay = torch.exp(r_sum * A[:, 0].to(dtype))  # [S, Cd] a_seg
        h0 = exchange_elementwise_states(h_end, decay[..., None], plan, self.cp_group)  # [S, Cd, 1]
        y = _scan(u, r, A, init_states=h0, init_at=starts, **gated)  # [1, T, Cd]
        return y.to(x.dtype).view(batch, local_len, width)


def _scan(u: Tensor, r: Tensor, A: Tensor, B: Tensor, reset: Tensor, scale_by_dt: bool, **states):
    """The RG-LRU's scan (``selective_scan`` with ``dt = r``, ``B = C = 1``, no ``dt`` on the input)."""
    return selective_scan(u, r, A, B, B, reset, scale_by_dt=scale_by_dt, **states)


def apply_rglru_cp(model: nn.Module, cp_group: dist.ProcessGroup | None) -> nn.Module:
    """Install ``StatePassingRglru`` as ``core`` of every RG-LRU block ``install_rglru_core`` switched."""
    return install_core(model, rglru_blocks(model), lambda: StatePassingRglru(cp_group))

