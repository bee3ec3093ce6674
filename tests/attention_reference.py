"""The dense-mask attention the library used before the blockwise core: the tests' reference.

It builds the whole ``[S_q, S_k]`` boolean mask and lets SDPA materialize the scores, so it
is only for small shapes (and for ``benchmarks/attention_memory.py``'s "old" column).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def document_causal_mask(q_pos: Tensor, q_doc: Tensor, k_pos: Tensor, k_doc: Tensor,
                         sliding_window: int | None = None) -> Tensor:
    """Boolean ``[S_q, S_k]``: key visible iff same document, not after the query (and in the window)."""
    same_doc = q_doc[:, None] == k_doc[None, :]
    not_future = k_pos[None, :] <= q_pos[:, None]
    mask = same_doc & not_future
    if sliding_window is not None:
        mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    return mask


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False,
           scale: float | None = None) -> Tensor:
    """Softmax attention ``q [B, Sq, Hq, Dh]``, ``k, v [B, Sk, Hkv, Dh]`` -> ``[B, Sq, Hq, Dh]``.

    KV heads are repeated to the query heads (GQA); ``mask`` is boolean ``[Sq, Sk]`` (True = attend).
    """
    repeat = q.shape[2] // k.shape[2]
    if repeat > 1:
        k = k.repeat_interleave(repeat, dim=2)
        v = v.repeat_interleave(repeat, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=is_causal, scale=scale
    )  # [B, Hq, Sq, Dh]
    return out.transpose(1, 2)


def reference_attention(q, k, v, q_pos, q_doc, k_pos, k_doc, scale=None, sliding_window=None) -> Tensor:
    """Document-causal attention through a dense mask built from global positions and documents."""
    return attend(q, k, v, mask=document_causal_mask(q_pos, q_doc, k_pos, k_doc, sliding_window), scale=scale)


def dense_causal_attention(q: Tensor, k: Tensor, v: Tensor, packed=None) -> Tensor:
    """The old ``causal_attention``: SDPA ``is_causal`` for one document, else the dense document mask."""
    if packed is None:
        return attend(q, k, v, is_causal=True)
    doc = packed.seq_idx[0]
    pos = torch.arange(doc.numel(), device=q.device)
    return attend(q, k, v, mask=document_causal_mask(pos, doc, pos, doc))


def naive_attention(q, k, v, q_pos, q_doc, k_pos, k_doc, scale=None, sliding_window=None, softcap=None) -> Tensor:
    """Softmax written out with explicit scores (no SDPA): a second, independent reference;
    ``softcap`` caps the scores at ``softcap * tanh(scores / softcap)`` (Gemma2)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    repeat = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    mask = document_causal_mask(q_pos, q_doc, k_pos, k_doc, sliding_window)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
