"""Context-parallel Kimi Delta Attention: the two strategies of the gated DeltaNet (``gdn.py``) for
the ``layer.core`` seam of a switched KDA layer (``models/hf/mixers/kda.py``).

Each rank holds ``L/P`` tokens of every row (zigzag) and the layer calls
``core(layer, mixed_qkv, f, b, packed)`` with the pre-conv ``mixed_qkv [B, L/P, 3*H*d]`` (``q | k | v``),
the raw forget-gate projection ``f [B, L/P, H*d]`` and ``b [B, L/P, H]``; the core returns
``o [B, L/P, H*d]``. The output gate, ``o_norm`` and ``o_proj`` stay in the layer. The strategy owns
no parameters: it slices ``conv1d``, ``A_log`` and ``dt_bias`` in the forward pass.

``"a2a"`` (``HiddenParallelKDA``): one fused all-to-all ``[B, L/P, W] -> [B, L, W/P]`` of
``q, k, v, f, b`` (heads ``[r H/P, (r+1) H/P)`` to rank ``r``; ``P`` must divide ``H``), the
single-process core on those heads over the whole sequence in sequence order (documents reset at
the global boundaries), and one all-to-all of ``o`` back. Bytes each rank sends per layer::

    forward  e * B * (L/P) * (P-1)/P * (5*H*d + H)     q, k, v, f, b out; o back;   backward the same

``"state"`` (``StatePassingKDA``): the per-channel decay leaves the rule affine in the state entering
a segment, ``S_end = M S_in + S_end|0`` and ``o_t = o_t|0 + P_t S_in`` (every column of ``S`` follows
``(I - beta k k^T) diag(exp g) s + beta k v[c]`` on its own), so ``gdn.py``'s state passing holds as
is: one run of the KDA rule on the augmented state ``[X | S]`` (values ``[0 | v]``, ``X`` entering as
the identity) per chunk-padded segment gives ``[M | S_end|0]``; one all-gather of those
``[S, H, d, 2d]`` composes the state entering each segment in global order (``gdn.entering_affine_states``), and
the outputs take ``P_t S_in``. The conv reads its ``K-1`` earlier inputs from the other ranks
(``mamba_state.conv_halo``). Bytes each rank sends per layer, independent of ``L``::

    forward  (P-1) * 2*B*n_docs * ((K-1) * 3*H*d * e + H*d*2d * e_s)

**Kernels.** Both strategies run the rule through FLA's ``chunk_kda`` where
``models/linear/kda_fused.py`` chooses it (CUDA, fla-core, float32/bf16/fp16): "a2a" through
``kimi_delta_core``; "state" through ``segment_kda_rule``, each padded segment one of FLA's
``cu_seqlens`` sequences with initial state ``[I | 0]`` and its final state read (the padding,
``k = v = beta = g = 0``, leaves the state as it is): the pure rule's ``states_in`` / ``finals_at``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.mixers.kda import CHUNK_SIZE, kda_layers, local_kda_core
from hybridpar.models.linear.gdn_core import document_conv1d
from hybridpar.models.linear.kda import chunk_kda_rule
from hybridpar.models.linear.kda_core import kda_inputs, kimi_delta_core
from hybridpar.models.linear.kda_fused import choose_kda_kernel, fused_kda_rule
from hybridpar.models.mamba.core import shared_row_documents
from hybridpar.parallel.comm.collectives import all_gather, hidden_to_seq, seq_to_hidden
from hybridpar.parallel.context.core import ContextParallelCore, install_core
from hybridpar.parallel.context.recurrent.gdn import entering_affine_states, segment_chunks, segment_rule
from hybridpar.parallel.context.recurrent.mamba import local_tensor
from hybridpar.parallel.context.recurrent.mamba_state import conv_halo

__all__ = ["HiddenParallelKDA", "StatePassingKDA", "KDA_STRATEGIES", "apply_kda_cp", "validate_kda_parallel",
           "kda_a2a_bytes_per_layer", "kda_state_bytes_per_layer", "segment_kda_rule"]


def kda_a2a_bytes_per_layer(batch: int, seq_len: int, cp: int, heads: int, head_dim: int, element_size: int) -> float:
    """Forward bytes one rank sends per KDA layer with "a2a" (module docstring)."""
    if cp == 1:
        return 0.0
    return element_size * batch * (seq_len / cp) * (cp - 1) / cp * (5 * heads * head_dim + heads)


def kda_state_bytes_per_layer(batch: int, n_docs: int, cp: int, heads: int, head_dim: int, conv_kernel: int,
                              element_size: int, state_element_size: int) -> int:
    """Forward bytes one rank sends per KDA layer with "state" (module docstring)."""
    halo = (conv_kernel - 1) * 3 * heads * head_dim * element_size
    states = heads * head_dim * 2 * head_dim * state_element_size
    return (cp - 1) * 2 * batch * n_docs * (halo + states)


def _gate(layer: nn.Module) -> tuple[Tensor, Tensor]:
    """``(A_log [H], dt_bias [H*d])`` of the layer (this rank's shard under FSDP unsharded)."""
    gate = layer.forget_gate
    return local_tensor(gate.A_log).reshape(-1), local_tensor(gate.dt_bias)


def segment_kda_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states_in: Tensor,
                     chunk_segment: Tensor, starts: list[int], ends: list[int], chunk: int, kernel: str,
                     dtype: torch.dtype, cu_padded: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``gdn.segment_rule`` with the KDA rules (``g [1, N*chunk, H, d]``: a decay per key channel)."""
    return segment_rule(q, k, v, g, beta, states_in, chunk_segment, starts, ends, chunk, kernel, dtype,
                        pure=chunk_kda_rule, fused=fused_kda_rule, cu_padded=cu_padded)

class HiddenParallelKDA(ContextParallelCore):
    """All-to-all sequence -> heads, the KDA core on H/P heads over the whole sequence, back."""

    name = "a2a"

    def __call__(self, layer: nn.Module, mixed_qkv: Tensor, f: Tensor, b: Tensor,
                 packed: PackedSeqParams | None = None) -> Tensor:
        if self.cp_size == 1:
            return local_kda_core(layer, mixed_qkv, f, b, packed)
        cp, rank, d, heads = self.cp_size, self.cp_rank, layer.head_dim, b.shape[-1]
        if heads % cp:
            raise ValueError(f"Kimi Delta Attention context parallelism \"a2a\" splits the {heads} heads over the CP "
                             f"group, which cp={cp} does not divide; use a cp that divides {heads} or cp_mamba=state.")
        layout = self.checked_layout(packed, mixed_qkv.shape[1])
        batch = mixed_qkv.shape[0]
        q, k, v = mixed_qkv.split(heads * d, dim=-1)
        q, k, v, f, b = seq_to_hidden([q, k, v, f, b], self.cp_group, seq_dim=1, hidden_dim=-1)
        # [B, L/P, H*d | H*d | H*d | H*d | H] -> [B, L, (same)/P], rank-major
        device = mixed_qkv.device
        to_sequence = layout.gathered_to_sequence.to(device)  # [L]
        mixed_h, f_h, b_h = (t.index_select(1, to_sequence) for t in (torch.cat([q, k, v], dim=-1), f, b))
        cu_docs = shared_row_documents(packed, batch, to_sequence.numel(), device)  # global documents
        local = heads // cp
        channels = slice(rank * local * d, (rank + 1) * local * d)
        weight = local_tensor(layer.conv1d.weight).squeeze(1)  # [3*H*d, K] -> this rank's q, k, v channels
        weight = torch.cat([w[channels] for w in weight.split(heads * d, dim=0)], dim=0)
        bias = local_tensor(layer.conv1d.bias)
        bias = None if bias is None else torch.cat([x[channels] for x in bias.split(heads * d)])
        A_log, dt_bias = _gate(layer)
        o = kimi_delta_core(mixed_h, f_h, b_h, weight, bias, A_log[rank * local:(rank + 1) * local], dt_bias[channels],
                            head_dim=d, chunk_size=getattr(layer, "hybridpar_chunk_size", CHUNK_SIZE),
                            cu_docs=cu_docs)  # [B, L, H*d/P], sequence order
        o = o.index_select(1, layout.gathered_indices.to(device))  # -> gathered (rank-major) order
        (o,) = hidden_to_seq([o], self.cp_group, seq_dim=1, hidden_dim=-1)  # [B, L, H*d/P] -> [B, L/P, H*d]
        return o


class StatePassingKDA(ContextParallelCore):
    """The KDA core of this rank's zigzag tokens, exact across ranks by passing states."""

    name = "state"

    def prepare(self, layer: nn.Module, packed: PackedSeqParams, batch: int, device) -> None:
        segment_chunks(packed, batch, self.cp_size, self.cp_rank, layer.conv1d.weight.shape[-1],
                       getattr(layer, "hybridpar_chunk_size", CHUNK_SIZE), device)

    def __call__(self, layer: nn.Module, mixed_qkv: Tensor, f: Tensor, b: Tensor,
                 packed: PackedSeqParams | None = None) -> Tensor:
        if self.cp_size == 1:
            return local_kda_core(layer, mixed_qkv, f, b, packed)
        self.checked_layout(packed, mixed_qkv.shape[1])
        batch, local_len, width = mixed_qkv.shape
        d, heads = layer.head_dim, b.shape[-1]
        weight = local_tensor(layer.conv1d.weight).squeeze(1)
        chunk = getattr(layer, "hybridpar_chunk_size", CHUNK_SIZE)
        device = mixed_qkv.device
        plan, aligned = segment_chunks(packed, batch, self.cp_size, self.cp_rank, weight.shape[1], chunk, device)
        position, chunk_segment, padded_len = aligned[0], aligned[1], aligned[4]  # shared with the gated DeltaNet
        stream = mixed_qkv.reshape(1, batch * local_len, width)  # rows back to back
        halo = conv_halo(stream[0], plan, weight.shape[1], self.cp_group)  # [S, K-1, C]
        pre = document_conv1d(stream, weight, local_tensor(layer.conv1d.bias), plan.cu_segments,
                              plan.cu_segments[:-1], halo)
        q, k, v, g, beta = kda_inputs(F.silu(pre), f.reshape(1, -1, f.shape[-1]), b.reshape(1, -1, heads),
                                      *_gate(layer), head_dim=d)
        v = torch.cat([v.new_zeros(*v.shape[:-1], d), v], dim=-1)  # values [0 | v] for the state [X | S]

        def spread(t: Tensor) -> Tensor:  # [1, T, ...] -> [1, padded, ...], zeros between segments
            return t.new_zeros(1, padded_len, *t.shape[2:]).index_copy(1, position, t)

        identity = torch.eye(d, 2 * d, dtype=v.dtype, device=device).expand(plan.num_segments, heads, d, 2 * d)
        o, finals = segment_kda_rule(*(spread(t) for t in (q, k, v, g, beta)), identity, *aligned[1:4], chunk,
                                     choose_kda_kernel(mixed_qkv)[0], mixed_qkv.dtype, cu_padded=aligned[5])
        # o [1, padded, H, 2d] = [P_t | o_t|0]; finals [S, H, d, 2d] = [M | S_end|0]
        gathered = all_gather(finals.flatten(1), self.cp_group, 0)  # [S, H*d*2d] -> [P*S, ...], rank-major
        entering = entering_affine_states(gathered.view(self.cp_size, plan.num_docs, 2, heads, d, 2 * d), plan, d)
        sensitivity, o = o.view(1, -1, chunk, heads, 2 * d).split([d, d], dim=-1)  # [1, N, C, H, d | d]
        o = o + torch.einsum("nchk,nhkv->nchv", sensitivity[0], entering[chunk_segment])[None]  # o|0 + P S_in
        o = o.flatten(1, 2).index_select(1, position)  # [1, T, H, d], the rank's stream order
        return o.reshape(batch, local_len, heads * d).to(mixed_qkv.dtype)


KDA_STRATEGIES = {"a2a": HiddenParallelKDA, "state": StatePassingKDA}


def validate_kda_parallel(model: nn.Module, cp: int, tp: int, strategy: str) -> None:
    """Raise ``ValueError`` (no communication) unless every switched KDA layer of ``model`` can run at
    this ``cp`` and ``tp``: heads divisible by tp (``KDAHeadParallel`` shards them), a known CP strategy
    and, for "a2a", each rank's ``H/tp`` heads divisible by cp."""
    for name, layer in kda_layers(model):
        where = f"Kimi Delta Attention {name!r} ({type(layer).__name__})"
        if tp > 1 and layer.num_heads % tp:
            raise ValueError(f"{where}: {layer.num_heads} heads are not divisible by tp={tp}; use a tp that divides "
                             f"{layer.num_heads}.")
        if cp == 1:
            continue
        if strategy not in KDA_STRATEGIES:
            raise ValueError(f"{where}: unknown context-parallel strategy cp_mamba={strategy!r}; set "
                             f"parallel.cp_mamba to one of {sorted(KDA_STRATEGIES)}.")
        local = layer.num_heads // tp  # the heads of this TP rank
        if strategy == "a2a" and local % cp:
            raise ValueError(f"{where}: context parallelism \"a2a\" splits its {local} heads over the CP "
                             f"group, which cp={cp} does not divide; use a cp that divides {local} or "
                             "cp_mamba=state.")


def apply_kda_cp(model: nn.Module, cp_group: dist.ProcessGroup | None, strategy: str = "a2a") -> nn.Module:
    """Install the CP strategy as ``core`` of every switched KDA layer (after ``validate_kda_parallel``)."""
    return install_core(model, kda_layers(model), lambda: KDA_STRATEGIES[strategy](cp_group))
