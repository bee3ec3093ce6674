"""What the paths hybridpar leaves to transformers cost in sequence length: its own attention, where
hybridpar's core does not stand in for it (``hf.attention_problem``: ALiBi, attention dropout, a mask
only transformers builds, ...), and the ``[tokens, vocabulary]`` logits of a head the chunked loss
cannot take (``causal_lm.chunked_head``: a head bias, its own forward, an unmapped logit transform).

Such a model trains one document per row of ``S = data.pack_size`` tokens (``train/packing_rule``),
and the attention transformers runs keeps ``[S, S]`` tensors, ``e`` bytes per element, per rank::

    eager, or SDPA every attention module keeps its probabilities P [B, H/tp, S, S] for the
    with dropout   backward of P V (SDPA's math path: dropout)   -> layers * H/tp * S^2 * e
    SDPA + ALiBi   the model's float bias [B, H, S, S], built once per forward and kept for the
                   backward of every layer (Falcon)              -> H/tp * S^2 * e
    SDPA           no [S, S] tensor: a causal row of one document needs no mask   -> 0

(measured in ``benchmarks/memory_growth.py``: Bloom, MPT, GPT-Neo (eager), Falcon (ALiBi) and a Llama
with attention dropout (SDPA) grow as S^2; OPT (SDPA) linearly). This is a floor: eager attention also
keeps the scores' dropout mask and the softmax's input where it soft-caps or dropout is on.

The logits path keeps the logits of a rank's tokens ``[T/(cp*tp), V]`` (and cross entropy's
gradient of the same size): linear in T, but ``V`` per token where the chunked loss keeps none.
"""

from __future__ import annotations

from torch import nn

from hybridpar.models.token_dropout import unkeyed_dropout
from hybridpar.parallel.context.hf import attention_problem, hf_attention_modules, is_hf_model

__all__ = ["square_attention", "own_attention_bytes", "own_attention_note", "logits_path", "own_logits_bytes",
           "own_path_bytes", "own_path_words", "memory_fixes"]


def _alibi(config) -> bool:
    attn_config = getattr(config, "attn_config", None)  # MPT keeps it there
    return bool(getattr(config, "alibi", False) or getattr(attn_config, "alibi", False))


def square_attention(model: nn.Module) -> str | None:
    """``"eager"`` or ``"alibi"``: the kind of ``[S, S]`` tensor transformers' attention keeps for
    ``model`` (module docstring); None where hybridpar's core runs it or SDPA needs none."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation") or attention_problem(model) is None:
        return None
    if config._attn_implementation == "eager" or (config._attn_implementation == "sdpa" and unkeyed_dropout(config)):
        return "eager"
    return "alibi" if _alibi(config) else None


def _heads(model: nn.Module) -> int:
    config = model.config
    return int(getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
               or getattr(config, "n_heads", None) or 1)


def own_attention_bytes(model: nn.Module, row_tokens: int, element: int, tp: int = 1) -> int:
    """Bytes of the ``[S, S]`` tensors transformers' attention keeps for a row of ``row_tokens``
    (module docstring; 0 where none)."""
    kind = square_attention(model)
    if kind is None:
        return 0
    heads = -(-_heads(model) // tp)
    layers = len(hf_attention_modules(model)) or int(getattr(model.config, "num_hidden_layers", 1) or 1)
    return (layers if kind == "eager" else 1) * heads * row_tokens * row_tokens * element


def own_attention_note(model: nn.Module) -> str:
    """The clause the trainer's attention line adds: what grows with the square of the pack size."""
    kind = square_attention(model)
    if kind == "eager":
        return ("; it keeps each layer's [S, S] attention probabilities, so memory grows with the square of "
                "data.pack_size (hybridpar plan prices it)")
    if kind == "alibi":
        return ("; its ALiBi bias is a [heads, S, S] tensor, so memory grows with the square of data.pack_size "
                "(hybridpar plan prices it)")
    return ""


def logits_path(model: nn.Module) -> bool:
    """True where the loss runs through transformers' ``[tokens, vocabulary]`` logits (no chunked head)."""
    from hybridpar.models.hf.causal_lm import chunked_head

    if not is_hf_model(model):
        return False
    try:
        chunked_head(model)
    except ValueError:
        return True
    return False


def own_logits_bytes(model: nn.Module, pack_size: int, element: int, tp: int = 1, cp: int = 1) -> int:
    """Bytes per rank of the logits path's ``[T/(cp*tp), V]`` logits (0 where the chunked loss runs)."""
    return -(-pack_size // (cp * tp)) * int(model.config.vocab_size) * element if logits_path(model) else 0


def own_path_bytes(model: nn.Module, pack_size: int, element: int, tp: int = 1, cp: int = 1) -> int:
    """Bytes per rank of the ``[S, S]`` attention tensors and the logits path's ``[T/(cp*tp), V]`` logits."""
    return own_attention_bytes(model, pack_size, element, tp) + own_logits_bytes(model, pack_size, element, tp, cp)


def own_path_words(model: nn.Module) -> str:
    """The clause a memory refusal adds for what ``own_path_bytes`` counts (empty where nothing)."""
    words = ["the [S, S] tensors of its attention"] if square_attention(model) else []
    words += ["its [tokens, vocabulary] logits"] if logits_path(model) else []
    return "".join(f", {w}" for w in words)


def memory_fixes(model: nn.Module | None) -> str:
    """The ways out a memory refusal names; more context parallelism only for a model that runs at cp > 1 (one
    trained one document per row on transformers' attention is refused there)."""
    if model is not None and is_hf_model(model) and attention_problem(model):
        return "use a smaller data.pack_size, fewer packs or shorter documents"
    return "use a smaller data.pack_size, fewer packs, shorter documents or more context parallelism (parallel.cp)"
