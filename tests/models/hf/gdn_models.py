"""Tiny float64 transformers models with gated DeltaNet layers, from transformers' own config classes.

Qwen3-Next (dense MLPs; and its MoE), Qwen3.5 text, Qwen3.5-MoE text: a gated DeltaNet layer, a
full-attention layer and a second gated DeltaNet, 2 key heads and 4 value heads (value heads grouped
over key heads), hybridpar's chunk of 8 tokens so the test documents cross chunks. Every parameter is
perturbed so no gradient is trivially zero; ``keep_float64`` keeps transformers' float32 casts (norms,
the decay) in float64, as the trainer does for a float64 model.
"""

from __future__ import annotations

from tests.models.hf.tiny import perturbed_float64

VOCAB = 97
CHUNK = 8
_BASE = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
          vocab_size=VOCAB, use_cache=False, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
          linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=3,
          layer_types=["linear_attention", "full_attention", "linear_attention"])
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)


def _builders(hf, k_heads: int, v_heads: int) -> dict:
    _C = {**_BASE, "linear_num_key_heads": k_heads, "linear_num_value_heads": v_heads}
    return {
        "qwen3_next": lambda: hf.Qwen3NextForCausalLM(hf.Qwen3NextConfig(mlp_only_layers=[0, 1, 2], **_C)),
        "qwen3_next_moe": lambda: hf.Qwen3NextForCausalLM(hf.Qwen3NextConfig(**_MOE, **_C)),
        "qwen3_5": lambda: hf.Qwen3_5ForCausalLM(hf.Qwen3_5TextConfig(**_C)),
        "qwen3_5_moe": lambda: hf.Qwen3_5MoeForCausalLM(hf.Qwen3_5MoeTextConfig(**_MOE, **_C)),
        # separate q/k/v/a/b/g projections, beta in [0, 2] (allow_neg_eigval); NoPE attention, q/k norms
        "olmo_hybrid": lambda: hf.OlmoHybridForCausalLM(hf.OlmoHybridConfig(
            pad_token_id=0, eos_token_id=1, **{k: v for k, v in _C.items() if k != "head_dim"})),
    }


GDN_MODELS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")
LAYERS = 2  # gated DeltaNets per tiny model


def build_gdn(name: str, seed: int = 0, chunk: int | None = CHUNK, k_heads: int = 2, v_heads: int = 4):
    """The tiny float64 model ``name`` (train mode, eager experts, perturbed parameters, float64 casts)
    with ``k_heads`` key and ``v_heads`` value heads in its gated DeltaNets."""
    import transformers as hf

    from hybridpar.models.hf.float64 import keep_float64

    model = perturbed_float64(_builders(hf, k_heads, v_heads)[name], seed)
    if chunk is not None:
        for module in model.modules():
            if hasattr(module, "A_log"):
                module.hybridpar_chunk_size = chunk
    return keep_float64(model).train()
