"""Context-parallel gated short convolutions (LFM2): a halo exchange at the zigzag seams.

Each rank holds ``L/P`` tokens of every row in zigzag order (``zigzag.py``): every padded
document is cut into ``2P`` chunks, rank ``r`` holds chunks ``r`` and ``2P-1-r``. The short conv
``s_t = bias + sum_lag w[:, K-1-lag] * v_{t-lag}`` (``v = b * x``, ``models/hf/mixers/short_conv.py``)
reads, at the start of each chunk, the ``K-1`` values of ``v`` before it in the same document,
which live on another rank. The Mamba ``state`` strategy has the same seams for its conv, so
this reuses its segment plan (``context/mamba_state.build_segment_plan``): a *segment* is one
chunk of one document of one row, ``S = 2 * B * n_docs`` per rank, laid back to back in the
rank's token stream. One all-gather moves the last ``K-1`` values of ``v`` of every segment::

    tails  [S, K-1, C]  ->  all_gather over CP  ->  [P*S, K-1, C]

and each segment picks its halo ``[S, K-1, C]`` from it (zeros before a document's start; a
segment shorter than ``K-1`` takes its halo from several earlier segments). The conv then runs
on the rank's stream with the segments as documents and the halo as each one's history
(``gated_short_conv``), so every output equals the single-process one. Backward is autograd:
the halo's gradient (``dhistory`` of the conv) reduce-scatters back to the ranks whose tails
it read, and flows into their ``b`` and ``x``.

Bytes each rank sends per short-conv layer: ``(P-1) * S * (K-1) * C * e`` forward and the same
backward (``e`` bytes per activation), independent of ``L``. Nothing else travels: ``in_proj``,
``out_proj`` and the gates are per token. Channels need no divisibility (all channels stay on
every rank); document lengths must be multiples of ``2P`` (the packer pads them).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.mixers.short_conv import conv_parameters, gated_short_conv, local_short_conv, short_convs
from hybridpar.parallel.comm.collectives import all_gather
from hybridpar.parallel.context.core import ContextParallelCore, install_core
from hybridpar.parallel.context.recurrent.mamba_state import segment_plan

__all__ = ["HaloShortConv", "apply_short_conv_cp", "halo_bytes_per_layer"]


def halo_bytes_per_layer(batch: int, n_docs: int, cp: int, channels: int, conv_kernel: int, element_size: int) -> int:
    """Forward bytes one rank sends per short-conv layer (module docstring)."""
    return (cp - 1) * 2 * batch * n_docs * (conv_kernel - 1) * channels * element_size


class HaloShortConv(ContextParallelCore):
    """The ``core`` of a switched short conv under CP: halo all-gather, then the local conv."""

    name = "halo"

    def prepare(self, module: nn.Module, packed: PackedSeqParams, batch: int, device) -> None:
        segment_plan(packed, batch, self.cp_size, self.cp_rank, module.conv.kernel_size[0], device)

    def __call__(self, module: nn.Module, bcx: Tensor, packed: PackedSeqParams | None = None) -> Tensor:
        if self.cp_size == 1:
            return local_short_conv(module, bcx, packed)
        batch, local_len, width = bcx.shape
        weight, bias = conv_parameters(module)  # [C, K], [C]
        channels, kernel = weight.shape
        if width != 3 * channels:
            raise ValueError(f"short conv input width {width} is not 3 x its {channels} conv channels; shard in_proj "
                             "and the conv alike.")
        self.checked_layout(packed, local_len)
        plan = segment_plan(packed, batch, self.cp_size, self.cp_rank, kernel, bcx.device)  # once per batch
        stream = bcx.reshape(batch * local_len, width)  # rows back to back: [T, 3C]
        history = None
        if kernel > 1:
            k1 = kernel - 1
            b, _, x = stream.chunk(3, dim=-1)
            tails = (b.index_select(0, plan.tail_index) * x.index_select(0, plan.tail_index)
                     * plan.tail_valid.to(bcx.dtype)[:, None])  # v at every segment's last K-1 tokens: [S*(K-1), C]
            tails = all_gather(tails.view(plan.num_segments, k1, channels), self.cp_group, 0)
            # [S, K-1, C] -> [P*S, K-1, C], rank-major
            history = (tails.reshape(-1, channels).index_select(0, plan.halo_index)
                       * plan.halo_valid.to(bcx.dtype)[:, None]).view(plan.num_segments, k1, channels)
        y = gated_short_conv(stream, weight, bias, plan.cu_segments, plan.cu_segments[:-1], history)  # [T, C]
        return y.view(batch, local_len, channels)


def apply_short_conv_cp(model: nn.Module, cp_group: dist.ProcessGroup | None) -> nn.Module:
    """Install ``HaloShortConv`` as ``core`` of every short conv ``install_short_conv`` switched; returns ``model``."""
    return install_core(model, short_convs(model), lambda: HaloShortConv(cp_group))
