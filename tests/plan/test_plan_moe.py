"""``hybridpar plan`` of Nemotron-3-Nano's and Granite 4.0-H's shapes: MoE blocks in a HybridLM twin.

A NemotronH's ``moe`` layers and every GraniteMoeHybrid layer's feed-forward half (router, routed
experts, shared MLP) are twin blocks of kind ``E`` (``plan/hf/moe.py``), a dense Granite's
``shared_mlp`` a gated MLP whose fused ``input_linear`` is gathered under TP. Their parameters equal
transformers' meta model's; one measured training step holds parameters and traffic exact and saved
activations within 10%, peak within 15%, at tp=2 + SP (NemotronH's MoE block sends no reduce-scatter
there and four more all-reduces; Granite's experts and ``shared_mlp`` leave the layer apart, and its
one Mamba group runs the spanning gated norm, which keeps what HybridLM's does). Before, both kept
the parameter-only plan. NemotronH's MoE latent projections and the router's load-balancing loss
(``output_router_logits``) are priced too (before: the parameter-only plan): the latent width in the
experts' rows, fc2's input and the experts' TP all-reduces; every MoE block's float32 softmax
``[Tc, E]`` and the term's CP sums. What stays unplanned (a Zamba2 with untied blocks or under
LoRA; the rest of Zamba2: ``test_zamba2_plan.py``) keeps the parameter-only plan and names its
reason (Falcon-H1: ``test_plan_parallel_layers.py``).
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridpar.config import load_config
from hybridpar.plan import make_plan
from hybridpar.plan.hf.moe import router_logits_bytes
from hybridpar.plan.planner import Plan, TransformersPlan
from hybridpar.plan.validate import measure_step, predict
from tests.distributed.harness import run_ranks
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
    ("zamba2", {"tie_word_embeddings": False}, [], "blocks are not shared"),
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


EXPERTS = 16
AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.01, "num_local_experts": EXPERTS}


def _saved(plan) -> int:
    return plan.memory.saved_bytes


@pytest.mark.parametrize("more", [[], ["parallel.cp=2"], ["parallel.activation_checkpointing=full"],
                                  ["parallel.tp=2", "parallel.sequence_parallel=true"]])
def test_the_router_load_balancing_term_keeps_a_float32_softmax_per_moe_block(tmp_path, more):
    """transformers' ``load_balancing_loss_func`` keeps ``softmax(logits) [Tc, E]`` float32 per MoE layer for
    backward, outside every checkpoint; the trainer adds the term (``router_aux_loss_coef``), so the plan grows
    by ``n_E Tc E 4`` (4 MoE blocks, 16 experts); with the coefficient 0 the term is not trained on."""
    plans = {name: make_plan(load_config(None, _overrides(_checkpoint(tmp_path / name, "granite", **fields), *more)))
             for name, fields in (("off", {"num_local_experts": EXPERTS}), ("on", AUX),
                                  ("untrained", {**AUX, "router_aux_loss_coef": 0.0}))}
    assert all(isinstance(p, Plan) for p in plans.values())
    tokens = 2048 // (2 if "parallel.cp=2" in more else 1)
    assert _saved(plans["on"]) - _saved(plans["off"]) == 4 * tokens * EXPERTS * 4
    assert plans["on"].memory.saved_by_kind["moe"] - plans["off"].memory.saved_by_kind["moe"] == 4 * tokens * EXPERTS * 4
    assert _saved(plans["untrained"]) == _saved(plans["off"])
    assert router_logits_bytes(plans["untrained"].layout) == tokens * EXPERTS * 4  # held in the forward only
    cp_sums = {k: v for k, v in plans["on"].traffic["router_aux"].items()}
    assert bool(cp_sums) == ("parallel.cp=2" in more)  # counts [E] and rows summed over CP, the term over dp x cp


def test_nemotron_h_router_logits_are_held_in_the_forward_only(tmp_path):
    """NemotronH's forward records its routers' logits with ``output_router_logits`` but computes no
    auxiliary loss: nothing more is kept for backward, the forward holds ``Tc E 4`` per MoE block."""
    off, on = (make_plan(load_config(None, _overrides(_checkpoint(tmp_path / str(flag), "nemotron_h_moe",
                                                                  output_router_logits=flag)))) for flag in (False, True))
    assert _saved(on) == _saved(off) and router_logits_bytes(on.layout) == 2048 * 4 * 4
    assert router_logits_bytes(off.layout) == 0 and not on.traffic["router_aux"]


@pytest.mark.parametrize("more", [[], ["parallel.tp=2"]])
def test_latent_projections_price_the_experts_at_the_latent_width(tmp_path, more):
    """``moe_latent_size = L`` (fc1 ``[L, D]``, fc2 ``[D, L]``, replicated over TP): parameters equal the
    model's; each MoE block keeps per routed row ``2 (D - L)`` elements fewer and fc2's input ``[Tc, L]``."""
    import transformers as hf

    tp = 2 if more else 1
    plans = {}
    for latent in (None, 64):
        path = _checkpoint(tmp_path / str(latent), "nemotron_h_moe", moe_latent_size=latent)
        plans[latent] = make_plan(load_config(None, _overrides(path, *more)))
    model = hf.AutoModelForCausalLM.from_config(hf.AutoConfig.from_pretrained(path))
    assert isinstance(plans[64], Plan) and plans[64].memory.params.total == sum(p.numel() for p in model.parameters())
    rows, tokens = 2048 * 2, 2048
    expected = 2 * (-rows * 2 * (128 - 64) * 4 + tokens * 64 * 4)  # two MoE blocks
    assert plans[64].memory.saved_by_kind["moe"] - plans[None].memory.saved_by_kind["moe"] == expected
    # multiply-adds per token and block: the experts (k = 2 of intermediate 96, ungated) at width L, fc1 and fc2
    # whole on every TP rank; x 2 FLOPs, x 3 passes (forward, dX, dW), 2 blocks
    macs = 2 * 96 * (64 - 128) * 2 // tp + 2 * 128 * 64
    assert plans[64].time.flops - plans[None].time.flops == pytest.approx(tokens * 2 * macs * 3 * 2)
    if tp > 1:  # the experts' output and its input's gradient [Tc, L] all-reduced per block
        ar = plans[64].traffic_by_kind["all_reduce"] - plans[None].traffic_by_kind["all_reduce"]
        assert ar == 2 * 2 * tokens * 64 * 4 * (tp - 1) // tp * 2


def test_lora_on_the_experts_of_a_latent_block_is_planned_at_the_latent_width(tmp_path):
    """Adapters on the stacked experts (``peft.target_parameters``) read and write ``L``: their factors
    ``A [r E, L]`` and ``B [L, r E]`` equal the model's (before: counted at ``D``, the parameter-only plan)."""
    path = _checkpoint(tmp_path / "latent", "nemotron_h_moe", moe_latent_size=64)
    plan = make_plan(load_config(None, _overrides(path, "peft.method=lora", "peft.r=8", "parallel.tp=2",
                                                  "peft.target_parameters=[experts.up_proj,experts.down_proj]")))
    assert isinstance(plan, Plan), plan.text()


def test_the_router_term_adds_to_a_measured_step_what_the_plan_adds(tmp_path):
    """One process, the same weights with and without the term: the measured saved bytes grow by the plan's
    growth (the softmax per MoE block; within 3% of it), and each plan stays within the usual tolerance."""
    grown = {}
    for name, flag in (("on", True), ("off", False)):
        path = _checkpoint(tmp_path / name, "granite", weights=True, **{**AUX, "output_router_logits": flag})
        overrides = _overrides(path)
        got = run_ranks(1, measure_step, overrides, str(tmp_path / f"run-{name}"), timeout_s=600)[0]
        plan = predict(overrides)
        assert plan["traffic_bytes_per_step_by_dim"] == got["traffic_by_dim"]
        assert abs(plan["peak_memory_gib_per_rank"] / got["tensor_peak_gib"] - 1) <= 0.15
        grown[name] = (plan["saved_activation_bytes_per_pack"]["total"], got["saved_bytes"])
    (plan_on, got_on), (plan_off, got_off) = grown["on"], grown["off"]
    assert plan_on - plan_off == 4 * 2048 * EXPERTS * 4
    assert abs((got_on - got_off) / (plan_on - plan_off) - 1) <= 0.03, (got_on - got_off, plan_on - plan_off)


LATENT = {"moe_latent_size": 64}
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
BF16 = "parallel.mixed_precision=bf16"


@pytest.mark.parametrize("name, fields, more, world", [
    ("granite", AUX, ["parallel.cp=2"], 2),  # the term's CP sums, its softmax replaced by the trainer's
    ("nemotron_h_moe", LATENT, SP, 2),  # the experts' [Tc, L] all-reduces, all-reduces for the pair's reduce-scatters
    ("nemotron_h_moe", LATENT, [*SP, BF16], 2),  # autocast: the block leaves through fc2 in bf16
    # FSDP's bf16 with TP: a MoE block leaves in its input's bf16, NemotronH's routing weights are float32
    ("nemotron_h_moe", LATENT, [*SP, "parallel.cp=2", BF16, "data.pack_size=4096"], 4),
])
def test_the_plan_of_the_router_term_and_latent_projections_matches_one_measured_step(tmp_path, name, fields, more,
                                                                                      world):
    overrides = _overrides(_checkpoint(tmp_path / name, name, weights=True, **fields), *more)
    assert_plan_matches_step(overrides, str(tmp_path / "run"), world)


def test_a_lora_plan_under_fsdp_bf16_sums_the_replicated_factors_tp_gradients_in_bf16(tmp_path):
    """Under FSDP's bf16 a LoRA factor computes in bf16, so the TP sum of a replicated factor's gradient (``A`` of a
    column-parallel base, ``B`` of a row-parallel one) runs in bf16: the plan counted float32, 20,480 bytes a step
    over the measured all-reduces here. Parameters and every collective exact; the saved activations of this LoRA
    case are not held (the plan says 24% more than the hooks count: docs/reliability.md, session 32)."""
    overrides = _overrides(_checkpoint(tmp_path / "n", "nemotron_h_moe", weights=True, **LATENT), *SP, "parallel.cp=2",
                           BF16, "data.pack_size=4096", "peft.method=lora")
    got = run_ranks(4, measure_step, overrides, str(tmp_path / "run"), timeout_s=600)[0]
    plan = predict(overrides)
    assert plan["parameters_per_rank"] == got["parameters_per_rank"]
    assert plan["traffic_bytes_per_step_by_dim"] == got["traffic_by_dim"]
