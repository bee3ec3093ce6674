"""Every transformers model type hybridpar's attention takes (``ATTENTION_MODEL_TYPES``) is
proven here, one tiny float64 model per type: a packed row of three documents through
hybridpar's attention (documents from ``packed_seq_params``, as the trainer and CP feed it)
gives the loss and every parameter gradient of the same model with transformers' SDPA (eager for
Gemma2's soft-capped scores) run on each document alone (1e-12). Sliding windows (5 tokens) are shorter than the documents, so the
window rule is exercised. As the trainer runs a float64 model: transformers' float32 casts (norms,
routers) kept in float64 (``keep_float64``), MoE experts eager (grouped_mm has no float64).

A type joins the list only with a builder here; a model type that is not on it trains one
document per row (``tests/train/test_packing_safety.py``) and is refused context parallelism.
"""

from __future__ import annotations

import warnings

import torch

from tests.distributed.tensor.hf_models import relative_error

TOL = 1e-12
VOCAB = 128
DOCS = [0, 12, 17, 40]  # a 5-token document between two longer than the window
_C = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
          num_hidden_layers=2, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_WINDOWED = dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"])
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)


def _configs(hf) -> dict:
    return {
        "llama": lambda: hf.LlamaConfig(**_C),
        "qwen2": lambda: hf.Qwen2Config(use_sliding_window=True, sliding_window=5, max_window_layers=1, **_C),
        "qwen3": lambda: hf.Qwen3Config(head_dim=16, use_sliding_window=True, sliding_window=5, max_window_layers=1, **_C),
        "mistral": lambda: hf.MistralConfig(sliding_window=5, **_C),
        "gemma3_text": lambda: hf.Gemma3TextConfig(head_dim=16, query_pre_attn_scalar=24, **_WINDOWED, **_C),
        "phi": lambda: hf.PhiConfig(partial_rotary_factor=0.5, qk_layernorm=True, **_C),
        "gemma": lambda: hf.GemmaConfig(head_dim=16, **_C),
        "gemma2": lambda: hf.Gemma2Config(head_dim=16, attn_logit_softcapping=2.0, query_pre_attn_scalar=24,
                                          **_WINDOWED, **_C),  # a cap the scores reach
        "phi3": lambda: hf.Phi3Config(**_C),
        "olmo": lambda: hf.OlmoConfig(clip_qkv=3.0, **_C),
        "olmo2": lambda: hf.Olmo2Config(**_C),
        "olmo3": lambda: hf.Olmo3Config(**_WINDOWED, **_C),
        "granite": lambda: hf.GraniteConfig(attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.5,
                                            **_C),
        "granitemoe": lambda: hf.GraniteMoeConfig(num_local_experts=4, num_experts_per_tok=2, attention_multiplier=0.3,
                                                  **_C),
        "starcoder2": lambda: hf.Starcoder2Config(sliding_window=5, **_C),
        "stablelm": lambda: hf.StableLmConfig(partial_rotary_factor=0.25, qk_layernorm=True, **_C),
        "mixtral": lambda: hf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=5, **_C),
        "qwen2_moe": lambda: hf.Qwen2MoeConfig(num_experts=4, shared_expert_intermediate_size=32, **_MOE, **_C),
        "qwen3_moe": lambda: hf.Qwen3MoeConfig(num_experts=4, head_dim=16, **_MOE, **_C),
        "arcee": lambda: hf.ArceeConfig(**_C),
        "smollm3": lambda: hf.SmolLM3Config(no_rope_layers=[1, 0], **_C),
        "glm": lambda: hf.GlmConfig(head_dim=16, **_C),
        "glm4": lambda: hf.Glm4Config(head_dim=16, **_C),
        "exaone4": lambda: hf.Exaone4Config(**_WINDOWED, **_C),
        "ernie4_5": lambda: hf.Ernie4_5Config(head_dim=16, **_C),
        "helium": lambda: hf.HeliumConfig(head_dim=16, **_C),
        "cohere": lambda: hf.CohereConfig(use_qk_norm=True, **_C),
        "cohere2": lambda: hf.Cohere2Config(**_WINDOWED, **_C),
        "hunyuan_v1_dense": lambda: hf.HunYuanDenseV1Config(head_dim=16, **_C),
        "apertus": lambda: hf.ApertusConfig(**_C),
    }


def _model(hf, make, attention: str):
    from hybridpar.models.hf.float64 import keep_float64

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf.AutoModelForCausalLM.from_config(make()).to(torch.float64)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    if type(model)._can_set_experts_implementation():
        model.set_experts_implementation("eager")
    model.set_attn_implementation(attention)
    return keep_float64(model)  # as the trainer runs float64: no float32 cast in norms and routers


def _loss_sum(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")


def test_the_list_is_the_proven_types():
    import transformers as hf

    from hybridpar.parallel.context.hf import ATTENTION_MODEL_TYPES

    configs = _configs(hf)
    assert set(configs) == set(ATTENTION_MODEL_TYPES)
    assert {name: make().model_type for name, make in configs.items()} == {name: name for name in configs}


def test_every_listed_type_on_packed_rows_equals_sdpa_on_each_document_alone():
    import transformers as hf

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.hf import attention_problem, hf_cp_inputs, register_hf_attention
    from hybridpar.parallel.context.inputs import shard_inputs

    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (1, DOCS[-1]), generator=gen) for _ in range(2))
    errors = {}
    for name, make in _configs(hf).items():
        own = "eager" if name == "gemma2" else "sdpa"  # transformers' SDPA path does not soft-cap
        ours, reference = _model(hf, make, register_hf_attention()), _model(hf, make, own)
        assert attention_problem(ours) is None, (name, attention_problem(ours))
        loss = _loss_sum(ours(**hf_cp_inputs(shard_inputs(input_ids=ids, packed=packed))).logits, labels)
        loss.backward()
        want = sum(_loss_sum(reference(input_ids=ids[:, a:b], position_ids=torch.arange(b - a)[None]).logits,
                             labels[:, a:b]) for a, b in zip(DOCS[:-1], DOCS[1:]))
        want.backward()
        grads = {n: p.grad for n, p in reference.named_parameters()}
        errors[name] = max([relative_error(loss, want)] + [relative_error(p.grad, grads[n])
                                                           for n, p in ours.named_parameters()])
        assert all(p.grad is not None for p in ours.parameters() if p.requires_grad) or name in (
            "granitemoe", "mixtral", "qwen2_moe", "qwen3_moe"), name  # unrouted experts get no gradient
    assert max(errors.values()) < TOL, " ".join(f"{k}={v:.1e}" for k, v in errors.items())
