"""The transformers model types whose documents hybridpar's attention keeps apart, each proven.

An attention type is listed when its attention modules hand transformers' attention interface
q/k/v after every step of their own (projections, q/k norms, partial or no RoPE, multipliers,
latent projections) and nothing else it must apply but ``scaling``, ``sliding_window`` and
``softcap``: each is proven equal to SDPA (eager where scores are soft-capped) on every document
alone, loss and every gradient in float64 (tests/distributed/context/test_hf_model_types.py).
docs/hf-models.md lists the types left off and why (attention sinks, ALiBi, masks only
transformers' mask builds: chunked or sparse attention, a window the module does not pass on;
linear attention, attention outside the interface).

Llama 4 is exact up to a length: a chunked layer attends within ``attention_chunk_size``-token
chunks of its positions, a mask only transformers draws, and no chunk boundary falls inside a
document that short; a NoPE layer's temperature tuning scales queries by the token's index in the
row, which is 1 below ``floor_scale - 1`` tokens. ``check_document_limit`` refuses what lies
beyond, with one host sync per batch (cached on its ``PackedSeqParams``), not one per layer.
"""

from __future__ import annotations

import weakref

from torch import Tensor, nn

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.attention.layout import cached

__all__ = ["check_document_limit", "ATTENTION_MODEL_TYPES", "GDN_MODEL_TYPES", "HYBRID_MODEL_TYPES", "KDA_MODEL_TYPES",
           "SHORT_CONV_MODEL_TYPES", "MAMBA1_MODEL_TYPES", "RGLRU_MODEL_TYPES", "SUPPORTED_MODEL_TYPES"]

# Mamba2 hybrids whose decoder layers hand packed_seq_params to every mixer (tests/models/hf/test_mamba_mixers.py)
HYBRID_MODEL_TYPES = ("bamba", "nemotron_h", "falcon_h1", "granitemoehybrid", "zamba2")
# gated DeltaNet hybrids, their layers on hybridpar's core (models/hf/mixers/gdn.py; tests/models/hf/test_gdn_mixers.py)
GDN_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid")
# Kimi Delta Attention hybrids (per-channel decay), their KDA layers on hybridpar's core and their MLA on its attention
# (models/hf/mixers/kda.py; tests/models/hf/test_kda_mixers.py)
KDA_MODEL_TYPES = ("kimi_linear",)
ATTENTION_MODEL_TYPES = (
    # Llama's layout and its relatives; attention and residual multipliers (Granite)
    "llama", "arcee", "helium", "apertus", "apertus1p5_text", "hunyuan_v1_dense", "ernie4_5", "glm", "glm4", "exaone",
    "internlm3", "iquestcoder", "hyperclovax", "jais2", "seed_oss", "bitnet", "nanochat", "nemotron", "diffllama",
    "moshi", "granite", "granitemoe", "granitemoeshared",
    # chunked attention and temperature tuning: exact up to a document and row length (check_document_limit)
    "llama4_text",
    # sliding-window layers, soft-capped scores
    "qwen2", "qwen3", "mistral", "ministral", "ministral3", "starcoder2", "exaone4", "olmo3", "cohere2", "gemma3_text",
    "gemma2", "vaultgemma", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "cwm", "dory", "modernbert-decoder",
    "cohere_compass_text",
    # partial RoPE, NoPE layers, q/k norms, qkv clipping, fused projections, absolute positions
    "gemma", "phi", "phi3", "stablelm", "smollm3", "olmo", "olmo2", "cohere", "persimmon", "hrm_text",
    "gpt2", "gpt_bigcode", "gptj", "codegen", "gpt_neox", "ctrl",
    # mixture of experts
    "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "olmoe", "flex_olmo", "jetmoe", "minimax_m2", "minimax_m3_vl_text",
    "hunyuan_v1_moe", "hy_v3", "aria_text", "ernie4_5_moe", "dots1", "sarvam_moe", "solar_open", "exaone_moe", "afmoe",
    "beam", "cohere2_moe", "kolibri1", "laguna", "mellum", "dbrx",
    # attention sinks: one logit per head in the softmax (models/attention/sinks.py)
    "gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "flint",
    # multi-head latent attention (v's head dim is not q/k's: hf_attention pads them to one)
    "deepseek_v3", "deepseek_v2", "glm4_moe_lite", "minicpm3", "youtu", "sarvam_mla", "axk1", "longcat_flash",
)
# gated short convolutions on hybridpar's document-resetting conv (tests/models/hf/test_short_conv.py)
SHORT_CONV_MODEL_TYPES = ("lfm2", "lfm2_moe", "lfm3")
# Mamba1 hybrids on hybridpar's document-resetting selective scan, one process (models/hf/mixers/mamba1.py)
MAMBA1_MODEL_TYPES = ("jamba", "falcon_mamba", "mamba")
# RG-LRU blocks on the same scan, local sliding-window MQA with partial RoPE (models/hf/mixers/rglru.py;
# tests/models/hf/test_rglru_blocks.py)
RGLRU_MODEL_TYPES = ("recurrent_gemma",)
SUPPORTED_MODEL_TYPES = (ATTENTION_MODEL_TYPES + HYBRID_MODEL_TYPES + GDN_MODEL_TYPES + SHORT_CONV_MODEL_TYPES
                         + MAMBA1_MODEL_TYPES + RGLRU_MODEL_TYPES + KDA_MODEL_TYPES)


def _document_limit(module: nn.Module) -> tuple[int | None, int | None]:
    """``(longest document, longest row)`` in tokens for which this module's attention is hybridpar's
    (None: any); Llama 4, see the module docstring."""
    config, documents, rows = module.config, None, None
    layer_types = getattr(config, "layer_types", None) or ()
    layer = getattr(module, "layer_idx", None)
    if getattr(config, "attention_chunk_size", None) and layer is not None and layer < len(layer_types) \
            and layer_types[layer] == "chunked_attention":
        documents = config.attention_chunk_size
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        rows = module.floor_scale - 1
        documents = rows if documents is None else min(documents, rows)
    return documents, rows


def check_document_limit(module: nn.Module, where: str, local_tokens: int, packed: PackedSeqParams | None,
                          position_ids: Tensor | None) -> None:
    """Raise ``ValueError`` where ``_document_limit`` does not hold (every rank alike: global documents)."""
    documents, rows = _document_limit(module)
    if documents is None:
        return
    if packed is not None:  # one host sync per batch, not per layer: cached on the batch's layout
        longest = cached(packed.cache, "hf.longest_document",
                         lambda: int((packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).max()))
    else:
        longest = _longest_position(position_ids) if position_ids is not None else local_tokens
    if longest > documents or (rows is not None and local_tokens > rows):
        raise ValueError(f"{where} (layer {module.layer_idx}) equals transformers' chunked attention and temperature "
                         f"tuning for documents of at most {documents} tokens and rows of at most {rows or 'any'} "
                         f"tokens per rank, got a {longest}-token document in rows of {local_tokens}; use "
                         f"data.pack_size <= {documents}.")


_LAST_POSITIONS: list = [None, -1, 0]  # (weak reference to the position_ids tensor, its version, its max + 1)


def _longest_position(position_ids: Tensor) -> int:
    """``max(position_ids) + 1``, one host sync per forward: every layer gets the model's one tensor. Its version
    too: a loop that refills one position buffer in place (``copy_``) was checked against the first batch's max."""
    ref, version = _LAST_POSITIONS[0], position_ids._version
    if ref is None or ref() is not position_ids or _LAST_POSITIONS[1] != version:
        _LAST_POSITIONS[:] = [weakref.ref(position_ids), version, int(position_ids.max()) + 1]
    return _LAST_POSITIONS[2]
