"""A tiny float64 RecurrentGemma (Griffin: two RG-LRU blocks, then a local sliding-window MQA layer with
partial RoPE), built from transformers' own config class. Every parameter is perturbed so no gradient is
trivially zero; float32 casts stay float64."""

from __future__ import annotations

from tests.models.hf.tiny import perturbed_float64

VOCAB = 97
WINDOW = 6  # the attention layer's sliding window, shorter than the test documents


def build_recurrent_gemma(name: str = "recurrent_gemma", attention: str = "sdpa", seed: int = 0):
    """The tiny float64 model (transformers' own forward); ``name`` is for the shared CP runner."""
    import transformers as hf

    from hybridpar.models.hf.float64 import keep_float64

    config = hf.RecurrentGemmaConfig(num_hidden_layers=3, hidden_size=32, lru_width=24, num_attention_heads=4,
                                     num_key_value_heads=1, intermediate_size=48, vocab_size=VOCAB,
                                     attention_window_size=WINDOW, conv1d_width=4, use_cache=False, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2)
    model = perturbed_float64(lambda: hf.RecurrentGemmaForCausalLM(config), seed)
    model.set_attn_implementation(attention)
    return keep_float64(model.train())
