"""Tiny float64 LFM2, LFM2-MoE and LFM3 models (gated short convolutions and attention), built from
transformers' own config classes. Every parameter is perturbed so no gradient is trivially zero;
float32 casts stay float64 and MoE experts run eager, as the trainer runs a float64 model.

``lfm2`` has biases everywhere in its short convs (``conv_bias``) and a kernel of 5 (a halo of 4
tokens: longer than some context-parallel chunks); ``lfm2_moe`` a dense and a MoE layer, kernel 3;
``lfm3`` a sliding-window layer (window 5), a full layer with proportional partial RoPE, the
attention gate, sandwich norms and kernel 4.
"""

from __future__ import annotations

from tests.models.hf.tiny import perturbed_float64

VOCAB = 97
_C = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
          use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
NAMES = ("lfm2", "lfm2_moe", "lfm3")


def lfm_config(name: str):
    import transformers as hf

    return {
        "lfm2": lambda: hf.Lfm2Config(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                      conv_L_cache=5, conv_bias=True, block_auto_adjust_ff_dim=False, **_C),
        "lfm2_moe": lambda: hf.Lfm2MoeConfig(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                             num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=16, conv_L_cache=3, **_C),
        "lfm3": lambda: hf.Lfm3Config(num_hidden_layers=4, layer_types=["conv", "sliding_attention", "conv",
                                                                        "full_attention"],
                                      sliding_window=5, head_dim=8, conv_L_cache=4, **_C),
    }[name]()


def build_lfm(name: str, attention: str = "sdpa", seed: int = 0):
    """The tiny float64 model ``name`` (transformers' own forward; ``attention`` its implementation)."""
    import transformers as hf

    from hybridpar.models.hf.float64 import keep_float64

    model = perturbed_float64(lambda: hf.AutoModelForCausalLM.from_config(lfm_config(name)), seed)
    model.set_attn_implementation(attention)
    return keep_float64(model)
