"""Context-parallel gated DeltaNet: two strategies for the ``layer.core`` seam (all-to-all over heads, state passing).

Each rank holds ``L/P`` tokens of every row (``P`` = CP size, zigzag order, ``zigzag.py``) and a
switched transformers gated DeltaNet (``models/hf/mixers/gdn.py``) calls
``core(layer, mixed_qkv, a, b, packed)`` with the pre-conv ``mixed_qkv [B, L/P, 2*Hk*dk + Hv*dv]``
(channels ``q | k | v``), the raw ``a, b [B, L/P, Hv]`` and its localized ``PackedSeqParams``; the
core returns ``o [B, L/P, Hv*dv]``. The gate ``z``, the gated norm and ``out_proj`` stay in the
layer, so ``z`` never travels. The strategy owns no parameters: it slices ``conv1d``, ``A_log`` and
``dt_bias`` in the forward pass, so gradients land on the layer's (or FSDP's unsharded) parameters.

``"a2a"`` (``HiddenParallelGDN``, the pattern of ``mamba.HiddenParallelMamba``): one fused
all-to-all turns sequence-sharded ``q, k, v, a, b`` into head-sharded ones over the whole sequence,
``[B, L/P, W] -> [B, L, W/P]`` per tensor; ``gathered_to_sequence`` puts the tokens in sequence
order, the rank runs the single-process core (conv + delta rule, documents reset at the global
boundaries) on its value heads ``[r Hv/P, (r+1) Hv/P)``, ``gathered_indices`` restores the
gathered order and a second all-to-all returns ``o``. Key heads: if ``P | Hk`` rank ``r`` receives
``[r Hk/P, (r+1) Hk/P)`` (exactly the key heads its value heads read); if ``Hk | P`` and ``Hk < P``
each key head travels ``R = P/Hk`` times and rank ``r`` receives key head ``r // R``.

Bytes each rank sends per layer (``e`` bytes per element, all-to-all ``(P-1)/P`` x its buffer)::

    forward  e * B * (L/P) * (P-1)/P * (2*Hk_eff*dk + 2*Hv*dv + 2*Hv)    q, k, v, a, b out; o back
    backward the same

with ``Hk_eff = max(Hk, P)``. ``parallel.cp_mamba`` picks the strategy for Mamba2 mixers and gated
DeltaNets alike.

``"state"`` (``StatePassingGDN``): bytes that do not grow with ``L``.

**Segments** are those of ``mamba_state.py`` (``build_segment_plan``): with zigzag sharding every
document of every row is cut into ``2P`` chunks, rank ``r`` holds chunks ``r`` and ``2P-1-r``; a
segment is one such chunk, so it never contains a document boundary. The conv reads the ``K-1``
inputs before each segment from the other ranks (``mamba_state.conv_halo``: one all-gather).

**Math.** Per value head the delta rule's state ``S [dk, dv]`` enters a segment as ``S_in`` and the
rule is affine in it: chunk by chunk ``S <- D_c S + K_c^T (U_c - W_c S)`` (``gated_delta.py``), so
over a segment ``S_end = M S_in + S_end|0`` and every output ``o_t = o_t|0 + P_t S_in``, with
``M [dk, dk]`` and ``P_t [dk]`` independent of ``S_in``. One run of the rule on an augmented state
``[X | S]`` (``X`` entering as the identity, ``S`` as zero; values ``[0 | v]``) yields all of them:
``X_end = M``, ``S_end = S_end|0``, outputs ``[P_t | o_t|0]``. Each rank runs it on its segments,
each segment padded to whole chunks of the rule (so a segment starts at a chunk and is fed its
state there). One all-gather of ``[M | S_end|0]`` per segment, ``[S, H, dk, dk + dv]``, lets every
rank compose the state entering each of its segments in global chunk order,
``S_in,0 = 0``, ``S_in,j+1 = M_j S_in,j + S_end|0_j``, and correct its outputs,
``o_t = o_t|0 + P_t S_in``. Autograd through ``comm.all_gather`` gives the backward.

Bytes each rank sends per layer (all-gathers counted ``(P-1)`` x the shard)::

    forward  (P-1) * 2*B*n_docs * ((K-1) * (2*Hk*dk + Hv*dv) * e + Hv*dk*(dk+dv) * e_s)

independent of ``L``; the backward reduce-scatters the same. The price is compute: the rule runs
on ``dk + dv`` value columns instead of ``dv``, and each segment is padded to whole chunks.

**Kernels.** Both strategies run the rule through FLA's ``chunk_gated_delta_rule`` where
``models/linear/gdn_fused.py`` chooses it (CUDA, fla-core, float32/bf16): "a2a" through
``gated_delta_core``; "state" with each padded segment as one of FLA's ``cu_seqlens`` sequences, its
initial state ``[I | 0]`` and its final state read (the padding, ``k = v = beta = g = 0``, leaves
the state as it is), which is the pure rule's ``states_in`` / ``finals_at`` call exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.mixers.gdn import CHUNK_SIZE, beta_scale, gdn_layers, local_gdn_core
from hybridpar.models.linear.gated_delta import chunk_gated_delta_rule
from hybridpar.models.linear.gdn_core import document_conv1d, gated_delta_core, gdn_inputs
from hybridpar.models.linear.gdn_fused import choose_gdn_kernel, fused_gated_delta_rule
from hybridpar.models.mamba.core import shared_row_documents
from hybridpar.parallel.comm.collectives import all_gather, hidden_to_seq, seq_to_hidden
from hybridpar.parallel.context.core import ContextParallelCore, batch_cached, install_core
from hybridpar.parallel.context.recurrent.mamba import local_tensor
from hybridpar.parallel.context.recurrent.mamba_state import SegmentPlan, conv_halo, segment_plan

__all__ = ["HiddenParallelGDN", "StatePassingGDN", "GDN_STRATEGIES", "apply_gdn_cp", "validate_gdn_parallel", "GDN_TP_MODEL_TYPES",
           "gdn_a2a_bytes_per_layer", "gdn_state_bytes_per_layer", "segment_rule", "chunk_aligned", "segment_chunks", "entering_affine_states"]


def gdn_a2a_bytes_per_layer(batch: int, seq_len: int, cp: int, k_heads: int, v_heads: int, head_k_dim: int,
                            head_v_dim: int, element_size: int) -> float:
    """Forward bytes one rank sends per gated DeltaNet layer with "a2a" (module docstring)."""
    if cp == 1:
        return 0.0
    width = 2 * max(k_heads, cp) * head_k_dim + 2 * v_heads * head_v_dim + 2 * v_heads
    return element_size * batch * (seq_len / cp) * (cp - 1) / cp * width


def heads_problem(v_heads: int, k_heads: int, cp: int) -> str | None:
    """Why "a2a" cannot split these heads over ``cp`` ranks (None: it can)."""
    if v_heads % cp:
        divisors = [p for p in range(1, v_heads + 1) if v_heads % p == 0]
        return (f"gated DeltaNet context parallelism splits the {v_heads} value heads over the CP group, which cp={cp} "
                f"does not divide; use a cp in {divisors}")
    if k_heads % cp and cp % k_heads:
        return (f"gated DeltaNet context parallelism needs cp to divide the {k_heads} key heads or be a multiple of "
                f"them, got cp={cp}; use a cp that divides {k_heads} or a multiple of it")
    return None


class HiddenParallelGDN(ContextParallelCore):
    """All-to-all sequence -> heads, the gated DeltaNet core on Hv/P heads over the whole sequence, back."""

    name = "a2a"

    def local_parameters(self, layer: nn.Module, v_heads: int, k_heads: int) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """This rank's conv weight ``[C/P', K]`` and bias (its q, k, v channels), ``A_log`` and ``dt_bias``
        ``[Hv/P]``; sliced in the forward pass, so autograd sends gradients to the full parameters."""
        cp, rank, dk, dv = self.cp_size, self.cp_rank, layer.head_k_dim, layer.head_v_dim
        repeat = max(1, cp // k_heads)
        first_k, k_local = (rank // repeat, 1) if repeat > 1 else (rank * k_heads // cp, k_heads // cp)
        v_local = v_heads // cp
        keys = slice(first_k * dk, (first_k + k_local) * dk)
        values = slice(rank * v_local * dv, (rank + 1) * v_local * dv)

        def channels(t: Tensor) -> Tensor:  # [2*Hk*dk + Hv*dv, ...] -> [2*k_local*dk + v_local*dv, ...]
            q, k, v = t.split([k_heads * dk, k_heads * dk, v_heads * dv], dim=0)
            return torch.cat([q[keys], k[keys], v[values]], dim=0)

        heads = slice(rank * v_local, (rank + 1) * v_local)
        bias = local_tensor(layer.conv1d.bias)
        return (channels(local_tensor(layer.conv1d.weight).squeeze(1)), None if bias is None else channels(bias),
                local_tensor(layer.A_log)[heads], local_tensor(layer.dt_bias)[heads])

    def __call__(self, layer: nn.Module, mixed_qkv: Tensor, a: Tensor, b: Tensor,
                 packed: PackedSeqParams | None = None) -> Tensor:
        if self.cp_size == 1:
            return local_gdn_core(layer, mixed_qkv, a, b, packed)
        dk, dv, v_heads = layer.head_k_dim, layer.head_v_dim, a.shape[-1]
        k_heads = (mixed_qkv.shape[-1] - v_heads * dv) // (2 * dk)
        problem = heads_problem(v_heads, k_heads, self.cp_size)
        if problem:
            raise ValueError(f"{problem}.")
        layout = self.checked_layout(packed, mixed_qkv.shape[1])
        batch = mixed_qkv.shape[0]
        q, k, v = mixed_qkv.split([k_heads * dk, k_heads * dk, v_heads * dv], dim=-1)
        repeat = max(1, self.cp_size // k_heads)
        if repeat > 1:  # key head h travels as copies h*R .. h*R+R-1: [B, L/P, Hk*dk] -> [B, L/P, Hk*R*dk]
            q, k = (t.unflatten(-1, (k_heads, 1, dk)).expand(-1, -1, -1, repeat, -1).flatten(2) for t in (q, k))
        q, k, v, a, b = seq_to_hidden([q, k, v, a, b], self.cp_group, seq_dim=1, hidden_dim=-1)
        # [B, L/P, Hk_eff*dk | Hk_eff*dk | Hv*dv | Hv | Hv] -> [B, L, (same)/P], rank-major
        device = mixed_qkv.device
        to_sequence = layout.gathered_to_sequence.to(device)  # [L]
        mixed_h = torch.cat([q, k, v], dim=-1).index_select(1, to_sequence)  # [B, L, C/P'], sequence order
        a_h, b_h = (t.index_select(1, to_sequence) for t in (a, b))  # [B, L, Hv/P]
        cu_docs = shared_row_documents(packed, batch, to_sequence.numel(), device)  # global documents
        weight, bias, A_log, dt_bias = self.local_parameters(layer, v_heads, k_heads)
        o = gated_delta_core(mixed_h, a_h, b_h, weight, bias, A_log, dt_bias, head_k_dim=dk, head_v_dim=dv,
                             chunk_size=getattr(layer, "hybridpar_chunk_size", CHUNK_SIZE), cu_docs=cu_docs,
                             beta_scale=beta_scale(layer))  # [B, L, Hv*dv/P], sequence order
        o = o.index_select(1, layout.gathered_indices.to(device))  # -> gathered (rank-major) order
        (o,) = hidden_to_seq([o], self.cp_group, seq_dim=1, hidden_dim=-1)  # [B, L, Hv*dv/P] -> [B, L/P, Hv*dv]
        return o


def gdn_state_bytes_per_layer(batch: int, n_docs: int, cp: int, k_heads: int, v_heads: int, head_k_dim: int,
                              head_v_dim: int, conv_kernel: int, element_size: int, state_element_size: int) -> int:
    """Forward bytes one rank sends per gated DeltaNet layer with "state" (module docstring)."""
    halo = (conv_kernel - 1) * (2 * k_heads * head_k_dim + v_heads * head_v_dim) * element_size
    states = v_heads * head_k_dim * (head_k_dim + head_v_dim) * state_element_size
    return (cp - 1) * 2 * batch * n_docs * (halo + states)


def chunk_aligned(plan: SegmentPlan, chunk: int) -> tuple[Tensor, Tensor, list[int], list[int], int, Tensor]:
    """Each segment padded to whole chunks: ``(stream position -> padded position [T], chunk ->
    segment [N], first chunk of each segment, last chunk of each segment, padded length, the padded
    segments' token offsets [S + 1] (the fused rule's ``cu_seqlens``))``. Built on the host once per
    batch (``segment_chunks``): the lists and the length are what the pure rule loops over."""
    cu = plan.cu_segments.cpu()
    lengths = cu[1:] - cu[:-1]
    padded = (lengths + chunk - 1) // chunk * chunk
    starts = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    segment = plan.token_segment.cpu()
    position = starts[segment] + torch.arange(segment.numel()) - cu[segment]
    chunk_segment = torch.repeat_interleave(torch.arange(lengths.numel()), padded // chunk)
    device = plan.cu_segments.device
    return (position.to(device), chunk_segment.to(device), (starts[:-1] // chunk).tolist(),
            (starts[1:] // chunk - 1).tolist(), int(starts[-1]), starts.to(device))


def segment_chunks(packed: PackedSeqParams, batch: int, cp_size: int, cp_rank: int, kernel: int, chunk: int,
                   device) -> tuple[SegmentPlan, tuple]:
    """The segment plan and its chunk alignment (``chunk_aligned``), built once per batch and cached on
    ``packed`` (before compiled blocks, by the batch hook: ``core.batch_cached``), shared by every
    gated DeltaNet and KDA layer."""
    segments = segment_plan(packed, batch, cp_size, cp_rank, kernel, device)
    return segments, batch_cached(packed, ("gdn.aligned", batch, cp_size, cp_rank, kernel, chunk, str(device)),
                                  lambda: chunk_aligned(segments, chunk))


def entering_affine_states(ends: Tensor, plan: SegmentPlan, dk: int) -> Tensor:
    """States entering this rank's segments, ``[S, H, dk, dv]``, from every segment's ``[M | S_end|0]``
    gathered as ``[P, D, 2, H, dk, dk + dv]`` (rank-major, documents, the two chunks)."""
    wanted = (plan.cp_rank, 2 * plan.cp_size - 1 - plan.cp_rank)
    h = torch.zeros_like(ends[0, :, 0, ..., dk:])  # [D, H, dk, dv] entering chunk 0 of every document
    entering = {0: h}
    for j in range(1, max(wanted) + 1):
        rank, k = plan.chunk_owner[j - 1]
        transition, state = ends[rank, :, k].split([dk, ends.shape[-1] - dk], dim=-1)
        h = transition @ h + state  # S_in,j = M_{j-1} S_in,j-1 + S_end|0_{j-1}
        entering[j] = h
    return torch.stack([entering[wanted[0]], entering[wanted[1]]], dim=1).flatten(0, 1)


def segment_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states_in: Tensor, chunk_segment: Tensor,
                 starts: list[int], ends: list[int], chunk: int, kernel: str, dtype: torch.dtype, *,
                 pure=chunk_gated_delta_rule, fused=fused_gated_delta_rule,
                 cu_padded: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The rule on one stream of chunk-padded segments (``[1, N*chunk, ...]``, segment ``j`` the chunks
    ``starts[j]..ends[j]``, ``chunk_segment [N]``), ``states_in [S, H, dk, dv']`` entering each:
    ``(o [1, N*chunk, H, dv'], final states [S, H, dk, dv'])`` in v's dtype. ``kernel`` ``"pure"``:
    ``chunk_gated_delta_rule``'s ``states_at`` / ``finals_at`` (Python lists: a compiled block is
    specialised to them); otherwise the fused rule of that name with each segment one ``cu_seqlens``
    sequence, ``cu_padded [S+1]`` (``chunk_aligned``'s tensor: no host value in a compiled block; None:
    built from the lists), q, k, v in ``dtype`` (the padding, ``k = v = beta = g = 0``, leaves a state as
    it is). ``pure``/``fused``: the rule pair (KDA passes its own)."""
    if kernel == "pure":
        o, finals = pure(q, k, v, g, beta, doc_ids=chunk_segment.repeat_interleave(chunk)[None], chunk_size=chunk,
                         states_in=states_in, states_at=starts, finals_at=ends)
    else:
        if cu_padded is None:
            cu_padded = torch.tensor([*starts, ends[-1] + 1], device=v.device) * chunk  # [S+1]
        o, finals = fused(q.to(dtype), k.to(dtype), v.to(dtype), g, beta, cu_seqlens=cu_padded,
                          initial_state=states_in.contiguous(), output_final_state=True, rule=kernel)
    return o.to(v.dtype), finals.to(v.dtype)


class StatePassingGDN(ContextParallelCore):
    """The gated DeltaNet core of this rank's zigzag tokens, exact across ranks by passing states."""

    name = "state"

    def prepare(self, layer: nn.Module, packed: PackedSeqParams, batch: int, device) -> None:
        segment_chunks(packed, batch, self.cp_size, self.cp_rank, layer.conv1d.weight.shape[-1],
                       getattr(layer, "hybridpar_chunk_size", CHUNK_SIZE), device)

    def __call__(self, layer: nn.Module, mixed_qkv: Tensor, a: Tensor, b: Tensor,
                 packed: PackedSeqParams | None = None) -> Tensor:
        if self.cp_size == 1:
            return local_gdn_core(layer, mixed_qkv, a, b, packed)
        self.checked_layout(packed, mixed_qkv.shape[1])
        batch, local_len, width = mixed_qkv.shape
        dk, dv, heads = layer.head_k_dim, layer.head_v_dim, a.shape[-1]
        weight = local_tensor(layer.conv1d.weight).squeeze(1)
        chunk = getattr(layer, "hybridpar_chunk_size", CHUNK_SIZE)
        plan, aligned = segment_chunks(packed, batch, self.cp_size, self.cp_rank, weight.shape[1], chunk,
                                       mixed_qkv.device)
        position, chunk_segment, padded_len = aligned[0], aligned[1], aligned[4]
        stream = mixed_qkv.reshape(1, batch * local_len, width)  # rows back to back
        halo = conv_halo(stream[0], plan, weight.shape[1], self.cp_group)  # [S, K-1, C]
        pre = document_conv1d(stream, weight, local_tensor(layer.conv1d.bias), plan.cu_segments,
                              plan.cu_segments[:-1], halo)
        q, k, v, g, beta = gdn_inputs(F.silu(pre), a.reshape(1, -1, heads), b.reshape(1, -1, heads),
                                      local_tensor(layer.A_log), local_tensor(layer.dt_bias), head_k_dim=dk,
                                      head_v_dim=dv, beta_scale=beta_scale(layer))
        v = torch.cat([v.new_zeros(*v.shape[:-1], dk), v], dim=-1)  # values [0 | v] for the state [X | S]

        def spread(t: Tensor) -> Tensor:  # [1, T, ...] -> [1, padded, ...], zeros between segments
            return t.new_zeros(1, padded_len, *t.shape[2:]).index_copy(1, position, t)

        identity = torch.eye(dk, dk + dv, dtype=v.dtype, device=v.device).expand(plan.num_segments, heads, dk, dk + dv)
        o, finals = segment_rule(*(spread(t) for t in (q, k, v, g, beta)), identity, *aligned[1:4], chunk,
                                 choose_gdn_kernel(mixed_qkv)[0], mixed_qkv.dtype, cu_padded=aligned[5])
        # o [1, padded, H, dk + dv] = [P_t | o_t|0]; finals [S, H, dk, dk + dv] = [M | S_end|0]
        gathered = all_gather(finals.flatten(1), self.cp_group, 0)  # [S, H*dk*(dk+dv)] -> [P*S, ...], rank-major
        entering = entering_affine_states(gathered.view(self.cp_size, plan.num_docs, 2, heads, dk, dk + dv), plan, dk)
        sensitivity, o = o.view(1, -1, chunk, heads, dk + dv).split([dk, dv], dim=-1)  # [1, N, C, H, dk | dv]
        o = o + torch.einsum("nchk,nhkv->nchv", sensitivity[0], entering[chunk_segment])[None]  # o|0 + P S_in
        o = o.flatten(1, 2).index_select(1, position)  # [1, T, H, dv], the rank's stream order
        return o.reshape(batch, local_len, heads * dv).to(mixed_qkv.dtype)


GDN_STRATEGIES = {"a2a": HiddenParallelGDN, "state": StatePassingGDN}


GDN_TP_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid")  # plans: tensor/hf_plans/moe_hybrid


def validate_gdn_parallel(model: nn.Module, cp: int, tp: int, mamba_strategy: str) -> None:
    """Raise ``ValueError`` (no communication) unless every switched gated DeltaNet of ``model`` can run
    at this ``cp`` and ``tp``: under TP a model type with a head-sharding plan (``GDN_TP_MODEL_TYPES``)
    and key heads divisible by tp; under CP a known strategy and, for "a2a", the local heads divisible."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for name, layer in gdn_layers(model):
        where = f"gated DeltaNet {name!r} ({type(layer).__name__})"
        if tp > 1 and model_type not in GDN_TP_MODEL_TYPES:
            raise ValueError(f"{where}: tensor parallelism of gated DeltaNets is implemented for model types "
                             f"{list(GDN_TP_MODEL_TYPES)}, not {model_type!r}; use parallel.tp=1 with cp or FSDP.")
        if tp > 1 and layer.num_k_heads % tp:
            raise ValueError(f"{where}: {layer.num_k_heads} key heads ({layer.num_v_heads} value heads) are not "
                             f"divisible by tp={tp}; tensor parallelism splits them, choose a tp that divides "
                             f"{layer.num_k_heads}.")
        if cp == 1:
            continue
        if mamba_strategy not in GDN_STRATEGIES:
            raise ValueError(f"{where}: unknown context-parallel strategy cp_mamba={mamba_strategy!r}; set "
                             f"parallel.cp_mamba to one of {sorted(GDN_STRATEGIES)}.")
        heads = (layer.num_v_heads // tp, layer.num_k_heads // tp)  # the local heads under TP
        problem = heads_problem(*heads, cp) if mamba_strategy == "a2a" else None
        if problem:
            raise ValueError(f"{where}{f' at tp={tp}' if tp > 1 else ''}: {problem}.")


def apply_gdn_cp(model: nn.Module, cp_group: dist.ProcessGroup | None, strategy: str = "a2a") -> nn.Module:
    """Install the CP strategy as ``core`` of every switched gated DeltaNet (after ``validate_gdn_parallel``)."""
    return install_core(model, gdn_layers(model), lambda: GDN_STRATEGIES[strategy](cp_group))
