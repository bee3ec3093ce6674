"""Every transformers model type hybridpar's attention takes (``ATTENTION_MODEL_TYPES``) is
proven here, one tiny float64 model per type: a packed row of three documents through
hybridpar's attention, entered as context parallelism enters it (``apply_hf_cp`` with a CP core
on a group of one; documents from ``packed_seq_params``), gives the loss and every parameter
gradient of the same model with transformers' SDPA (eager where scores are soft-capped) run on
each document alone (1e-12), and every module that calls the attention holds the core (at cp > 1
one without it would attend to its rank's tokens only). Sliding windows (5 tokens) are shorter
than the documents, so the window rule is exercised; MLA configs have v's head dim (12) other
than q/k's (16; MiniCPM3 24 against 16). As the trainer runs a float64 model: transformers'
float32 casts (norms, routers) kept in float64 (``keep_float64``), MoE experts eager (grouped_mm
has no float64). One thread: the tensors are tiny.

A type joins the list only with a builder here, and docs/hf-models.md's table lists exactly the
list; a model type that is not on it trains one document per row
(``tests/train/test_packing_safety.py``) and is refused context parallelism.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch

from tests.distributed.tensor.hf_models import relative_error

TOL = 1e-12
VOCAB = 128
DOCS = [0, 12, 17, 40]  # a 5-token document between two longer than the window
_C = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
          num_hidden_layers=2, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_WINDOWED = dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"])
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# multi-head latent attention: q/k head dim 8 + 8 (no RoPE + RoPE), v head dim 12; one key and value per query head
_MLA = dict(_C, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=12)
_GPT2 = dict(n_embd=64, n_layer=2, n_head=4, n_inner=64, vocab_size=VOCAB, use_cache=False, resid_pdrop=0.0,
             embd_pdrop=0.0, attn_pdrop=0.0)  # GPT-2's names; absolute position embeddings read position_ids
_NO_KV = {k: v for k, v in _C.items() if k != "num_key_value_heads"}  # configs without grouped-query attention
# a chunked RoPE layer and a NoPE layer with temperature tuning, exact for documents up to the chunk (24) and
# rows shorter than floor_scale (41): the 23-token document and the 40-token row just fit
_LLAMA4 = dict(_C, head_dim=16, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
               no_rope_layers=[1, 0], attention_chunk_size=24, floor_scale=41)
_DEEPSEEK = dict(n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, **_MOE)


# reference attention eager: transformers' SDPA path has no soft cap, and these models no SDPA path with sinks
_EAGER = ("gemma2", "vaultgemma", "gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "flint")


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
        "qwen2_moe": lambda: hf.Qwen2MoeConfig(num_experts=4, shared_expert_intermediate_size=32, use_sliding_window=True,
                                                sliding_window=5, max_window_layers=1, **_MOE, **_C),
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
        "glm4_moe": lambda: hf.Glm4MoeConfig(n_routed_experts=4, n_group=2, topk_group=1, use_qk_norm=True, **_MOE, **_C),
        "deepseek_v3": lambda: hf.DeepseekV3Config(**_DEEPSEEK, **_MLA),
        "deepseek_v2": lambda: hf.DeepseekV2Config(**_DEEPSEEK, **_MLA),
        "glm4_moe_lite": lambda: hf.Glm4MoeLiteConfig(**_DEEPSEEK, **_MLA),
        "minicpm3": lambda: hf.MiniCPM3Config(**{**_MLA, "q_lora_rank": None, "v_head_dim": 24}),  # v wider than q/k
        "youtu": lambda: hf.YoutuConfig(**_MLA),
        "sarvam_mla": lambda: hf.SarvamMLAConfig(**_DEEPSEEK, **_MLA),
        "axk1": lambda: hf.AXK1Config(**_DEEPSEEK, **_MLA),
        "longcat_flash": lambda: hf.LongcatFlashConfig(  # two MLA modules per layer, zero-computation experts
            hidden_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB, ffn_hidden_size=64,
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8, v_head_dim=12, moe_topk=2,
            n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=32, use_cache=False, pad_token_id=0),
        # Llama-like layouts
        "exaone": lambda: hf.ExaoneConfig(head_dim=16, **_C),
        "internlm3": lambda: hf.InternLM3Config(head_dim=16, **_C),
        "iquestcoder": lambda: hf.IQuestCoderConfig(head_dim=16, **_C),
        "hyperclovax": lambda: hf.HyperCLOVAXConfig(head_dim=16, **_C),
        "jais2": lambda: hf.Jais2Config(head_dim=16, **_C),
        "seed_oss": lambda: hf.SeedOssConfig(head_dim=16, attention_dropout=0.0, residual_dropout=0.0, **_C),
        "bitnet": lambda: hf.BitNetConfig(**_C),
        "nanochat": lambda: hf.NanoChatConfig(**_C),
        "nemotron": lambda: hf.NemotronConfig(head_dim=16, **_C),
        "apertus1p5_text": lambda: hf.Apertus1p5TextConfig(**_C),
        "hy_v3": lambda: hf.HYV3Config(head_dim=16, num_experts=4, num_shared_experts=1, **_MOE, **_C),
        "llama4_text": lambda: hf.Llama4TextConfig(**_LLAMA4),
        "diffllama": lambda: hf.DiffLlamaConfig(head_dim=16, **_C),  # differential attention: two calls' difference
        "dory": lambda: hf.DoryConfig(head_dim=16, **_WINDOWED, **_C),  # unit-norm q/k, per-channel q scale
        "cwm": lambda: hf.CwmConfig(head_dim=16, sliding_window=5, **_C),
        "ministral": lambda: hf.MinistralConfig(head_dim=16, **_WINDOWED, **_C),
        "ministral3": lambda: hf.Ministral3Config(head_dim=16, **_C),
        "gemma4_text": lambda: hf.Gemma4TextConfig(  # per-layer inputs, k = v on full layers, a layer reusing K/V, MoE
            head_dim=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, per_layer_config={},
            attention_k_eq_v=True, num_kv_shared_layers=1, enable_moe_block=True, num_experts=4, top_k_experts=2,
            moe_intermediate_size=32, sliding_window=5, layer_types=["sliding_attention", "full_attention"] * 2,
            **{**_C, "num_hidden_layers": 4}),
        "gemma3n_text": lambda: hf.Gemma3nTextConfig(  # per-layer inputs, AltUp, LAuReL, sparse activations, shared K/V
            head_dim=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2,
            laurel_rank=8, altup_num_inputs=2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], sliding_window=5,
            layer_types=["sliding_attention", "full_attention"] * 2,
            **{**_C, "num_hidden_layers": 4, "intermediate_size": [64] * 4}),
        "vaultgemma": lambda: hf.VaultGemmaConfig(head_dim=16, sliding_window=5, attn_logit_softcapping=2.0,
                                                  query_pre_attn_scalar=24, **_C),
        "gemma4_unified_text": lambda: hf.Gemma4UnifiedTextConfig(head_dim=16, sliding_window=5, **_C),
        "cohere_compass_text": lambda: hf.CohereCompassTextConfig(head_dim=16, rope_parameters=dict.fromkeys(  # M-RoPE
            ("full_attention", "sliding_attention"), {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}),
            **_WINDOWED, **_C),
        "modernbert-decoder": lambda: hf.ModernBertDecoderConfig(sliding_window=5, **_NO_KV),
        "persimmon": lambda: hf.PersimmonConfig(**_NO_KV),
        "hrm_text": lambda: hf.HrmTextConfig(head_dim=16, **_NO_KV),  # hierarchical modules, each a causal stack
        # attention sinks (one logit per head in the softmax), windowed layers, biased experts with a clamped SwiGLU
        "gpt_oss": lambda: hf.GptOssConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=2, **_WINDOWED, **_C),
        "granite_swa": lambda: hf.GraniteSWAConfig(head_dim=16, **_WINDOWED, **_C),
        "granitemoe_swa": lambda: hf.GraniteMoeSWAConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                                         **_WINDOWED, **_C),
        "mimo_v2_flash": lambda: hf.MiMoV2FlashConfig(head_dim=16, v_head_dim=12, n_routed_experts=4,  # and v's own head dim
                                                      **_MOE, **_WINDOWED, **_C),
        "flint": lambda: hf.FlintConfig(head_dim=16, num_experts=4, **_MOE, **_WINDOWED, **_C),
        "moshi": lambda: hf.MoshiConfig(head_dim=16, sliding_window=5, ffn_dim=64,  # a window its mask never applies
                                        **{k: v for k, v in _C.items() if k != "intermediate_size"}),
        # GPT-2 and GPT-J lineages: fused or separate projections, partial rotary (rotary_dim), multi-query
        "gpt2": lambda: hf.GPT2Config(**_GPT2),
        "gpt_bigcode": lambda: hf.GPTBigCodeConfig(**_GPT2),
        "gptj": lambda: hf.GPTJConfig(rotary_dim=8, **_GPT2),
        "codegen": lambda: hf.CodeGenConfig(rotary_dim=8, **_GPT2),
        "gpt_neox": lambda: hf.GPTNeoXConfig(**_NO_KV),
        "ctrl": lambda: hf.CTRLConfig(n_embd=64, n_layer=2, n_head=4, dff=64, vocab_size=VOCAB, use_cache=False,
                                      resid_pdrop=0.0, embd_pdrop=0.0),  # sinusoidal positions from position_ids
        # MoE
        "olmoe": lambda: hf.OlmoeConfig(num_experts=4, **_MOE, **_C),
        "flex_olmo": lambda: hf.FlexOlmoConfig(num_experts=4, **_MOE, **_C),
        "jetmoe": lambda: hf.JetMoeConfig(num_local_experts=4, **_MOE, **_C),
        "granitemoeshared": lambda: hf.GraniteMoeSharedConfig(num_local_experts=4, **_MOE, **_C),
        "minimax_m2": lambda: hf.MiniMaxM2Config(head_dim=16, num_local_experts=4, **_MOE, **_C),
        "minimax_m3_vl_text": lambda: hf.MiniMaxM3VLTextConfig(head_dim=16, num_local_experts=4, rotary_dim=8, **_MOE,
                                                                **_C),
        "hunyuan_v1_moe": lambda: hf.HunYuanMoEV1Config(head_dim=16, num_experts=4, moe_topk=2, **_C),
        "aria_text": lambda: hf.AriaTextConfig(head_dim=16, moe_num_experts=4, moe_topk=2, **_C),
        "ernie4_5_moe": lambda: hf.Ernie4_5_MoeConfig(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, **_C),
        "dots1": lambda: hf.Dots1Config(**_WINDOWED, **_DEEPSEEK, **_C),
        "sarvam_moe": lambda: hf.SarvamMoEConfig(head_dim=16, **_DEEPSEEK, **_C),
        "solar_open": lambda: hf.SolarOpenConfig(head_dim=16, **{**_DEEPSEEK, **_C, "intermediate_size": 64}),
        "exaone_moe": lambda: hf.ExaoneMoeConfig(num_experts=4, num_shared_experts=1, first_k_dense_replace=1,
                                                 **_WINDOWED, **_MOE, **_C),
        "afmoe": lambda: hf.AfmoeConfig(head_dim=16, num_experts=4, num_shared_experts=1, **_WINDOWED, **_MOE, **_C),
        "beam": lambda: hf.BeamConfig(head_dim=16, num_experts=4, sliding_window=5, **_MOE, **_C),
        "cohere2_moe": lambda: hf.Cohere2MoeConfig(head_dim=16, num_experts=4, num_shared_experts=1, **_WINDOWED,
                                                   **{k: v for k, v in _MOE.items() if k != "moe_intermediate_size"},
                                                   **_C),
        "kolibri1": lambda: hf.Kolibri1Config(head_dim=16, num_local_experts=4, **_WINDOWED,
                                              shared_expert_intermediate_size=32, **_MOE, **_C),
        "laguna": lambda: hf.LagunaConfig(head_dim=16, num_experts=4, **_WINDOWED, shared_expert_intermediate_size=32,
                                          **_MOE, **_C),
        "dbrx": lambda: hf.DbrxConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=VOCAB, use_cache=False,
                                      attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                      ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
        "mellum": lambda: hf.MellumConfig(head_dim=16, num_local_experts=4, **_WINDOWED, **_MOE, **_C),
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
    doc = (Path(__file__).parents[3] / "docs" / "hf-models.md").read_text()
    table = doc.split("## Context parallelism for Hugging Face models")[1].split("Not taken")[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    assert sorted(re.findall(r"`([^`]+)`", "".join(rows))) == sorted(ATTENTION_MODEL_TYPES)  # the docs' table


def _proof_error(hf, name: str, make, ids, labels) -> float:
    """Largest relative error of the packed row's loss and gradients against each document alone."""
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context import hf as context_hf
    from hybridpar.parallel.context.attention import AllGatherAttention
    from hybridpar.parallel.context.inputs import shard_inputs

    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    own = "eager" if name in _EAGER else "sdpa"
    ours, reference, core = _model(hf, make, own), _model(hf, make, own), AllGatherAttention(None)
    assert context_hf.attention_problem(ours) is None, (name, context_hf.attention_problem(ours))
    context_hf.apply_hf_cp(ours, core)  # the context-parallel entry, on a group of one
    callers = []
    hf.AttentionInterface.register(context_hf.ATTENTION_NAME, lambda module, *args, **kwargs: callers.append(
        module) or context_hf.hf_attention(module, *args, **kwargs))
    try:
        loss = _loss_sum(ours(**context_hf.hf_cp_inputs(shard_inputs(input_ids=ids, packed=packed))).logits, labels)
    finally:
        context_hf.register_hf_attention()
    # at cp > 1 a caller without the core would attend to its rank's tokens only
    assert callers and all(getattr(m, context_hf.CORE_ATTRIBUTE, None) is core for m in callers), name
    loss.backward()
    want = sum(_loss_sum(reference(input_ids=ids[:, a:b], position_ids=torch.arange(b - a)[None]).logits,
                         labels[:, a:b]) for a, b in zip(DOCS[:-1], DOCS[1:]))
    want.backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    missing = [n for n, p in ours.named_parameters() if (p.grad is None) != (grads[n] is None)]
    assert not missing, (name, missing)  # unrouted experts and selection-only router biases get none in both
    return max([relative_error(loss, want)] + [relative_error(p.grad, grads[n]) for n, p in ours.named_parameters()
                                               if p.grad is not None])


def test_every_listed_type_on_packed_rows_equals_sdpa_on_each_document_alone():
    import transformers as hf

    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (1, DOCS[-1]), generator=gen) for _ in range(2))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only contend on a busy machine
    try:
        errors = {name: _proof_error(hf, name, make, ids, labels) for name, make in _configs(hf).items()}
    finally:
        torch.set_num_threads(threads)
    assert max(errors.values()) < TOL, " ".join(f"{k}={v:.1e}" for k, v in errors.items())


def test_llama4_past_its_chunk_or_temperature_floor_is_refused_naming_the_pack_size():
    import pytest
    import transformers as hf

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.hf import use_hybridpar_attention

    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    ids = torch.zeros(1, DOCS[-1], dtype=torch.long)
    for change, fragment in (({"attention_chunk_size": 16}, "layer 0.*23-token document.*pack_size <= 16"),
                             ({"floor_scale": 40}, "layer 1.*rows of at most 39.*rows of 40")):
        model = use_hybridpar_attention(hf.AutoModelForCausalLM.from_config(hf.Llama4TextConfig(**{**_LLAMA4, **change})))
        with pytest.raises(ValueError, match=fragment):
            model(input_ids=ids, position_ids=packed.position_ids, packed_seq_params=packed)


def test_llama4_reads_the_longest_document_once_per_batch_not_once_per_layer():
    import pytest
    import transformers as hf

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.hf import use_hybridpar_attention

    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    ids = torch.zeros(1, DOCS[-1], dtype=torch.long)
    model = use_hybridpar_attention(hf.AutoModelForCausalLM.from_config(
        hf.Llama4TextConfig(**{**_LLAMA4, "attention_chunk_size": 64})))
    model(input_ids=ids, position_ids=packed.position_ids, packed_seq_params=packed)
    assert packed.cache["hf.longest_document"] == max(b - a for a, b in zip(DOCS, DOCS[1:]))
    packed.cache["hf.longest_document"] = 65  # every layer reads the batch's one cached value
    with pytest.raises(ValueError, match="65-token document"):
        model(input_ids=ids, position_ids=packed.position_ids, packed_seq_params=packed)
