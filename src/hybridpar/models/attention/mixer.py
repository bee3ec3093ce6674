"""Grouped-query causal attention with RoPE; packed rows attend within their documents.

The token-mixing core (``Attention.core``) is the seam context parallelism replaces:
it takes ``q [B, S, Hq, Dh]``, ``k, v [B, S, Hkv, Dh]`` after RoPE and the batch's
``PackedSeqParams`` and returns ``[B, S, Hq, Dh]``. Head counts are read from the
tensors, so a tensor-parallel shard of the projections needs no change here. The
single-process core is ``attention_kernels.attention_core`` on the row's positions and
document ids: blockwise with an online softmax (``flash.py``), never an ``[S, S]`` mask.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from hybridpar.models.attention.kernels import attention_core
from hybridpar.models.attention.layout import AttentionLayout, cached
from hybridpar.models.attention.blockwise import check_qkv
from hybridpar.models.attention.rotary import apply_rotary, rotary_cos_sin


def sequence_layout(packed, seq_len: int, device: torch.device) -> AttentionLayout:
    """Positions and documents of a row in sequence order (one process, or ulysses after its exchange).

    Packed: documents from ``packed.seq_idx``, cached on ``packed`` so every layer of a step
    shares the layout and its block plan. Dense (``packed=None``): one document of ``seq_len``
    tokens, cached per process by ``(seq_len, device)``.
    """
    if packed is None:
        if torch.compiler.is_compiling():
            return _dense_layout.__wrapped__(seq_len, device)
        return _dense_layout(seq_len, device)
    if packed.seq_idx.shape[-1] != seq_len:
        raise ValueError(
            f"attention got {seq_len} tokens per row but packed params describe {packed.seq_idx.shape[-1]} "
            "(seq_idx); pass the PackedSeqParams built for this batch (on a context-parallel rank: the one "
            "shard_inputs returned)."
        )
    return cached(packed.cache, ("attention.sequence", str(device)), lambda: AttentionLayout.sequence(
        packed.seq_idx[0].to(device), packed.cu_seqlens_padded.to(device), packed.max_seqlen))


@functools.lru_cache(maxsize=8)
def _dense_layout(seq_len: int, device: torch.device) -> AttentionLayout:
    doc = torch.zeros(seq_len, dtype=torch.int32, device=device)
    return AttentionLayout.sequence(doc, torch.tensor([0, seq_len], dtype=torch.int32, device=device), seq_len)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, packed=None) -> Tensor:
    """The single-process core: causal attention, restricted to each document when packed.

    ``q [B, S, Hq, Dh]``, ``k, v [B, S, Hkv, Dh]`` -> ``[B, S, Hq, Dh]`` through
    ``attention_core`` (blockwise on CPU, fused kernels on CUDA); nothing of size ``[S, S]``.
    """
    check_qkv(q, k, v, "causal_attention")
    return attention_core(q, k, v, sequence_layout(packed, q.shape[1], q.device))


class Attention(nn.Module):
    """GQA attention: ``q/k/v_proj -> RoPE -> core -> o_proj`` on ``[B, S, D]``."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float = 10000.0,
        rotary_fraction: float = 1.0,
        bias: bool = False,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.rotary_dim = int(head_dim * rotary_fraction) // 2 * 2
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.core = causal_attention

    def forward(self, hidden_states: Tensor, packed=None) -> Tensor:
        batch, seq_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, seq_len, -1, self.head_dim)
        k = self.k_proj(hidden_states).view(batch, seq_len, -1, self.head_dim)
        v = self.v_proj(hidden_states).view(batch, seq_len, -1, self.head_dim)
        if self.rotary_dim > 0:
            if packed is not None:
                positions = packed.position_ids.expand(batch, -1)
            else:
                positions = torch.arange(seq_len, device=hidden_states.device).expand(batch, -1)
            cos, sin = rotary_cos_sin(positions, self.rotary_dim, self.rope_theta, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, k, v, packed)  # [B, S, Hq, Dh]
        return self.o_proj(out.reshape(batch, seq_len, -1))

