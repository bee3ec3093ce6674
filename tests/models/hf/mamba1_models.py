"""Tiny float64 Mamba, FalconMamba and Jamba models (Mamba1 mixers; Jamba with attention and MoE),
built from transformers' own config classes. Every parameter is perturbed so no gradient is
trivially zero; float32 casts stay float64 and MoE experts run eager.

``mamba`` has biases in in/out projections and a SiLU conv; ``falcon_mamba`` its weightless RMS on
dt, B, C and no conv bias; ``jamba`` two Mamba layers (dt/B/C RMSNorms), an attention layer and
experts on every other layer.
"""

from __future__ import annotations

from tests.models.hf.tiny import perturbed_float64

VOCAB = 97
NAMES = ("mamba", "falcon_mamba", "jamba")
_M = dict(hidden_size=16, state_size=4, num_hidden_layers=2, vocab_size=VOCAB, conv_kernel=4, expand=2,
          time_step_rank=3, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def mamba1_config(name: str):
    import transformers as hf

    return {
        "mamba": lambda: hf.MambaConfig(use_bias=True, **_M),
        "falcon_mamba": lambda: hf.FalconMambaConfig(use_conv_bias=False, mixer_rms_eps=1e-6, **_M),
        "jamba": lambda: hf.JambaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2,
                                        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                                        mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, mamba_dt_rank=3,
                                        mamba_conv_bias=True, mamba_proj_bias=True, use_cache=False,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2),
    }[name]()


def build_mamba1(name: str, attention: str = "sdpa", seed: int = 0):
    """The tiny float64 model ``name`` (transformers' own forward)."""
    import transformers as hf

    from hybridpar.models.hf.float64 import keep_float64

    model = perturbed_float64(lambda: hf.AutoModelForCausalLM.from_config(mamba1_config(name)), seed)
    if name == "jamba":
        model.set_attn_implementation(attention)
    return keep_float64(model)
