"""Tensor (+sequence) parallelism of multi-head latent attention (DeepSeek-V3, -V2) against one process, float64.

A tiny DeepSeek-V3 (``tests/distributed/tensor/hf_models.py``: 4 heads, q/kv latents 24/16, a dense first
layer, then a MoE layer with a grouped router and a shared expert), with and without ``q_lora_rank``, and a
DeepSeek-V2 alike (complex rotary, softmax router: ``keep_float64``), on
2 gloo ranks at tp=2 and tp=2 + SP through its registered plan (``parallel/tensor/hf_plans/mla.py``): the
logits and every parameter gradient (gathered, under transformers' names) equal the one-process model's
to 1e-9; q_b_proj / kv_b_proj are sharded by heads, the low-rank parts replicated. Heads not divisible by
tp are refused in one line before any collective.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.tensor.hf_models import SEQ, VOCAB, build_model, parity

TOL = 1e-9
CASES = [("deepseek_v3", False), ("deepseek_v3", True), ("deepseek_v3_no_q_lora", False),
         ("deepseek_v3_no_q_lora", True), ("deepseek_v2", False), ("deepseek_v2", True)]


def _run(rank, world_size) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    torch.set_num_threads(1)
    tp_mesh = ParallelDims(tp=2).build_mesh()["tp"]
    out = {}
    for name, sp in CASES:
        r = parity(name, sp, tp_mesh, variant="packed")
        out[(name, sp)] = {k: r[k] for k in ("source", "logits_shape", "logits_error", "grad_errors", "same_names",
                                             "placements", "fraction")}
    return out


def test_tp2_and_sp_of_deepseek_v3_match_one_process():
    for result in run_ranks(2, _run, timeout_s=300):
        for case in CASES:
            r = result[case]
            assert r["source"] == "registry" and r["same_names"] and r["logits_shape"] == (2, SEQ, VOCAB), (case, r)
            worst = max(r["grad_errors"], key=r["grad_errors"].get)
            assert r["logits_error"] < TOL and r["grad_errors"][worst] < TOL, (case, worst, r["grad_errors"][worst])
            placements = r["placements"]
            assert "plain" not in placements.values(), case
            q = "q_proj" if case[0] == "deepseek_v3_no_q_lora" else "q_b_proj"
            assert placements[f"model.layers.0.self_attn.{q}.weight"] == "S0", case
            assert placements["model.layers.1.self_attn.kv_b_proj.weight"] == "S0", case
            assert placements["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == "R", case
            assert placements["model.layers.1.self_attn.o_proj.weight"] == "S1", case
            assert r["fraction"] < 0.6, (case, r["fraction"])  # a rank holds 0.54; transformers' own plan (MLA replicated) 0.62


def test_heads_not_divisible_by_tp_are_refused_in_one_line():
    from hybridpar.parallel.tensor.hf_plans.mla import LatentUpParallel, validate_mla

    model = build_model("deepseek_v3")
    with pytest.raises(ValueError, match=r"^[^\n]*4 attention heads are not divisible by tp=8[^\n]*$"):
        validate_mla(model, 8)
    with pytest.raises(ValueError, match=r"^[^\n]*4 attention heads are not divisible by tp=3[^\n]*$"):
        LatentUpParallel(4).check("model.layers.0.self_attn.kv_b_proj", model.model.layers[0].self_attn.kv_b_proj, 3)


def test_lora_on_the_latent_projections_and_kda_layers_is_refused_in_one_line():
    from hybridpar.models.hf.mixers.kda import install_kda_core
    from hybridpar.models.lora import add_lora
    from hybridpar.parallel.lora import lora_pairings
    from hybridpar.parallel.tensor.hf_plans.kimi_linear import kimi_linear_plan
    from hybridpar.parallel.tensor.hf_plans.mla import deepseek_v3_plan
    from tests.models.hf.kda_models import build_kda

    model = build_model("deepseek_v3")
    add_lora(model, r=2, seed=0, targets=["q_a_proj", "o_proj"])
    assert set(lora_pairings(model, deepseek_v3_plan(model, False)).values()) == {"replicated", "rowwise"}
    model = build_model("deepseek_v3")
    add_lora(model, r=2, seed=0, targets=["kv_a_proj_with_mqa"])
    with pytest.raises(ValueError, match=r"^LoRA target 'model.layers.0.self_attn.kv_a_proj_with_mqa'[^\n]*$"):
        lora_pairings(model, deepseek_v3_plan(model, False))
    kimi = build_kda()
    install_kda_core(kimi)
    add_lora(kimi, r=2, seed=0, targets=["g_b_proj"])
    with pytest.raises(ValueError, match=r"^LoRA target 'model.layers.0.self_attn.g_b_proj'[^\n]*$"):
        lora_pairings(kimi, kimi_linear_plan(kimi, False))
