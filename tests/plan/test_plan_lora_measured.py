"""The plan of a LoRA run against one measured training step, on real gloo ranks.

Under LoRA a backward collective runs only where a gradient reaches it (``parallel/comm/grad_flow.py``),
FSDP gathers the adapters with their units and reduces only theirs, and each replicated factor's
gradient is all-reduced over TP; a block keeps for backward only what the adapters' gradients need
(``plan/lora.py``). Before, the plan priced a LoRA step as full training's traffic with FSDP's
reductions scaled down: 1.0 MB too many TP all-reduces at tp=2, the adapters' gathers missing under
FSDP, and 1.2-2x the saved activations with narrow target lists. Held per case: parameters per
rank and every collective's bytes exact, saved activations within 10%, peak within 15%. Targets
that leave the first blocks without a gradient (``o_proj``, ``down_proj``; q only under ulysses)
are the cases where the gradient's reach matters; Falcon-H1's parallel layers and Granite 4.0-H's MoE
blocks and fused MLP are planned under LoRA too, and adapters on stacked expert weights.
"""

from __future__ import annotations

import pytest

from tests.plan.step_check import assert_plan_matches_step
from tests.plan.test_plan_hf import _checkpoint
from tests.plan.test_plan_moe import _checkpoint as moe_checkpoint
from tests.plan.test_plan_parallel_layers import _checkpoint as falcon_checkpoint

LORA = ["peft.method=lora", "peft.r=4"]
CASES = {  # name -> (world size, overrides)
    "tp=2, o_proj and down_proj": (2, ["parallel.cp=1", "parallel.tp=2", "peft.target_modules=[o_proj,down_proj]"]),
    "cp=2 ulysses, q_proj and down_proj": (2, ["parallel.cp=2", "parallel.tp=1", "parallel.cp_attention=ulysses",
                                               "peft.target_modules=[q_proj,down_proj]"]),
    "dp_shard=2 x tp=2, one B/C group": (4, ["parallel.cp=1", "parallel.tp=2", "parallel.dp_shard=2",
                                             "data.packs_per_step=4", "model.overrides={mamba_n_groups: 1}"]),
    "tp=2 + SP, selective": (2, ["parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                                 "parallel.activation_checkpointing=selective"]),
    "llama, tp=2 + SP, q_proj and v_proj": (2, ["parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                                                "peft.target_modules=[q_proj,v_proj]"]),
    # a parallel layer whose attention branch has no gradient (Falcon-H1): no second branch all-gather under SP
    "falcon_h1, tp=2 + SP, out_proj": (2, ["parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                                           "peft.target_modules=[out_proj]"]),
    # MoE blocks (Granite 4.0-H): frozen experts keep neither their gathered input nor the down input; the
    # first MoE block's router and experts keep nothing (its input has no gradient); the fused shared_mlp adapted
    "granite, cp=2 x tp=2, o_proj and output_linear": (4, ["parallel.cp=2", "parallel.tp=2",
                                                          "parallel.sequence_parallel=true",
                                                          "peft.target_modules=[o_proj,output_linear]"]),
    # adapters on the stacked experts (peft.target_parameters): each keeps its input rows and effective weight
    "nemotron_h_moe, tp=2 + SP, stacked experts": (2, ["parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                                                       "peft.target_parameters=[experts.up_proj,experts.down_proj]"]),
}
CHECKPOINTS = {"llama": lambda path: _checkpoint(path, "llama", weights=True),
               "falcon_h1": lambda path: falcon_checkpoint(path, weights=True),
               "granite": lambda path: moe_checkpoint(path, "granite", weights=True),
               "nemotron_h_moe": lambda path: moe_checkpoint(path, "nemotron_h_moe", weights=True)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_lora_plan_matches_one_measured_step(tmp_path, name):
    world, layout = CASES[name]
    checkpoint = CHECKPOINTS.get(name.split(",")[0])
    model = [f"model.hf_path={checkpoint(tmp_path / 'model')}", "model.backend=transformers"] if checkpoint else []
    packs = [] if any(o.startswith("data.packs_per_step") for o in layout) else ["data.packs_per_step=1"]
    overrides = model + LORA + ["data.pack_size=2048", *packs, *layout]
    assert_plan_matches_step(overrides, str(tmp_path / "run"), world)
