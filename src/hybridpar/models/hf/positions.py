"""How many positions a transformers model covers: a learned position table (refused past its end) or
computed positions (RoPE: warned past ``max_position_embeddings``, or a fixed-range scaling's
``factor x original_max_position_embeddings``; ``dynamic`` scaling stretches by design).

Single-device code; reads a model's config only.
"""

from __future__ import annotations

import math

from torch import nn

__all__ = ["EXTENDING_ROPE", "learned_positions", "rope_position_limit", "position_note"]


def learned_positions(model: nn.Module) -> tuple[str, int] | None:
    """``(module name, positions)`` of a learned absolute position table (GPT-2's ``wpe``, OPT's
    ``embed_positions``): position ids at or beyond ``positions`` index past it. None when positions
    are computed (RoPE, ALiBi, none), which have no such limit."""
    config, inputs = getattr(model, "config", None), model.get_input_embeddings()
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    for name, module in model.named_modules():  # a table with one row per position the config allows
        rows = getattr(module, "num_embeddings", 0) - int(getattr(module, "offset", 0))
        if isinstance(module, nn.Embedding) and module is not inputs and limit and rows == limit:
            return name, rows
    return None


EXTENDING_ROPE = ("dynamic",)  # scalings that stretch RoPE past max_position_embeddings by design


def rope_position_limit(fields: dict) -> tuple[int, str] | None:
    """``(positions, RoPE type)`` a computed-position model covers, from config.json ``fields``: its
    ``max_position_embeddings``, or for a fixed-range scaling (linear, YaRN, LongRoPE, Llama 3) that
    names ``original_max_position_embeddings``, ``factor`` times that when larger (Qwen's YaRN keeps
    ``max_position_embeddings`` at the original length). None without a limit, or for ``dynamic``."""
    limit = fields.get("max_position_embeddings")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        return None
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    rope = rope if isinstance(rope, dict) else {}
    kind = str(rope.get("rope_type") or rope.get("type") or "default")
    if kind in EXTENDING_ROPE:
        return None
    original = rope.get("original_max_position_embeddings") or fields.get("original_max_position_embeddings")
    factor = rope.get("factor")
    if kind != "default" and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                                 for v in (original, factor)):
        limit = max(limit, int(original * factor))
    return limit, kind


def _position_fields(model) -> dict:
    config = getattr(model, "config", None)
    hf = getattr(model, "hf_config", None)  # a HybridLM loaded from a checkpoint: the config.json dict
    return hf if isinstance(hf, dict) else {k: getattr(config, k, None) for k in (
        "max_position_embeddings", "rope_parameters", "rope_scaling", "original_max_position_embeddings")}


def position_note(model: nn.Module, positions: int, what: str = "the prompt plus the new tokens need") -> str | None:
    """A warning when ``positions`` (prompt plus new tokens, or a training pack) pass the positions a
    computed-position model (RoPE) covers (``rope_position_limit``): it runs (positions are computed,
    unlike a learned table, which is refused) but what comes past them is extrapolation. None within
    the limit, for a model that gives none, or for a RoPE scaling that extends it (dynamic NTK)."""
    found = rope_position_limit(_position_fields(model))
    if found is None or positions <= found[0]:
        return None
    limit, kind = found
    stated = _position_fields(model).get("max_position_embeddings")
    past = (f"the model's max_position_embeddings={limit} (RoPE '{kind}')" if limit == stated else
            f"the {limit} its RoPE '{kind}' scaling covers (max_position_embeddings={stated})")
    return (f"{what} {positions} positions, past {past}: it computes them, but text past {limit} is extrapolation "
            f"and often degrades; "
            f"{'use a data.pack_size <=' if 'pack' in what else 'keep the prompt plus the new tokens within'} {limit} (or use a checkpoint "
            f"whose RoPE scaling covers {positions})")
