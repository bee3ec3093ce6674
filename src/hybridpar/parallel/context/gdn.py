"""Context-parallel gated DeltaNet: all-to-all over heads for the ``layer.core`` seam.

Each rank holds ``L/P`` tokens of every row (``P`` = CP size, zigzag order, ``zigzag.py``) and a
switched transformers gated DeltaNet (``models/hf/gdn_mixers.py``) calls
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

with ``Hk_eff = max(Hk, P)``. The gated delta rule's state is a ``dk x dv`` matrix per head whose
transition depends on the keys, so Mamba's ``"state"`` strategy (scalar decays) does not carry
over: ``parallel.cp_mamba=state`` is refused for these layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.gdn_mixers import beta_scale, gdn_layers, local_gdn_core, CHUNK_SIZE
from hybridpar.models.linear.gdn_core import gated_delta_core
from hybridpar.models.mamba.core import row_documents
from hybridpar.parallel.comm.collectives import hidden_to_seq, seq_to_hidden
from hybridpar.parallel.context.core import ContextParallelCore
from hybridpar.parallel.context.mamba import local_tensor

__all__ = ["HiddenParallelGDN", "apply_gdn_cp", "validate_gdn_parallel", "gdn_a2a_bytes_per_layer"]


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
        cu_docs = row_documents(packed.cu_seqlens_padded, batch, to_sequence.numel(), device)  # global documents
        weight, bias, A_log, dt_bias = self.local_parameters(layer, v_heads, k_heads)
        o = gated_delta_core(mixed_h, a_h, b_h, weight, bias, A_log, dt_bias, head_k_dim=dk, head_v_dim=dv,
                             chunk_size=getattr(layer, "hybridpar_chunk_size", CHUNK_SIZE), cu_docs=cu_docs,
                             beta_scale=beta_scale(layer))  # [B, L, Hv*dv/P], sequence order
        o = o.index_select(1, layout.gathered_indices.to(device))  # -> gathered (rank-major) order
        (o,) = hidden_to_seq([o], self.cp_group, seq_dim=1, hidden_dim=-1)  # [B, L, Hv*dv/P] -> [B, L/P, Hv*dv]
        return o


def validate_gdn_parallel(model: nn.Module, cp: int, tp: int, mamba_strategy: str) -> None:
    """Raise ``ValueError`` (no communication) unless every switched gated DeltaNet of ``model`` can run
    at this ``cp`` and ``tp``: "a2a" only, heads divisible, and no tensor parallelism (its heads are not
    sharded; transformers' own plan would split its fused projections)."""
    for name, layer in gdn_layers(model):
        where = f"gated DeltaNet {name!r} ({type(layer).__name__})"
        if tp > 1:
            raise ValueError(f"{where}: tensor parallelism is not supported for gated DeltaNet layers (their heads are "
                             f"not sharded); use parallel.tp=1 with cp or FSDP, got tp={tp}.")
        if cp == 1:
            continue
        if mamba_strategy != "a2a":
            raise ValueError(f"{where} runs context parallel by all-to-all over heads only, got "
                             f"cp_mamba={mamba_strategy!r}; set parallel.cp_mamba=a2a.")
        problem = heads_problem(layer.num_v_heads, layer.num_k_heads, cp)
        if problem:
            raise ValueError(f"{where}: {problem}.")


def apply_gdn_cp(model: nn.Module, cp_group: dist.ProcessGroup | None) -> nn.Module:
    """Install ``HiddenParallelGDN`` as ``core`` of every switched gated DeltaNet (after ``validate_gdn_parallel``)."""
    layers = gdn_layers(model)
    if layers:
        core = HiddenParallelGDN(cp_group)
        for _, layer in layers:
            layer.core = core
    return model
