"""A tiny float64 Kimi Linear model from transformers' own config class: a Kimi Delta Attention layer
(dense MLP), an MLA layer (no RoPE; MoE of 4 experts, 2 per token, one shared), a second KDA layer
(MoE); 4 linear heads of 8 channels, hybridpar's chunk of 8 tokens so the test documents cross chunks.
Every parameter is perturbed so no gradient is trivially zero; ``keep_float64`` keeps transformers'
float32 casts (norms, the decay, the router, its torch KDA) in float64.
"""

from __future__ import annotations

from tests.models.hf.tiny import perturbed_float64

VOCAB = 97
CHUNK = 8
LAYERS = 2  # Kimi Delta Attentions per tiny model
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
              qk_nope_head_dim=8, v_head_dim=8, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
              linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4, use_cache=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, layer_types=["linear_attention", "full_attention", "linear_attention"],
              mlp_layer_types=["dense", "sparse", "sparse"])


def build_kda(seed: int = 0, chunk: int | None = CHUNK, heads: int = 4):
    """The tiny float64 Kimi Linear model (train mode, eager experts, perturbed parameters, float64
    casts) with ``heads`` linear heads."""
    import transformers as hf

    from hybridpar.models.hf.float64 import keep_float64

    config = hf.KimiLinearConfig(**{**CONFIG, "linear_num_heads": heads})
    model = perturbed_float64(lambda: hf.KimiLinearForCausalLM(config), seed)
    if chunk is not None:
        for module in model.modules():
            if hasattr(module, "forget_gate"):
                module.hybridpar_chunk_size = chunk
    return keep_float64(model).train()
