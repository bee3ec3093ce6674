"""``hybridpar plan`` of Nemotron-3-Nano's and Granite 4.0-H's shapes: MoE blocks in a HybridLM twin.

A NemotronH's ``moe`` layers and every GraniteMoeHybrid layer's feed-forward half (router, routed
experts, shared MLP) are twin blocks of kind ``E`` (``plan/hf/moe.py``), a dense Granite's
``shared_mlp`` a gated MLP whose fused ``input_linear`` is gathered under TP. Their parameters equal
transformers' meta model's; one measured training step holds parameters and traffic exact and saved
activations within 10%, peak within 15%, at tp=2 + SP (NemotronH's MoE block sends no reduce-scatter
there and four more all-reduces; Granite's experts and ``shared_mlp`` leave the layer apart, and its
one Mamba group runs the spanning gated norm, which keeps what HybridLM's does). Before, both kept
the parameter-only plan. What stays unplanned (Zamba2, MoE latent projections, a router's auxiliary loss)
keeps the parameter-only plan and names its reason (Falcon-H1: ``test_plan_parallel_layers.py``).
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridpar.config import load_config
from hybridpar.plan import make_plan
from hybridpar.plan.planner import Plan, TransformersPlan
from tests.plan.step_check import assert_plan_matches_step

WIDTHS = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256)
GRANITE = dict(intermediate_size=96, shared_intermediate_size=160, num_experts_per_tok=2, mamba_n_heads=8,
               mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=64, num_hidden_layers=4,
               layer_types=["mamba", "attention", "mamba", "mamba"])
MODELS = {
    "nemotron_h_moe": ("NemotronH", dict(mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=16,
                                         chunk_size=64, layers_block_type=["mamba", "moe", "attention", "moe"],
                                         n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                                         moe_shared_expert_intermediate_size=160)),
    "granite": ("GraniteMoeHybrid", {**GRANITE, "num_local_experts": 4}),
    "granite_dense": ("GraniteMoeHybrid", {**GRANITE, "num_local_experts": 0}),
    "zamba2": ("Zamba2", dict(num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], mamba_d_state=16,
                              n_mamba_heads=8, mamba_ngroups=2, chunk_size=64)),
}


def _checkpoint(path, name: str, weights: bool = False, **fields) -> str:
    import transformers as hf

    prefix, widths = MODELS[name]
    config = getattr(hf, f"{prefix}Config")(**{**WIDTHS, **widths, **fields})
    model_class = getattr(hf, f"{prefix}ForCausalLM")
    if weights:
        torch.manual_seed(0)
        model_class(config).save_pretrained(path)
    else:  # config.json only: what the planner reads
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": [model_class.__name__]}))
    return str(path)


def _overrides(path: str, *more: str) -> list[str]:
    return [f"model.hf_path={path}", "model.backend=transformers", "data.pack_size=2048", "data.packs_per_step=1", *more]


@pytest.mark.parametrize("name, pattern", [("nemotron_h_moe", "ME*E"), ("granite", "ME*EMEME"),
                                           ("granite_dense", "M-*-M-M-")])
def test_moe_hybrids_are_planned_on_their_twin_with_transformers_parameters(tmp_path, name, pattern):
    import transformers as hf

    path = _checkpoint(tmp_path / name, name)
    plan = make_plan(load_config(None, _overrides(path, "parallel.tp=2")))
    model = hf.AutoModelForCausalLM.from_config(hf.AutoConfig.from_pretrained(path))
    assert isinstance(plan, Plan) and plan.layout.model.pattern == pattern
    assert plan.memory.params.total == sum(p.numel() for p in model.parameters())
    assert (plan.memory.saved_by_kind["moe"] > 0) == ("E" in pattern)
    assert plan.traffic_by_kind["all_reduce"] > 0 and plan.time.flops > 0


@pytest.mark.parametrize("name, fields, overrides, reason", [
    ("zamba2", {}, [], "modelled for HybridLM and llama, mistral, qwen2, qwen3, bamba, nemotron_h, granitemoehybrid, "
                       "falcon_h1"),
    ("nemotron_h_moe", {"moe_latent_size": 64}, [], "its MoE latent projections (moe_latent_size=64) are not planned"),
    ("granite", {"output_router_logits": True}, [], "router auxiliary loss (output_router_logits=true) is not planned"),
])
def test_what_stays_unplanned_keeps_its_parameter_share_and_names_why(tmp_path, name, fields, overrides, reason):
    plan = make_plan(load_config(None, _overrides(_checkpoint(tmp_path / name, name, **fields), *overrides)))
    assert isinstance(plan, TransformersPlan) and reason in plan.text()


@pytest.mark.parametrize("name", ["nemotron_h_moe", "granite"])
def test_the_plan_of_a_moe_hybrid_matches_one_measured_step_at_tp2_with_sp(tmp_path, name):
    overrides = _overrides(_checkpoint(tmp_path / name, name, weights=True), "parallel.tp=2",
                           "parallel.sequence_parallel=true")
    assert_plan_matches_step(overrides, str(tmp_path / "run"))


def test_the_plan_of_a_moe_hybrid_under_bf16_autocast_matches_one_measured_step(tmp_path):
    """Under autocast the norm outputs enter TP in float32; Granite's softmax routing weights and its MoE
    block's output are float32 (the block's exit pair moves float32); its experts run in float32 too
    (``grouped_mm`` has no autocast rule; the plan was 0.79 of the saved bytes without it)."""
    overrides = _overrides(_checkpoint(tmp_path / "granite", "granite", weights=True), "parallel.tp=2",
                           "parallel.sequence_parallel=true", "parallel.mixed_precision=bf16")
    assert_plan_matches_step(overrides, str(tmp_path / "run"))
