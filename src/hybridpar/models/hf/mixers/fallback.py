"""When a switched mixer hands over to transformers' own forward, and when it must refuse to.

hybridpar's cores run training: no cache, no padding mask (documents and padding travel in
``packed_seq_params``). transformers' forward serves the rest (generation with a cache, a padding
``attention_mask``), where its mixers let packed documents see each other and where a
tensor-parallel shard is not a whole mixer: both are refused in one line, not run wrong.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["takes_transformers_forward"]

_CACHE_KEYS = ("cache_params", "past_key_values")  # what transformers' decoder layers call the cache


def takes_transformers_forward(module: nn.Module, cache, attention_mask: Tensor | None, packed_seq_params,
                               kwargs: dict, sharded_by: str | None = None) -> bool:
    """True when ``module`` must run transformers' forward (a cache or a padding mask), ValueError when that
    forward would be wrong: ``sharded_by`` names how the module is sharded under TP (None: whole), and
    several documents in ``packed_seq_params`` would leak into each other."""
    cached = cache is not None or any(kwargs.get(key) is not None for key in _CACHE_KEYS)
    padded = attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all())
    if not (cached or padded):
        return False
    name = type(module).__name__
    if sharded_by:
        raise ValueError(f"{name} is sharded by {sharded_by} (tensor parallel), where only hybridpar's core runs: pass "
                         "no cache and no padding attention_mask (describe padding and documents with "
                         "packed_seq_params), or generate with the unsharded model.")
    if packed_seq_params is not None and packed_seq_params.cu_seqlens.numel() > 2:  # shape only, no sync
        raise ValueError(f"{name} got packed_seq_params of several documents together with a cache or a padding "
                         "attention_mask, where transformers' own forward runs and lets the documents see each "
                         "other; pass use_cache=False and no attention_mask.")
    return True
