"""Tiny float64 Hugging Face models and the TP parity run shared by the TP test modules.

``build_model(name)`` makes a 2-layer model (hidden 64, vocab 127: the vocab-parallel
embedding and LM head shard unevenly) with every parameter perturbed so no gradient is
trivially zero, SDPA attention (float64 softmax) and no dropout.

Hugging Face norms compute in float32 (``x.to(float32)``); a float32 rounding flip caused by
a 1e-16 difference in a TP partial sum would cap parity at ~1e-7, so both the reference and
the TP model run their RMSNorms (and Cohere's LayerNorm) in the input dtype here. Mixtral's
router keeps its routing weights in float32 (the other MoE routers cast them back), so it
runs in the input dtype too; MoE experts use the eager implementation (``grouped_mm`` has no
float64 kernel).

``parity(name, sequence_parallel, tp_mesh)`` runs the single-process reference and the TP
model on the same batch and returns the logits error and every parameter's gradient error
(gathered with ``full_tensor``), relative to the tensor's scale.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

VOCAB = 127
SEQ = 16
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, attn_implementation="sdpa", use_cache=False)
_MAMBA = dict(mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32, experts_implementation="eager")


def _unregistered_llama_class():
    from transformers import LlamaForCausalLM

    class UnregisteredLlama(LlamaForCausalLM):
        """A Llama-shaped class with no registry entry and no Hugging Face plan."""

        _tp_plan = None

    UnregisteredLlama.__qualname__ = UnregisteredLlama.__name__ = "UnregisteredLlama"
    return UnregisteredLlama


def _unregistered_llama(hf):
    config = hf.LlamaConfig(**COMMON)
    config.base_model_tp_plan = None
    return _unregistered_llama_class()(config)


def _builders(hf) -> dict:
    c = COMMON
    return {
        "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**c)),
        "qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**c)),  # q/k/v biases
        "qwen3": lambda: hf.Qwen3ForCausalLM(hf.Qwen3Config(head_dim=16, **c)),
        "mistral": lambda: hf.MistralForCausalLM(hf.MistralConfig(sliding_window=6, **c)),
        # tied embeddings, sliding + full layers, soft-capped logits
        "gemma3": lambda: hf.Gemma3ForCausalLM(hf.Gemma3TextConfig(
            head_dim=16, sliding_window=5, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"], **c)),
        # LayerNorm with bias, partial rotary, per-head q/k LayerNorms, lm_head bias
        "phi": lambda: hf.PhiForCausalLM(hf.PhiConfig(partial_rotary_factor=0.5, qk_layernorm=True, **c)),
        "falcon_h1": lambda: hf.FalconH1ForCausalLM(hf.FalconH1Config(
            mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8, mamba_n_groups=1,
            mamba_chunk_size=8, **c)),
        "olmo2": lambda: hf.Olmo2ForCausalLM(hf.Olmo2Config(**c)),
        "gemma": lambda: hf.GemmaForCausalLM(hf.GemmaConfig(head_dim=16, **c)),  # scaled embedding, (1 + w) norms
        "smollm3": lambda: hf.SmolLM3ForCausalLM(hf.SmolLM3Config(no_rope_layers=[1, 0], pad_token_id=0, **c)),
        "helium": lambda: hf.HeliumForCausalLM(hf.HeliumConfig(head_dim=16, pad_token_id=0, **c)),
        "olmo3": lambda: hf.Olmo3ForCausalLM(hf.Olmo3Config(sliding_window=5, pad_token_id=0,
                                                            layer_types=["sliding_attention", "full_attention"], **c)),
        "ernie4_5": lambda: hf.Ernie4_5ForCausalLM(hf.Ernie4_5Config(head_dim=16, **c)),
        "exaone4": lambda: hf.Exaone4ForCausalLM(hf.Exaone4Config(
            sliding_window=5, layer_types=["sliding_attention", "full_attention"], **c)),
        "unregistered_llama": lambda: _unregistered_llama(hf),
        "arcee": lambda: hf.ArceeForCausalLM(hf.ArceeConfig(**c)),  # its own Hugging Face plan, up/down MLP
        "gemma2": lambda: hf.Gemma2ForCausalLM(hf.Gemma2Config(head_dim=16, sliding_window=5, attn_logit_softcapping=2.0,
                                                                **{**c, "attn_implementation": "eager"})),
        "phi3": lambda: hf.Phi3ForCausalLM(hf.Phi3Config(**{**c, "num_key_value_heads": 4}, pad_token_id=0)),
        "granite": lambda: hf.GraniteForCausalLM(hf.GraniteConfig(
            embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0, **c)),
        "cohere": lambda: hf.CohereForCausalLM(hf.CohereConfig(**c)),
        "starcoder2": lambda: hf.Starcoder2ForCausalLM(hf.Starcoder2Config(**c)),
        "gpt_neox": lambda: hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(
            **{k: v for k, v in c.items() if k != "num_key_value_heads"}, hidden_dropout=0.0)),
        "gpt2": lambda: hf.GPT2LMHeadModel(hf.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)),
        "stablelm": lambda: hf.StableLmForCausalLM(hf.StableLmConfig(**c)),
        "bamba": lambda: hf.BambaForCausalLM(hf.BambaConfig(
            attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, **_MAMBA, **c)),
        "zamba2": lambda: hf.Zamba2ForCausalLM(hf.Zamba2Config(
            layers_block_type=["linear_attention", "hybrid"], mamba_d_state=8, n_mamba_heads=8, mamba_ngroups=1,
            chunk_size=8, **c)),
        "nemotron_h": lambda: hf.NemotronHForCausalLM(hf.NemotronHConfig(
            **{k: v for k, v in c.items() if k != "num_hidden_layers"}, head_dim=16,
            layers_block_type=["linear_attention", "full_attention", "mlp"], mamba_num_heads=4, mamba_head_dim=16,
            ssm_state_size=8, n_groups=1, chunk_size=8)),
        "mixtral": lambda: hf.MixtralForCausalLM(hf.MixtralConfig(num_local_experts=4, **{**c, "intermediate_size": 32},
                                                                  num_experts_per_tok=2, experts_implementation="eager")),
        "qwen2_moe": lambda: hf.Qwen2MoeForCausalLM(hf.Qwen2MoeConfig(num_experts=4, shared_expert_intermediate_size=64,
                                                                     **_MOE, **c)),
        "qwen3_moe": lambda: hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(num_experts=4, head_dim=16, **_MOE, **c)),
        # multi-head latent attention (q/k head dim 8 + 8, v 12), a dense first layer, then grouped-router MoE
        "deepseek_v3": lambda: hf.DeepseekV3ForCausalLM(hf.DeepseekV3Config(
            **{**c, "num_key_value_heads": 4, "intermediate_size": 64}, kv_lora_rank=16, q_lora_rank=24,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, n_shared_experts=1, n_group=2,
            topk_group=1, first_k_dense_replace=1, **_MOE)),
        "deepseek_v3_no_q_lora": lambda: hf.DeepseekV3ForCausalLM(hf.DeepseekV3Config(
            **{**c, "num_key_value_heads": 4, "intermediate_size": 64}, kv_lora_rank=16, q_lora_rank=None,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, n_shared_experts=1, n_group=2,
            topk_group=1, first_k_dense_replace=1, **_MOE)),
        # DeepSeek-V2's MLA: complex rotary in float32 and a float32 softmax router (keep_float64 in build_model)
        "deepseek_v2": lambda: hf.DeepseekV2ForCausalLM(hf.DeepseekV2Config(
            **{**c, "num_key_value_heads": 4, "intermediate_size": 64}, kv_lora_rank=16, q_lora_rank=24,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, n_shared_experts=1,
            first_k_dense_replace=1, **_MOE)),
        # attention sinks (eager: no SDPA path), a sliding layer, biased experts with interleaved gate/up
        "gpt_oss": lambda: hf.GptOssForCausalLM(hf.GptOssConfig(
            num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"], experts_implementation="eager",
            **{**c, "attn_implementation": "eager", "intermediate_size": 32})),
        # the other sink models (eager): Granite-SWA; Granite-MoE-SWA with a shared MLP; MiMo-V2-Flash (v head dim
        # 12, twice the KV heads and sinks on its sliding layer, a MoE layer); Flint (q/k norms, a MoE layer)
        **{name: _sink_builder(hf, name) for name in SINK_MODELS},
    }


SINK_MODELS = ("granite_swa", "granitemoe_swa", "mimo_v2_flash", "flint")


def _sink_builder(hf, name: str):
    c = {**COMMON, "attn_implementation": "eager", "sliding_window": 6,
         "layer_types": ["sliding_attention", "full_attention"]}
    moe = dict(_MOE, num_local_experts=4)
    return {
        "granite_swa": lambda: hf.GraniteSWAForCausalLM(hf.GraniteSWAConfig(
            head_dim=16, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3, **c)),
        "granitemoe_swa": lambda: hf.GraniteMoeSWAForCausalLM(hf.GraniteMoeSWAConfig(
            head_dim=16, shared_intermediate_size=32, **{**c, **moe, "intermediate_size": 32})),
        "mimo_v2_flash": lambda: hf.MiMoV2FlashForCausalLM(hf.MiMoV2FlashConfig(
            head_dim=16, v_head_dim=12, n_routed_experts=4, **_MOE, **c)),
        "flint": lambda: hf.FlintForCausalLM(hf.FlintConfig(head_dim=16, num_experts=4, mlp_only_layers=[0],
                                                            **_MOE, **c)),
    }[name]


def exact_norm(module: nn.Module) -> None:
    """Run a Hugging Face RMSNorm (or Cohere's LayerNorm) in the input dtype (see module docstring)."""
    eps = getattr(module, "variance_epsilon", None) or module.eps
    name = type(module).__name__
    offset = 1.0 if name.startswith("Gemma") else 0.0  # Gemma scales by (1 + w)
    centered = name.endswith("LayerNorm")

    def forward(x):
        if centered:
            x = x - x.mean(-1, keepdim=True)
        return (offset + module.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    module.forward = forward


def _exact_mixtral_router(module: nn.Module) -> None:
    """Mixtral's top-k router with the softmax in the input dtype (see module docstring)."""

    def forward(hidden_states):
        logits = nn.functional.linear(hidden_states.reshape(-1, module.hidden_dim), module.weight)
        top_value, top_index = torch.topk(logits.softmax(dim=-1), module.top_k, dim=-1)
        return logits, top_value / top_value.sum(dim=-1, keepdim=True), top_index

    module.forward = forward


def _exact_deepseek_router(module: nn.Module) -> None:
    """DeepSeek-V3's grouped sigmoid router in the input dtype (transformers casts it to float32)."""

    def forward(hidden_states):
        logits = nn.functional.linear(hidden_states.reshape(-1, module.hidden_dim), module.weight)
        scores = logits.sigmoid()
        choice = (scores + module.e_score_correction_bias).view(-1, module.num_group, module.num_experts // module.num_group)
        groups = torch.topk(choice.topk(2, dim=-1)[0].sum(-1), k=module.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(choice[..., 0]).scatter_(1, groups, 1).bool()[..., None].expand_as(choice)
        index = torch.topk(choice.masked_fill(~mask, float("-inf")).flatten(1), k=module.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) if module.norm_topk_prob else weights
        return logits, weights * module.routed_scaling_factor, index

    module.forward = forward


def build_model(name: str) -> nn.Module:
    """A tiny float64 model; every parameter perturbed so no gradient is trivially zero."""
    import transformers as hf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _builders(hf)[name]().to(torch.float64)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm") or kind == "CohereLayerNorm":
            exact_norm(module)
        elif kind == "MixtralTopKRouter":
            _exact_mixtral_router(module)
        elif kind == "DeepseekV3TopkRouter":
            _exact_deepseek_router(module)
    if name in ("deepseek_v2", *SINK_MODELS):  # float32 routers (and Flint's float32 sinks)
        from hybridpar.models.hf.float64 import keep_float64

        keep_float64(model)
    return model


def placement_code(param) -> str:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(param, DTensor):
        return "plain"
    (placement,) = param.placements
    if isinstance(placement, Shard):
        return f"S{placement.dim}"
    if isinstance(placement, _StridedShard):
        return f"SS{placement.dim}/{placement.split_factor}"
    return "R" if isinstance(placement, Replicate) else repr(placement)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def gradient_errors(model, reference) -> dict[str, float]:
    """``{name: relative_error}`` of every parameter gradient of a parallelized ``model`` against the
    single-process ``reference``'s, under the reference's names (``canonical_state_dict``: DTensor
    gradients gathered, Mamba2 components fused back; a collective). Every name must be there."""
    from hybridpar.parallel.state import canonical_state_dict

    got, want = canonical_state_dict(model, grads=True), dict(reference.named_parameters())
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:6]
    return {name: relative_error(grad, want[name].grad) for name, grad in got.items()}


def model_inputs(variant: str = "dense") -> dict:
    """Dense ids, plus a left-padded attention mask or two packed documents' position ids."""
    torch.manual_seed(1)
    inputs = {"input_ids": torch.randint(0, VOCAB, (2, SEQ)), "use_cache": False}
    if variant == "padded":
        inputs["attention_mask"] = torch.ones(2, SEQ, dtype=torch.long)
        inputs["attention_mask"][1, :5] = 0
    elif variant == "packed":
        inputs["position_ids"] = torch.cat([torch.arange(6), torch.arange(SEQ - 6)])[None].expand(2, -1)
    return inputs


def parity(name: str, sequence_parallel: bool, tp_mesh, variant: str = "dense", plan=None) -> dict:
    """Reference vs ``apply_tp`` on one batch: logits and every gradient (see module docstring)."""

    from hybridpar.parallel.tensor.apply import apply_tp

    inputs = model_inputs(variant)
    weights = torch.randn(2, SEQ, VOCAB, dtype=torch.float64)

    reference = build_model(name)
    ref_logits = reference(**inputs).logits
    (ref_logits * weights).sum().backward()

    model = build_model(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_tp(model, tp_mesh, plan=plan, sequence_parallel=sequence_parallel)
    logits = model(**inputs).logits
    (logits * weights).sum().backward()

    grad_errors = gradient_errors(model, reference)
    return {
        "source": model._tp_plan_applied.source.split(":")[0],
        "logits_shape": tuple(logits.shape),
        "logits_error": relative_error(logits, ref_logits),
        "grad_errors": grad_errors,
        "same_names": sorted(dict(reference.named_parameters())) == sorted(dict(model.named_parameters())),
        "placements": {n: placement_code(p) for n, p in model.named_parameters()},
        "fraction": model._tp_shard_report.fraction,
        "warnings": [str(w.message) for w in caught],
        "model": model,
        "reference": reference,
    }
