"""Tensor (+sequence) parallelism of the attention-sink models other than GPT-OSS against one process, float64.

Granite-SWA, Granite-MoE-SWA (a shared MLP), MiMo-V2-Flash (v head dim 12, sinks on its sliding layer only,
a MoE layer) and Flint (q/k norms, a MoE layer with a shared expert) from ``tests/distributed/tensor/hf_models``
(eager attention: transformers has no SDPA path with sinks) through their registered plans
(``parallel/tensor/hf_plans/sinks.py``) at tp=2 and tp=2 + SP on 2 gloo ranks: the logits and every parameter
gradient equal the one-process model's to 1e-9, and each sink parameter is ``Shard(0)`` (its heads). A value
head count that tp does not divide is refused in one line before any collective.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.tensor.hf_models import SEQ, SINK_MODELS, VOCAB

TOL = 1e-9


def _run(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.distributed.tensor.hf_models import parity

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out = {}
    for name in SINK_MODELS:
        for sp in (False, True):
            result = parity(name, sp, mesh)
            result.pop("model"), result.pop("reference")
            out[(name, sp)] = result
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, _run, timeout_s=300)


@pytest.mark.parametrize("name", SINK_MODELS)
@pytest.mark.parametrize("sp", [False, True])
def test_sink_models_at_tp2_match_one_process(results, name, sp):
    for rank_results in results:
        case = rank_results[(name, sp)]
        assert case["source"] == "registry" and case["same_names"]
        assert case["logits_shape"] == (2, SEQ, VOCAB) and case["logits_error"] < TOL
        worst = max(case["grad_errors"], key=case["grad_errors"].get)
        assert case["grad_errors"][worst] < TOL, (worst, case["grad_errors"][worst])
        sinks = {n: code for n, code in case["placements"].items() if n.endswith(".sinks")}
        assert sinks and set(sinks.values()) == {"S0"}, sinks
        assert "plain" not in case["placements"].values()


def test_value_heads_tp_does_not_divide_are_refused_in_one_line():
    from hybridpar.parallel.tensor.apply import check_tp_plan
    from tests.distributed.tensor.hf_models import build_model

    model = build_model("mimo_v2_flash")  # 2 KV heads on the full layer: tp=4 splits a head
    with pytest.raises(ValueError, match=r"^[^\n]*num_key_value_heads=2 is not divisible by tp=4[^\n]*$"):
        check_tp_plan(model, 4)
    from hybridpar.parallel.tensor.hf_plans.sinks import ValueHeadParallel

    with pytest.raises(ValueError, match=r"^[^\n]*2 value heads are not divisible by tp=4[^\n]*$"):
        ValueHeadParallel(2).check("model.layers.1.self_attn.v_proj", model.model.layers[1].self_attn.v_proj, 4)
