"""``hybridpar plan`` with ``peft.method=lora``: adapters counted exactly, the base frozen.

The planner's adapter count equals the real model's after ``add_lora`` (every preset it can
build quickly, the default and a narrowed target list); gradients and AdamW state are the
adapters' only; the saved activations grow by ``h = A x`` per adapter and lose the first block's
input; FSDP reduce-scatters only adapter gradients (measured: ``test_plan_lora_measured.py``); ``--fit`` searches LoRA layouts and finds one where full fine-tuning fits none.
"""

from __future__ import annotations

import pytest

from hybridpar.config import ConfigError, load_config
from hybridpar.models.hybrid import HybridConfig, HybridLM
from hybridpar.models.lora import add_lora
from hybridpar.plan import make_plan
from hybridpar.plan.search import search_layouts

ONE = ["parallel.cp=1", "parallel.tp=1"]


@pytest.mark.parametrize("targets", [None, ["q_proj", "in_proj", "down_proj"]])
def test_adapter_count_equals_the_real_model(targets):
    overrides = ONE + ["peft.method=lora", "peft.r=4"] + ([f"peft.target_modules=[{','.join(targets)}]"] if targets else [])
    plan = make_plan(load_config(None, overrides))
    model = HybridLM(HybridConfig.from_preset("tiny"))
    add_lora(model, r=4, targets=targets)
    real = sum(p.numel() for p in model.parameters() if p.requires_grad)
    e = 4  # float32
    assert plan.memory.params.adapters == real
    assert plan.memory.params.grad_bytes == real * e and plan.memory.params.optimizer_bytes == 2 * real * e
    full = make_plan(load_config(None, ONE))
    assert plan.memory.params.param_bytes == full.memory.params.param_bytes + real * e
    # the frozen embedding: the first block keeps no input (its gradient is never needed); h = A x per adapter
    block0 = plan.memory.saved_by_kind["mamba"] - full.memory.saved_by_kind["mamba"]
    assert plan.memory.saved_by_kind["attention"] > full.memory.saved_by_kind["attention"] and block0 < 0
    assert plan.memory.peak_bytes < full.memory.peak_bytes


def test_fsdp_reduces_only_adapter_gradients_and_fit_searches_lora_layouts():
    big = ["model.preset=nemotronh-8b", "model.dtype=bfloat16", "data.pack_size=8192", "data.packs_per_step=2",
           "parallel.dp_shard=2", "parallel.cp=1", "parallel.tp=1"]
    full, lora = make_plan(load_config(None, big)), make_plan(load_config(None, big + ["peft.method=lora"]))
    assert lora.traffic_by_kind["reduce_scatter"] < full.traffic_by_kind["reduce_scatter"] / 100
    assert lora.traffic_by_kind["all_gather"] > full.traffic_by_kind["all_gather"]  # the adapters gathered too
    budget = (lora.memory.peak_bytes + full.memory.peak_bytes) / 2 / 2**30 + 1.0  # between the two peaks
    fits = [c for c in search_layouts(load_config(None, big + ["peft.method=lora"]), 2, budget) if c.fits(budget)]
    assert fits and all(c.plan.layout.lora_rank == 8 for c in fits)


def test_a_transformers_model_gets_its_weights_gradients_and_adamw_per_rank(tmp_path):
    """``hybridpar plan`` of a transformers checkpoint (config.json only): the trainable elements are
    the real model's after ``apply_peft`` (LoRA: the adapters), bytes follow ``model.dtype`` (fp32
    masters under mixed precision), and everything is split over tp x dp_shard x cp. Before, it said
    "fp32 params + grads + AdamW" (16 bytes per parameter) whatever the dtype or LoRA."""
    import json

    from transformers import GemmaConfig, GemmaForCausalLM

    # Gemma (norm offset, scaled embedding): no HybridLM twin (plan/hf/twin.py): the planner gives its
    # parameter share
    config = GemmaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=256, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["GemmaForCausalLM"]}))
    model = GemmaForCausalLM(config)
    add_lora(model, r=4)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = ["model.backend=transformers", f"model.hf_path={tmp_path}", "parallel.tp=1", "parallel.cp=2"]
    lora = make_plan(load_config(None, base + ["peft.method=lora", "peft.r=4", "model.dtype=bfloat16"]))
    assert (lora.parameters, lora.trainable) == (sum(p.numel() for p in model.parameters()), adapters)
    # a bfloat16 base, float32 adapters (models.lora.adapter_dtype): their gradients and AdamW at 4 bytes
    assert lora.bytes_per_rank == {"weights": -(-lora.parameters // 2) * 2, "gradients": -(-adapters // 2) * 4,
                                   "adamw": 2 * -(-adapters // 2) * 4}
    full = make_plan(load_config(None, base + ["parallel.mixed_precision=bf16", "model.dtype=float32"]))
    assert full.trainable == full.parameters and full.element_bytes == 4  # fp32 masters
    assert "weights" in full.text() and "AdamW" in full.text()
    with pytest.raises(ConfigError, match="trainable parameters are torch.bfloat16"):  # bf16 masters: refused
        make_plan(load_config(None, base + ["parallel.mixed_precision=bf16", "model.dtype=bfloat16"]))


def test_expert_adapters_count_in_the_plan_of_a_transformers_moe(tmp_path):
    """``peft.target_parameters`` on a Qwen3-MoE checkpoint: the plan's trainable elements are the
    real model's adapters, expert factors included (per stacked weight ``A [r*E, in]``, ``B [out, r*E]``)."""
    import json

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                            vocab_size=64)
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}))
    base = ["model.backend=transformers", f"model.hf_path={tmp_path}", "parallel.tp=1", "parallel.cp=2",
            "peft.method=lora", "peft.r=4", "model.dtype=bfloat16"]
    linear = make_plan(load_config(None, base)).trainable
    plan = make_plan(load_config(None, base + ["peft.target_parameters=[experts.gate_up_proj,experts.down_proj]"]))
    experts = 2 * (4 * 4 * (32 + 2 * 16) + 4 * 4 * (16 + 32))  # layers x (gate_up + down): r*E*(in + out)
    assert plan.trainable == linear + experts
    model = Qwen3MoeForCausalLM(config)
    add_lora(model, r=4, target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    assert plan.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan.bytes_per_rank["gradients"] == -(-plan.trainable // 2) * 4  # float32 adapters on bfloat16


def test_adapters_the_twin_cannot_price_keep_the_parameter_plan_and_say_why(tmp_path):
    """A target the real model matches but the twin does not (a full module path: the twin's layers are
    ``backbone.layers.i``) would leave the twin's plan without those adapters: refused, with the counts,
    and ``--fit`` refuses in one line."""
    from hybridpar.plan.planner import TransformersPlan
    from tests.plan.test_plan_hf import _checkpoint

    overrides = [f"model.hf_path={_checkpoint(tmp_path / 'llama')}", "peft.method=lora", "peft.r=4", "parallel.cp=1",
                 "parallel.tp=1", "peft.target_modules=[model.layers.0.self_attn.q_proj]"]
    plan = make_plan(load_config(None, overrides))
    assert isinstance(plan, TransformersPlan) and plan.trainable == 4 * (128 + 128)  # A [4, 128], B [128, 4]
    assert "its 1,024 LoRA adapter parameters are not the 0 its twin prices" in plan.text()
    with pytest.raises(ConfigError, match="not the 0 its twin prices"):
        search_layouts(load_config(None, overrides), 2, 80)


def test_the_time_estimate_runs_no_backward_before_the_first_adapter_and_no_weight_gradients():
    """The step's FLOPs under LoRA (``plan/estimate.py``): forward everywhere; backward only where a
    gradient reaches, and there dX only (frozen weights); each adapter factor forward, dX and dW; the
    frozen head's logits 3 passes, not 4. ``tiny`` (M*-M-) with adapters on down_proj only: blocks 0
    and 1 run forward only."""
    from hybridpar.plan.estimate import step_flops

    tc, r = 1024, 8
    plan = make_plan(load_config(None, ONE + ["data.pack_size=1024", "data.packs_per_step=1", "peft.method=lora",
                                              f"peft.r={r}", "peft.target_modules=[down_proj]"]))
    mamba, attention, mlp = 64 * 328 + 128 * 64, 64 * (64 + 2 * 32) + 64 * 64, 128 * 64 * 2  # tiny's widths
    ssd = 2 * 8 * (16 * (16 + 16) + 2 * 16 * 16)
    expected = 2 * tc * (mamba * 1 + attention * 1 + mlp * 2 + mamba * 2 + mlp * 2)  # passes: 1, or 1 + dX
    expected += 4 * tc * (1024 / 2) * 64 * 1  # block 1's attention core, forward only
    expected += tc * ssd * (1 + 2)  # block 0's scan forward only, block 3's forward and backward
    expected += 2 * (2 * tc * (r * 128 + 64 * r) * 3)  # two down_proj adapters: A [r, 128], B [64, r]
    expected += 2 * tc * 256 * 64 * 3  # the frozen LM head
    assert step_flops(plan.layout) == expected
    from hybridpar.plan.report import plan_text

    assert "the first adapter is in block 2: the 2 block(s) before it keep nothing and run no backward" in plan_text(plan)
    full = make_plan(load_config(None, ONE + ["data.pack_size=1024", "data.packs_per_step=1"]))
    assert step_flops(full.layout) > 1.5 * expected
