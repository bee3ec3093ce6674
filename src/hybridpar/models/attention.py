"""Grouped-query causal attention with RoPE and document masks for packed input.

The token-mixing core (``Attention.core``) is the seam context parallelism replaces:
it takes ``q [B, S, Hq, Dh]``, ``k, v [B, S, Hkv, Dh]`` after RoPE and the batch's
``PackedSeqParams`` and returns ``[B, S, Hq, Dh]``. Head counts are read from the
tensors, so a tensor-parallel shard of the projections needs no change here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def rotary_cos_sin(position_ids: Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``cos, sin [B, S, rotary_dim]`` for integer positions ``[B, S]`` (half-split layout)."""
    compute_dtype = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=compute_dtype, device=position_ids.device) / rotary_dim))
    angles = position_ids.to(compute_dtype)[..., None] * inv_freq  # [B, S, rotary_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, S, rotary_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of every head of ``x [B, S, H, Dh]``."""
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    x_rot = x_rot * cos[:, :, None, :] + rotated_half * sin[:, :, None, :]
    return torch.cat([x_rot, x_pass], dim=-1)


def document_causal_mask(q_index: Tensor, q_doc: Tensor, k_index: Tensor, k_doc: Tensor) -> Tensor:
    """Boolean ``[Tq, Tk]`` mask: key visible iff same document and not after the query.

    Indices are global token positions and docs are document ids, so the mask is right
    for any token order (context-parallel ranks hold tokens out of order).
    """
    same_doc = q_doc[:, None] == k_doc[None, :]
    not_future = k_index[None, :] <= q_index[:, None]
    return same_doc & not_future


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
    """Softmax attention, ``q [B, Sq, Hq, Dh]``, ``k, v [B, Sk, Hkv, Dh]`` -> ``[B, Sq, Hq, Dh]``.

    KV heads are repeated to the query heads (GQA); ``mask`` is boolean, broadcastable to
    ``[B, Hq, Sq, Sk]`` (True = attend).
    """
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} are not a multiple of kv heads {num_kv_heads}.")
    repeat = num_heads // num_kv_heads
    if repeat > 1:
        k = k.repeat_interleave(repeat, dim=2)
        v = v.repeat_interleave(repeat, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=is_causal
    )  # [B, Hq, Sq, Dh]
    return out.transpose(1, 2)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, packed=None) -> Tensor:
    """The single-process core: causal attention, restricted to each document when packed."""
    if packed is None:
        return attend(q, k, v, is_causal=True)
    seq_idx = packed.seq_idx[0]  # [S]; tokens are in sequence order on one process
    index = torch.arange(seq_idx.numel(), device=q.device)
    mask = document_causal_mask(index, seq_idx, index, seq_idx)
    return attend(q, k, v, mask=mask)


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

