"""``hybridpar plan`` of Falcon-H1: Mamba2 and attention side by side in each layer.

A Falcon-H1 layer's input norm feeds both its Mamba2 mixer and its attention (each through its own
multiplied copy), their outputs are summed, then its gated MLP runs. The planner prices it as a twin
of parallel blocks ``P`` and MLP blocks ``-`` (``plan/hf/twin.falcon_twin``): parameters equal
transformers' model's for each Mamba norm variant, and one measured training step holds parameters
and traffic exact and saved activations within 10%, peak within 15%, at tp=2 + SP (one B/C group:
replicated, no norm) and at cp=2 with Ulysses attention (two groups, the gated norm), in float32 and
under bf16 mixed precision (autocast at tp=2, FSDP's at cp=2). Before, Falcon-H1 kept the
parameter-only plan.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridpar.config import load_config
from hybridpar.plan import make_plan
from hybridpar.plan.planner import Plan, TransformersPlan
from tests.plan.step_check import assert_plan_matches_step

WIDTHS = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
              num_hidden_layers=2, intermediate_size=192, mamba_n_heads=8, mamba_d_head=32, mamba_d_ssm=256,
              mamba_d_state=16, mamba_chunk_size=64, ssm_in_multiplier=0.7, key_multiplier=0.5)
VARIANTS = {  # the default (one group, y * silu(z)) and the gated norm, before or after the gate
    "plain": {},
    "norm": dict(mamba_rms_norm=True, mamba_norm_before_gate=True),
    "norm_groups": dict(mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_n_groups=2),
}


def _checkpoint(path, weights: bool = False, **fields) -> str:
    import transformers as hf

    config = hf.FalconH1Config(**{**WIDTHS, **fields})
    if weights:
        torch.manual_seed(0)
        hf.FalconH1ForCausalLM(config).save_pretrained(path)
    else:  # config.json only: what the planner reads
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["FalconH1ForCausalLM"]}))
    return str(path)


def _overrides(path: str, *more: str) -> list[str]:
    return [f"model.hf_path={path}", "model.backend=transformers", "data.pack_size=2048", "data.packs_per_step=1", *more]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("tp", [1, 2])
def test_falcon_h1_is_planned_as_parallel_layers_with_transformers_parameters(tmp_path, variant, tp):
    import transformers as hf

    path = _checkpoint(tmp_path / variant, **VARIANTS[variant])
    plan = make_plan(load_config(None, _overrides(path, f"parallel.tp={tp}")), world_size=tp)
    model = hf.FalconH1ForCausalLM(hf.FalconH1Config.from_pretrained(path))
    assert isinstance(plan, Plan) and plan.layout.model.pattern == "P-P-"
    assert plan.memory.params.total == sum(p.numel() for p in model.parameters())
    assert plan.memory.saved_by_kind["mamba+attention"] > plan.memory.saved_by_kind["mlp"] > 0
    assert "mamba+attention" not in make_plan(load_config(None, [])).memory.saved_by_kind  # HybridLM: no such kind
    assert (plan.traffic_by_kind.get("all_reduce", 0) > 0) == (tp > 1)


def test_a_falcon_h1_the_twin_cannot_hold_keeps_the_parameter_plan_and_says_why(tmp_path):
    path = _checkpoint(tmp_path / "bias", mamba_proj_bias=True)
    plan = make_plan(load_config(None, _overrides(path)))
    assert isinstance(plan, TransformersPlan)
    assert "in_proj bias (mamba_proj_bias=True) and out_proj bias (projectors_bias=False) differ" in plan.text()
    plan = make_plan(load_config(None, _overrides(_checkpoint(tmp_path / "plain"), "peft.method=lora")))
    assert isinstance(plan, Plan) and plan.memory.params.adapters > 0  # LoRA on it is planned (test_plan_lora_measured)


@pytest.mark.parametrize("variant, layout", [
    ("plain", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("norm_groups", ["parallel.cp=2", "parallel.cp_attention=ulysses"]),
    # bf16 autocast: the norm outputs enter TP in float32, the summed branches leave with the residual in
    # float32, the one B/C group's float32 gradients are all-reduced
    ("plain", ["parallel.tp=2", "parallel.mixed_precision=bf16"]),
    # FSDP's bf16: mup_vector (a float32 buffer) makes the Mamba branch and its CP exchanges float32
    ("norm_groups", ["parallel.cp=2", "parallel.mixed_precision=bf16"]),
])
def test_the_plan_of_falcon_h1_matches_one_measured_step(tmp_path, variant, layout):
    overrides = _overrides(_checkpoint(tmp_path / variant, weights=True, **VARIANTS[variant]), *layout)
    assert_plan_matches_step(overrides, str(tmp_path / "run"))
