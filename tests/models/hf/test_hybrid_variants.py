"""Config variants of the transformers hybrids people fine-tune (round 14b, ``docs/reliability.md``).

Documents told by ``position_ids`` alone (a flattening collator's restarting ids, no ``packed_seq_params``):
hybridpar's attention kept them apart, the switched recurrent mixers ran the row as one document and
carried state from one into the next. Now every model with switched mixers takes its documents from
such ids (``models/hf/mixers/documents.py``): logits of the packed row equal each document alone
(float64, 1e-12), for Mamba2 hybrids, short convolutions, gated DeltaNets, Mamba1 and RG-LRU; rows of
different layouts, and several documents with a cache, are refused in one line.

Config variants real checkpoints use (B/C groups = heads or 1, conv width 2 and 6, no conv bias,
projection biases, chunk sizes that do not divide the documents, dt limits, tied embeddings,
Falcon-H1's μP multipliers, Granite's multipliers and RoPE, one KV head, NemotronH's MoE with router
groups and a latent MoE): hybridpar's mixers give transformers' own loss and every gradient (float64
throughout: ``keep_float64``, 1e-12) on one document, and a packed row gives each document's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybridpar.models.hf.float64 import keep_float64
from hybridpar.parallel.context.hf import use_hybridpar_attention
from hybridpar.train.hf_model import install_cores
from hybridpar.train.loss import token_loss_sum
from tests.models.hf.packed_rows import assert_same, boundaries, loss_and_grads, packed_vs_alone, random_rows, relative
from tests.models.hf.tiny import perturbed_float64

VOCAB = 97
DOCS = (10, 14)
_C = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
          use_cache=False)
_M = dict(mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=8)
_GRANITE = dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=16,
                mamba_expand=1, shared_intermediate_size=64, num_local_experts=0, position_embedding_type="nope", **_M, **_C)
_FALCON = dict(num_hidden_layers=2, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_rms_norm=True, **_M, **_C)
_MUP = dict(ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], ssm_in_multiplier=0.7, key_multiplier=0.5, attention_in_multiplier=0.6,
            attention_out_multiplier=1.4, lm_head_multiplier=0.3, embedding_multiplier=2.5, mlp_multipliers=[0.8, 1.7],
            ssm_out_multiplier=0.45)
_NEMOTRON = dict(head_dim=16, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=8,
                 layers_block_type=["mamba", "attention", "moe"], n_routed_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1, **_C)
_BAMBA = dict(num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, **_M, **_C)
_ZAMBA2 = dict(num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=8,
               n_mamba_heads=8, mamba_ngroups=2, chunk_size=8, num_mem_blocks=2, use_shared_attention_adapter=True,
               adapter_rank=8, use_mem_rope=True, **{**_C, "num_key_value_heads": 4})

VARIANTS = {  # name: (config class, model class, config fields)
    "granite_groups_eq_heads_conv2_chunk5": ("GraniteMoeHybrid", dict(
        _GRANITE, mamba_n_groups=4, mamba_d_conv=2, mamba_chunk_size=5, mamba_proj_bias=True)),
    "granite_rope_multipliers_tied_kv1": ("GraniteMoeHybrid", dict(
        _GRANITE, position_embedding_type="rope", attention_multiplier=0.1, residual_multiplier=0.3, logits_scaling=2.5,
        embedding_multiplier=3.0, tie_word_embeddings=True, num_key_value_heads=1, time_step_limit=(0.05, 0.5))),
    "falcon_h1_mup_one_group_gate_after_biases": ("FalconH1", dict(
        _FALCON, **_MUP, mamba_n_groups=1, mamba_norm_before_gate=False, projectors_bias=True, mamba_proj_bias=True,
        mamba_conv_bias=False, head_dim=24)),
    "falcon_h1_plain_gate_tied_conv6": ("FalconH1", dict(
        _FALCON, **_MUP, mamba_rms_norm=False, tie_word_embeddings=True, mamba_d_conv=6, mamba_chunk_size=3)),
    "nemotron_h_router_groups_latent_bias": ("NemotronH", dict(
        _NEMOTRON, n_group=2, topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.5, moe_latent_size=16,
        use_bias=True, conv_kernel=2, time_step_min=0.3, num_key_value_heads=1)),
    "bamba_one_group_no_conv_bias_full_rope": ("Bamba", dict(
        _BAMBA, mamba_n_groups=1, mamba_conv_bias=False, mamba_proj_bias=True, attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=500.0, partial_rotary_factor=1.0))),
    "zamba2_two_blocks_groups_eq_heads_bias": ("Zamba2", dict(
        _ZAMBA2, mamba_ngroups=8, add_bias_linear=True, mamba_d_conv=3, time_step_min=0.3)),
}


def _build(name: str):
    import transformers as hf

    kind, fields = VARIANTS[name]
    config_class, model_class = getattr(hf, f"{kind}Config"), getattr(hf, f"{kind}ForCausalLM")
    return perturbed_float64(lambda: model_class(config_class(**fields))).train()


def _switched(reference):
    model = copy.deepcopy(reference)
    install_cores(model)
    use_hybridpar_attention(model)
    return model


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_equals_transformers_and_packed_rows_equal_their_documents(name):
    reference = keep_float64(_build(name))
    reference.config._attn_implementation = "eager"
    model = _switched(reference)
    ids, labels = random_rows(DOCS, VOCAB)
    assert_same(*packed_vs_alone(model, model, ids, labels, boundaries(DOCS)), model, 1e-12)
    one, targets = ids[:, DOCS[0]:], labels[:, DOCS[0]:]
    got = loss_and_grads(model, [(one, targets, [0, DOCS[1]])])
    reference.zero_grad()
    loss = token_loss_sum(reference(input_ids=one).logits, targets)
    loss.backward()
    want = loss.detach(), {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert_same(got, want, model, 1e-12)


def _position_ids_only_error(model, docs) -> float:
    """How far logits of a row packed by restarting ``position_ids`` alone are from each document alone."""
    ids = torch.randint(0, model.config.vocab_size, (1, sum(docs)), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(d) for d in docs])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        cu = boundaries(docs)
        alone = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(cu[:-1], cu[1:])], 1)
    return relative(packed, alone)


def _other_mixers() -> dict:
    from tests.models.hf.gdn_models import build_gdn
    from tests.models.hf.lfm_models import build_lfm
    from tests.models.hf.mamba1_models import build_mamba1
    from tests.models.hf.rglru_models import build_recurrent_gemma

    return {"lfm2": lambda: build_lfm("lfm2"), "qwen3_next": lambda: build_gdn("qwen3_next"),
            "falcon_mamba": lambda: build_mamba1("falcon_mamba"), "recurrent_gemma": build_recurrent_gemma}


@pytest.mark.parametrize("name", ["granite_rope_multipliers_tied_kv1", "falcon_h1_plain_gate_tied_conv6",
                                  "nemotron_h_router_groups_latent_bias", "bamba_one_group_no_conv_bias_full_rope",
                                  "zamba2_two_blocks_groups_eq_heads_bias", "lfm2", "qwen3_next", "falcon_mamba",
                                  "recurrent_gemma"])
def test_documents_told_by_position_ids_alone_do_not_leak(name):
    """Before: 0.2-0.6 apart (the state of the first document reached the second); now each document's own."""
    model = _other_mixers()[name]() if name in _other_mixers() else _build(name)
    model = _switched(model).eval()
    assert _position_ids_only_error(model, (10, 14)) < 1e-12


def test_position_ids_that_restart_differently_per_row_or_with_a_cache_are_refused():
    model = _switched(_build("bamba_one_group_no_conv_bias_full_rope")).eval()
    ids = torch.zeros(2, 12, dtype=torch.long)
    rows = torch.stack([torch.cat([torch.arange(5), torch.arange(7)]), torch.cat([torch.arange(6), torch.arange(6)])])
    with pytest.raises(ValueError, match="restart at different tokens in different rows"):
        model(input_ids=ids, position_ids=rows)
    with pytest.raises(ValueError, match="several documents together with a cache"):
        model(input_ids=ids, position_ids=rows[:1].expand(2, -1), use_cache=True)
    model(input_ids=ids, position_ids=torch.arange(12)[None].expand(2, -1), use_cache=True)  # one document: fine


def test_bambas_z_loss_is_refused_where_hybridpars_loss_would_drop_it():
    """transformers' Bamba adds ``z_loss_coefficient * mean(logsumexp(logits)^2)`` to its loss; hybridpar's loss
    (HybridLM's and the transformers backend's) is the cross entropy alone, so both refuse it in one line
    (before: trained without it, without a word)."""
    from hybridpar.models.hf.config import config_from_hf
    from hybridpar.models.hf.logit_transform import probe_logits_after_head

    fields = dict(architectures=["BambaForCausalLM"], model_type="bamba", vocab_size=VOCAB, hidden_size=64,
                  num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64)
    config_from_hf({**fields, "z_loss_coefficient": 0.0})
    with pytest.raises(ValueError, match=r"z_loss_coefficient=0.1 cannot be represented by HybridLM: .*set it to 0.0"):
        config_from_hf({**fields, "z_loss_coefficient": 0.1})
    model = _build("bamba_one_group_no_conv_bias_full_rope")
    assert probe_logits_after_head(model) is None
    model.config.z_loss_coefficient = 0.1
    with pytest.raises(ValueError, match=r'sets z_loss_coefficient=0.1: .*a z-loss.*"z_loss_coefficient": 0.0'):
        probe_logits_after_head(model)
