"""LoRA on stacked MoE experts under tp=2 (and + SP), dp_shard=2 and cp=2 (with activation
checkpointing) against one process (float64, gloo; tp=2 x dp_shard=2 and cp=2 x tp=2 on 4 ranks).

A tiny transformers Qwen3-MoE (eager experts) with adapters on ``q_proj`` and on
``experts.gate_up_proj`` / ``experts.down_proj`` (and a NemotronH with Mamba, attention and an ungated
MoE layer: ``experts.up_proj`` / ``experts.down_proj``; at tp=2 + SP) (``A`` and ``B`` random: every factor has a
gradient). Under tp=2 the experts are sharded on their intermediate dim (``GroupedExpertsParallel``)
and the factors with them (``parallel/lora.py``: gate_up's B by rows, down_proj's A by columns, the
other factor replicated with its gradient all-reduced). The loss and every adapter gradient
(``canonical_state_dict(grads=True)``) equal one process's to 1e-9; no base parameter has one.
A TP style that cannot carry the factors is refused before any collective.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybridpar.models.lora import add_lora, is_lora_parameter
from hybridpar.train.loss import global_sum, token_loss_sum, valid_token_count
from tests.distributed.context.test_model import TOL, make_batch
from tests.distributed.harness import run_ranks

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
MODELS = {"qwen3_moe": EXPERTS, "nemotron_h_moe": ["experts.up_proj", "experts.down_proj"]}  # NemotronH: no gate
LAYOUTS = {"tp2": dict(tp=2), "tp2-sp": dict(tp=2, sequence_parallel=True), "dp_shard2": dict(dp_shard=2),
           "cp2-ac": dict(cp=2, activation_checkpointing="full")}
OPTIONS = ("sequence_parallel", "activation_checkpointing")


def expert_lora_model(name: str = "qwen3_moe"):
    if name == "nemotron_h_moe":  # Mamba (on hybridpar's core, as parallelize installs it), attention, MoE
        from hybridpar.models.hf.float64 import keep_float64
        from hybridpar.models.hf.mixers.mamba2 import install_mamba_core
        from tests.models.hf.hybrid_models import build_hybrid

        model = build_hybrid(name)
        install_mamba_core(model)
        keep_float64(model)
    else:
        from tests.distributed.tensor.hf_models import build_model

        model = build_model(name)
    add_lora(model, r=2, alpha=6.0, targets=["q_proj"], target_parameters=MODELS[name], seed=1)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_lora_parameter(name):
                param.copy_(0.2 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model


def _batches(dp: int) -> list:
    return [make_batch("dense", seed=40 + d, vocab=97) for d in range(dp)]


def reference(dp: int, name: str) -> dict:
    model = expert_lora_model(name)
    batches = _batches(dp)
    count = sum(valid_token_count(labels) for _, labels, _ in batches)
    loss = sum(token_loss_sum(model(input_ids=ids, use_cache=False).logits, labels) for ids, labels, _ in batches)
    (loss / count).backward()
    from hybridpar.parallel.state import canonical_state_dict

    return {"loss": (loss / count).item(), "grads": canonical_state_dict(model, grads=True)}


def worker(rank: int, world_size: int, layouts: dict = LAYOUTS, models=tuple(MODELS)) -> dict:
    from hybridpar.parallel.context.hf import hf_cp_inputs
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.parallel.state import canonical_state_dict

    results = {}
    for (layout, kwargs), name in ((item, name) for item in layouts.items() for name in models
                                   if name == "qwen3_moe" or layout == "tp2-sp"):  # (time) NemotronH: up_proj's pairing
        options = {k: v for k, v in kwargs.items() if k in OPTIONS}
        dims = ParallelDims(**{k: v for k, v in kwargs.items() if k not in OPTIONS})
        mesh = dims.build_mesh()
        model = parallelize(expert_lora_model(name), dims, mesh=mesh, **options)
        dp = dims.dp_replicate * dims.dp_shard
        ids, labels, packed = _batches(dp)[ParallelDims.mesh(mesh, "dp").get_local_rank()]
        dp_cp = ParallelDims.group(mesh, "dp_cp")
        local = shard_inputs(ids, labels=labels, packed=packed, cp_group=mesh["cp"].get_group(),
                             tp_group=mesh["tp"].get_group(), sequence_parallel=options.get("sequence_parallel", False))
        count = global_sum(valid_token_count(local.labels), dp_cp)
        loss_sum = token_loss_sum(model(**hf_cp_inputs(local)).logits, local.labels)
        (loss_sum / count).backward()
        results[(layout, name)] = {"loss": (global_sum(loss_sum, dp_cp) / count).item(),
                           "grads": canonical_state_dict(model, grads=True),
                           "base_grads": [n for n, p in model.named_parameters()
                                          if not is_lora_parameter(n) and p.grad is not None]}
    return results


def _check(results: list[dict], layouts: dict) -> None:
    failures, references = [], {}
    for (layout, name), got in results[0].items():
        dp = layouts[layout].get("dp_shard", 1)
        want = references.setdefault((dp, name), reference(dp, name))
        assert any("proj.lora_B" in n for n in want["grads"]) and any("lora_down_proj" in n for n in want["grads"])
        layout = f"{layout} {name}"
        if abs(got["loss"] - want["loss"]) > TOL * max(1.0, abs(want["loss"])):
            failures.append(f"{layout}: loss {got['loss']!r} != {want['loss']!r}")
        if set(got["grads"]) != set(want["grads"]):
            failures.append(f"{layout}: gradient names differ: {sorted(set(got['grads']) ^ set(want['grads']))[:6]}")
            continue
        for name, expected in want["grads"].items():
            err = (got["grads"][name] - expected).abs().max().item()
            if err > TOL * max(1.0, expected.abs().max().item()):
                failures.append(f"{layout}: {name} gradient error {err:.3e}")
    failures += [f"rank {r} {key}: base gradients {got['base_grads'][:3]}" for r, rank_results in enumerate(results)
                 for key, got in rank_results.items() if got["base_grads"]]
    assert not failures, "\n".join(failures[:30])


@pytest.mark.timeout(300)
def test_expert_lora_tp_sp_fsdp_cp_match_one_process():
    _check(run_ranks(2, worker, timeout_s=240), LAYOUTS)


@pytest.mark.timeout(300)
def test_expert_lora_tp_with_fsdp_on_4_ranks_matches_one_process():
    """FSDP's row shards of the factors compose with TP's (gate and up rows of B apart: ``GateUpB``)."""
    layouts = {"tp2-dp_shard2": dict(tp=2, dp_shard=2), "cp2-tp2": dict(cp=2, tp=2)}
    _check(run_ranks(4, worker, layouts, ("qwen3_moe",), timeout_s=240), layouts)


def test_expert_adapters_on_experts_tp_leaves_whole_are_refused_before_any_collective():
    from hybridpar.parallel.tensor.apply import check_tp_plan
    from hybridpar.parallel.tensor.styles import LocalReplicateParallel

    model = expert_lora_model()
    plan = {"model.layers.*.mlp.experts": LocalReplicateParallel()}
    with pytest.raises(ValueError, match=r"LoRA expert adapters on 'model\.layers\.0\.mlp\.experts' need .*"
                                         r"GroupedExpertsParallel.*peft\.target_parameters or use parallel\.tp=1"):
        check_tp_plan(copy.deepcopy(model), 2, plan)
