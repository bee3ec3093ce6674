"""State-passing context parallelism for the Mamba2 conv + scan (strategy ``"state"``).

**Segments.** With zigzag sharding every (padded) document ``d`` of every row is cut into
``2P`` chunks of ``c_d = L_d / 2P`` tokens; rank ``r`` holds chunks ``j = r`` and
``j = 2P-1-r``. A *segment* is one such chunk: ``S = 2 * B * n_docs`` segments per rank,
laid back to back in the rank's token stream (rows, then documents, then the two chunks).
A segment never contains a document boundary, and chunk ``0`` of a document (a document
starting exactly at a segment edge) inherits nothing.

**Math.** Per head, with ``a_t = exp(dt_t A)``, the scan is ``h_t = a_t h_{t-1} + dt_t x_t B_t^T``,
``y_t = C_t h_t + D x_t``. It is linear in the state entering a segment, ``h0``::

    h_t = (prod_{s<=t} a_s) h0 + h_t|zero          (t inside the segment)
    y_t = y_t|zero + C_t exp(sum_{s<=t} dt_s A) h0

so each rank scans its segments from a zero state, keeping per segment the final state
``h_end = h_last|zero`` ``[H, p, N]`` and the total decay ``a_seg = exp(A sum dt)`` ``[H]``. In
global chunk order the entering states follow ``h0_0 = 0``,
``h0_{j+1} = a_seg_j h0_j + h_end_j``: a loop over the ``2P`` chunk positions, vectorised
over rows and documents. The output then gains ``C_t exp(cs_t) h0`` on every token of the
segment, ``cs_t`` the within-segment cumulative sum of ``dt A``.

**Conv halo.** The depthwise conv (kernel ``K``) before the scan reads the ``K-1``
pre-activation inputs before each segment, which live on other ranks. It has to be exchanged
*before* the scan (the conv output is the scan's input), and the scan's results have to be
exchanged after it, so the strategy uses two all-gathers, both of fixed size: first the last
``K-1`` conv inputs of every segment, ``[S, K-1, C]``; then ``(h_end, a_seg)`` of every
segment, ``[S, H*p*N + H]`` in the scan's compute dtype (fp32 for bf16 activations). A
segment shorter than ``K-1`` tokens takes its halo from several earlier segments; the index
math below handles that. Backward is autograd through ``comm.all_gather`` (reduce-scatter).

Bytes each rank sends per Mamba layer (``comm.CommStats`` counts an all-gather as ``(P-1)`` x
the shard), with ``e`` the activation and ``e_s`` the state element size::

    state  forward   (P-1) * 2*B*n_docs * ((K-1) * (d_inner + 2*G*N) * e + (H*p*N + H) * e_s)

independent of ``L``; the backward reduce-scatters the same volume.

**Passes.** Both run the ``mamba_core`` op on the rank's token stream with the segments as
documents and the halo as each segment's conv history: first for the final states only
(``h_end``, no output), then, once ``h0`` is composed, for ``y`` with ``h0`` entering each
segment (the scan is linear in it, so this equals ``y|zero`` plus the correction above). Each
pass keeps only its inputs for backward (the stream is a view of ``in_proj``'s output); no
``[T, H, p, N]`` or per-piece state tensor is kept. The all-gathered states take
``P * S * H*p*N`` elements.

**Mamba1** (``StatePassingMamba1``, the ``core`` of transformers' Mamba1 mixers: Mamba, FalconMamba,
Jamba; ``models/hf/mixers/mamba1.py``): the same segments, halo and composition with a state per
channel and state index. The selective scan (``models/linear/selective_scan.py``) is linear in the
state entering a segment: per channel ``c`` and state ``n``, with ``a_t = exp(dt_t[c] A[c, n])``::

    h_t = (prod_{s<=t} a_s) h0 + h_t|zero,     y_t = y_t|zero + C_t . (prod_{s<=t} a_s) h0

so each rank (1) takes the ``K-1`` conv inputs before every segment from one all-gather of every
segment's last ``K-1`` inputs ``[S, K-1, d_inner]`` (``conv_halo``), runs the conv,
the activation and the per-token ``x_proj`` / norms / ``dt_proj`` on its own tokens, (2) scans its
segments from a zero state, keeping per segment ``h_end [d, n]`` and the total decay
``a_seg = exp(A * sum dt) [d, n]``, (3) all-gathers ``[S, 2*d*n]`` of them and composes the
entering states in global chunk order, ``h0_{j+1} = a_seg_j h0_j + h_end_j``
(``entering_states``), and (4) scans again with ``h0`` entering each segment.
Backward is autograd through ``comm.all_gather`` (reduce-scatter).

Bytes each rank sends per Mamba1 layer, forward (the backward the same)::

    (P-1) * 2*B*n_docs * ((K-1) * d_inner * e + 2 * d_inner * d_state * e_s)

independent of ``L``. Channels need no divisibility; document lengths are multiples of ``2P``
(the packer pads them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.mixers.mamba1 import document_conv, local_selective_core, mamba1_mixers, selective_inputs
from hybridpar.models.linear.selective_scan import document_resets, selective_scan
from hybridpar.models.mamba.core import mamba_conv_scan
from hybridpar.parallel.comm.collectives import all_gather
from hybridpar.parallel.context.core import ContextParallelCore, batch_cached, install_core

__all__ = ["SegmentPlan", "build_segment_plan", "segment_plan", "state_passing_conv_scan", "state_bytes_per_layer",
           "StatePassingMamba1", "apply_mamba1_cp", "mamba1_state_bytes_per_layer", "conv_halo", "entering_states",
           "exchange_elementwise_states"]


def state_bytes_per_layer(
    batch: int, n_docs: int, cp: int, d_inner: int, num_heads: int, head_dim: int, n_groups: int,
    state_size: int, conv_kernel: int, element_size: int, state_element_size: int,
) -> int:
    """Forward bytes one rank sends per Mamba layer with "state" (formula of the module docstring)."""
    segments = 2 * batch * n_docs
    halo = (conv_kernel - 1) * (d_inner + 2 * n_groups * state_size) * element_size
    states = (num_heads * head_dim * state_size + num_heads) * state_element_size
    return (cp - 1) * segments * (halo + states)


@dataclass
class SegmentPlan:
    """Index tensors of one batch layout (int64, on the activations' device).

    ``S`` segments, ``T = B * T_local`` stream tokens, ``K1 = K - 1`` halo tokens.
    """

    cp_size: int  # P
    cp_rank: int  # r
    num_segments: int  # S
    num_docs: int  # B * n_docs; segment 2*a + k is chunk k (0: early, 1: late) of document a
    cu_segments: Tensor  # [S + 1] segment starts in the stream
    token_segment: Tensor  # [T] segment of each stream token
    chunk_owner: list[tuple[int, int]]  # global chunk j -> (rank, k) holding it
    tail_index: Tensor  # [S * K1] stream token of each sent halo slot (clamped)
    tail_valid: Tensor  # [S * K1] slot holds a token of the segment
    halo_index: Tensor  # [S * K1] index into the gathered tails [P * S * K1]
    halo_valid: Tensor  # [S * K1] halo slot lies inside the document


def segment_plan(packed, batch: int, cp_size: int, cp_rank: int, conv_kernel: int, device) -> SegmentPlan:
    """``build_segment_plan`` of ``packed``'s documents, built once per batch (cached on ``packed``, by the
    batch hook before compiled blocks: ``core.batch_cached``) and shared by every layer and strategy that
    asks with the same arguments (Mamba, short conv, GDN)."""
    return batch_cached(packed, ("context.segment_plan", batch, cp_size, cp_rank, conv_kernel, str(device)),
                  lambda: build_segment_plan(packed.cu_seqlens_padded, batch, cp_size, cp_rank, conv_kernel, device))


def build_segment_plan(
    cu_seqlens_padded: Tensor, batch: int, cp_size: int, cp_rank: int, conv_kernel: int, device,
) -> SegmentPlan:
    """Segment layout of rank ``cp_rank`` for ``batch`` rows sharing the padded documents
    ``cu_seqlens_padded`` (global, each length a multiple of ``2*cp``). Built on the CPU with
    vectorised index math, no loop over documents, then moved to ``device``."""
    cu = cu_seqlens_padded.detach().to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]  # [n_docs]
    if bool((lengths % (2 * cp_size)).any()):
        raise ValueError(
            f"padded document lengths {lengths.tolist()} must be multiples of 2*cp = {2 * cp_size}; shard the "
            "batch with shard_inputs (the packer pads documents to 2*cp)."
        )
    local_len = int(cu[-1]) // cp_size
    num_docs = batch * lengths.numel()
    doc_chunk = (lengths // (2 * cp_size)).repeat(batch)  # [D] c_d, rows outer
    doc_start = ((torch.arange(batch) * local_len)[:, None] + (cu[:-1] // cp_size)[None, :]).flatten()  # [D]
    k = torch.arange(2).repeat(num_docs)  # [S] 0: chunk r, 1: chunk 2P-1-r
    seg_len = doc_chunk.repeat_interleave(2)  # [S]
    seg_doc = torch.arange(num_docs).repeat_interleave(2)  # [S]
    seg_start = doc_start.repeat_interleave(2) + k * seg_len  # [S]
    seg_chunk = torch.where(k == 0, cp_rank, 2 * cp_size - 1 - cp_rank)  # [S] global chunk j
    num_segments = seg_len.numel()
    token_segment = torch.repeat_interleave(torch.arange(num_segments), seg_len)  # [T]
    cu_segments = torch.cat([torch.zeros(1, dtype=torch.int64), seg_len.cumsum(0)])  # [S + 1] == seg_start

    k1 = conv_kernel - 1
    slot = torch.arange(k1)[None, :]  # [1, K1]
    # Sent: the last K1 tokens of each segment, right-aligned (slots before its start unused).
    tail_pos = (seg_start + seg_len)[:, None] - k1 + slot  # [S, K1]
    tail_valid = slot >= (k1 - seg_len)[:, None]
    tail_index = torch.where(tail_valid, tail_pos, 0)
    # Read: halo token i of segment (a, j) sits at document offset j*c - K1 + i, inside chunk
    # j' = offset // c, dist = (j'+1)*c - offset <= K1 tokens before that chunk's end, i.e. in
    # slot K1 - dist of the tail that rank owner(j') sent for its chunk k' of document a.
    offset = (seg_chunk * seg_len)[:, None] - k1 + slot  # [S, K1]
    halo_valid = offset >= 0
    offset = offset.clamp(min=0)
    src_chunk = offset // seg_len[:, None]
    src_slot = k1 - ((src_chunk + 1) * seg_len[:, None] - offset)
    src_rank = torch.where(src_chunk < cp_size, src_chunk, 2 * cp_size - 1 - src_chunk)
    src_segment = 2 * seg_doc[:, None] + (src_chunk >= cp_size).long()
    halo_index = torch.where(halo_valid, (src_rank * num_segments + src_segment) * k1 + src_slot, 0)

    chunk_owner = [(j, 0) if j < cp_size else (2 * cp_size - 1 - j, 1) for j in range(2 * cp_size)]
    move = lambda t: t.to(device)  # noqa: E731
    return SegmentPlan(
        cp_size=int(cp_size), cp_rank=int(cp_rank), num_segments=num_segments, num_docs=num_docs, cu_segments=move(cu_segments),
        token_segment=move(token_segment), chunk_owner=chunk_owner,
        tail_index=move(tail_index.flatten()), tail_valid=move(tail_valid.flatten()),
        halo_index=move(halo_index.flatten()), halo_valid=move(halo_valid.flatten()),
    )


def conv_halo(stream: Tensor, plan: SegmentPlan, conv_kernel: int, cp_group) -> Tensor | None:
    """The ``K-1`` conv inputs before every segment in global order, ``[S, K-1, C]`` (zeros
    before a document's start): one all-gather of every segment's last ``K-1`` inputs."""
    k1 = conv_kernel - 1
    if k1 == 0:
        return None
    width = stream.shape[-1]
    tails = stream.index_select(0, plan.tail_index) * plan.tail_valid.to(stream.dtype)[:, None]  # [S*K1, C]
    tails = all_gather(tails.view(plan.num_segments, k1, width), cp_group, 0)  # [S, K1, C] -> [P*S, K1, C]
    halo = tails.reshape(-1, width).index_select(0, plan.halo_index) * plan.halo_valid.to(stream.dtype)[:, None]
    return halo.view(plan.num_segments, k1, width)


def entering_states(states: Tensor, decay: Tensor, plan: SegmentPlan) -> Tensor:
    """Compose ``h0`` of this rank's segments from every segment's ``(h_end, a_seg)``.

    states ``[P, D, 2, H, p*N]``, decay ``[P, D, 2, H]`` (gathered); returns ``[S, H, p*N]``.
    """
    wanted = (plan.cp_rank, 2 * plan.cp_size - 1 - plan.cp_rank)
    h = torch.zeros_like(states[0, :, 0])  # [D, H, p*N], entering chunk 0
    entering = {0: h}
    for j in range(1, max(wanted) + 1):
        rank, k = plan.chunk_owner[j - 1]
        h = decay[rank, :, k, :, None] * h + states[rank, :, k]  # h0_j = a_{j-1} h0_{j-1} + h_end_{j-1}
        entering[j] = h
    return torch.stack([entering[wanted[0]], entering[wanted[1]]], dim=1).flatten(0, 1)  # [D, 2, ...] -> [S, ...]



def exchange_elementwise_states(h_end: Tensor, decay: Tensor, plan: SegmentPlan, cp_group) -> Tensor:
    """``h0 [S, *X]`` entering this rank's segments for a diagonal recurrence (Mamba1, RG-LRU): each
    segment's final state ``h_end [S, *X]`` from a zero start and its total decay ``decay [S, *X]`` (the
    same shape), exchanged in one all-gather ``[S, 2X] -> [P*S, 2X]`` and composed by ``entering_states``."""
    payload = torch.cat([h_end.flatten(1), decay.flatten(1)], dim=1)  # [S, 2X]
    gathered = all_gather(payload, cp_group, 0)  # [S, 2X] -> [P*S, 2X], rank-major
    states, decays = gathered.reshape(plan.cp_size, plan.num_docs, 2, 2, -1).unbind(3)  # [P, D, 2, X] each
    return entering_states(states[..., None], decays, plan).view(h_end.shape)

def state_passing_conv_scan(
    xBC: Tensor,
    dt: Tensor,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    dt_bias: Tensor,
    A_log: Tensor,
    D: Tensor,
    *,
    head_dim: int,
    state_size: int,
    chunk_size: int,
    plan: SegmentPlan,
    cp_group: dist.ProcessGroup | None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """The Mamba core (``mamba_conv_scan``) of this rank's zigzag tokens, exact across ranks by state passing.

    xBC ``[B, L/P, H*p + 2*G*N]``, dt ``[B, L/P, H]`` (raw), full (unsliced) parameters; returns
    ``y [B, L/P, H*p]`` equal to the single-process core at these tokens.
    """
    batch, local_len, width = xBC.shape
    heads = dt.shape[-1]
    total = batch * local_len
    stream, dt_stream = xBC.reshape(1, total, width), dt.reshape(1, total, heads)  # views: rows back to back
    options = dict(
        head_dim=head_dim, state_size=state_size, chunk_size=chunk_size, cu_docs=plan.cu_segments, dt_limit=dt_limit,
        init_at=plan.cu_segments[:-1], conv_history=conv_halo(stream[0], plan, conv_weight.shape[1], cp_group),
    )
    params = (conv_weight, conv_bias, dt_bias, A_log, D)
    _, h_end = mamba_conv_scan(stream, dt_stream, *params, final_at=plan.cu_segments[1:] - 1, want_y=False, **options)
    # h_end [S, H, p, N]: each segment's state from a zero entering state

    dtype = h_end.dtype  # the scan's compute dtype (fp32 for bf16 activations)
    dt_used = F.softplus(dt_stream[0].to(dtype) + dt_bias.to(dtype))  # [T, H], as the scan processes it
    if tuple(dt_limit) != (0.0, float("inf")):
        dt_used = dt_used.clamp(min=dt_limit[0], max=dt_limit[1])
    dt_sum = dt_used.new_zeros(plan.num_segments, heads).index_add(0, plan.token_segment, dt_used)  # [S, H]
    decay = (dt_sum * -torch.exp(A_log.to(dtype))).exp()  # [S, H] a_seg

    payload = torch.cat([h_end.flatten(1), decay], dim=1)  # [S, H*p*N + H]
    gathered = all_gather(payload, cp_group, 0)  # [S, H*p*N + H] -> [P*S, H*p*N + H], rank-major
    gathered = gathered.reshape(plan.cp_size, plan.num_docs, 2, -1)  # [P, D, 2, H*p*N + H]
    states, decays = gathered.split([heads * head_dim * state_size, heads], dim=-1)
    states = states.unflatten(-1, (heads, head_dim * state_size))  # [P, D, 2, H, p*N]
    h0 = entering_states(states, decays, plan).unflatten(-1, (head_dim, state_size))  # [S, H, p, N]

    y = mamba_conv_scan(stream, dt_stream, *params, init_states=h0, **options)  # [1, T, H*p]
    return y.reshape(batch, local_len, heads * head_dim)


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

    def prepare(self, module: nn.Module, packed: PackedSeqParams, batch: int, device) -> None:
        segment_plan(packed, batch, self.cp_size, self.cp_rank, module.conv1d.kernel_size[0], device)

    def __call__(self, module: nn.Module, x: Tensor, packed: PackedSeqParams | None = None) -> Tensor:
        if self.cp_size == 1:
            return local_selective_core(module, x, packed)
        batch, local_len, width = x.shape
        self.checked_layout(packed, local_len)
        kernel = module.conv1d.kernel_size[0]
        plan = segment_plan(packed, batch, self.cp_size, self.cp_rank, kernel, x.device)  # once per batch
        stream = x.reshape(batch * local_len, width)  # rows back to back: [T, d]
        halo = conv_halo(stream, plan, kernel, self.cp_group)  # [S, K-1, d]
        starts = plan.cu_segments[:-1]
        u = module.act(document_conv(stream, module.conv1d, plan.cu_segments, None if halo is None else starts, halo))
        dt, B, C = selective_inputs(module, u)  # [T, d], [T, n], [T, n]
        A = -torch.exp(_local(module.A_log))  # [d, n]
        u, dt, B, C = (t[None] for t in (u, dt, B, C))  # one row: [1, T, ...]
        reset = document_resets(plan.cu_segments, u.shape[1], u.device)
        _, h_end = selective_scan(u, dt, A, B, C, reset, final_at=plan.cu_segments[1:] - 1)  # [S, d, n]
        dtype = h_end.dtype  # the scan's compute dtype (fp32 for bf16 activations)
        dt_sum = dt.new_zeros(plan.num_segments, width, dtype=dtype).index_add(0, plan.token_segment, dt[0].to(dtype))
        decay = torch.exp(dt_sum[:, :, None] * A.to(dtype))  # [S, d, n] a_seg
        h0 = exchange_elementwise_states(h_end, decay, plan, self.cp_group)  # [S, d, n]
        y = selective_scan(u, dt, A, B, C, reset, init_states=h0, init_at=starts) + u * _local(module.D)  # [1, T, d]
        return y.view(batch, local_len, width)


def apply_mamba1_cp(model: nn.Module, cp_group: dist.ProcessGroup | None) -> nn.Module:
    """Install ``StatePassingMamba1`` as ``core`` of every Mamba1 mixer ``install_mamba1_core`` switched."""
    return install_core(model, mamba1_mixers(model), lambda: StatePassingMamba1(cp_group))
