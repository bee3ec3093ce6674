"""``parallel.compile`` with context parallelism on transformers' recurrent mixers: no graph break,
no recompile for a new batch of the same shapes, float64 results equal to eager.

Two families on 2 gloo ranks (cp=2), each through ``parallelize(compile="aot_eager")`` against the
same layout in eager: Qwen3.5 (gated DeltaNet, "state") and Bamba (Mamba2, "state"; LFM2's halo
exchange and the other families: ``benchmarks/compile_hf.py``, to keep the suite's time); the state strategies used to build their segment plans inside every layer's forward
(host syncs, graph breaks), and now read them from ``packed.cache``, where the batch hook
(``parallel/context/core.py``) put them before the blocks ran. Two steps on packs whose documents
differ (same shapes): the loss and every parameter gradient of both equal eager's to 1e-9, no graph
break on either rank, and the second step compiles nothing (the plans are graph inputs, not
constants). The models are built without ``KeepFloat64`` (a torch function mode that dynamo breaks
on; the trainer uses it for float64 models only: ``docs/gpu.md``); eager and compiled run the same
transformers float32 casts.
"""

from __future__ import annotations

from unittest import mock

import torch

from tests.distributed.harness import run_ranks

TOL = 1e-9
DOCS = ([0, 4, 16, 32], [0, 16, 20, 32])  # the same segment and chunk counts: no new shapes at step 2
FAMILIES = (("qwen3_5", "state"), ("bamba", "state"))


def _build(family: str):
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from tests.models.hf.gdn_models import build_gdn
    from tests.models.hf.hybrid_models import build_hybrid

    with mock.patch("hybridpar.models.hf.float64.keep_float64", lambda model: model):
        model = {"qwen3_5": lambda: build_gdn("qwen3_5"), "bamba": lambda: build_hybrid("bamba")}[family]()
    use_hybridpar_attention(model)
    return model.train()


def _steps(family: str, strategy: str, mesh, backend) -> dict:
    from torch._dynamo.utils import counters

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.train.trainer import pack_loss_sum

    model = parallelize(_build(family), ParallelDims(cp=2), mesh=mesh, compile=backend, cp_mamba=strategy)
    cp_group = ParallelDims.group(mesh, "cp")
    torch._dynamo.reset()
    counters.clear()
    losses, grads, graphs = [], [], []
    for step, docs in enumerate(DOCS):
        gen = torch.Generator().manual_seed(step)
        ids, labels = (torch.randint(0, model.config.vocab_size, (2, docs[-1]), generator=gen) for _ in range(2))
        packed = PackedSeqParams.from_cu_seqlens(torch.tensor(docs, dtype=torch.int32))
        loss = pack_loss_sum(model, shard_inputs(input_ids=ids, labels=labels, packed=packed, cp_group=cp_group))[0]
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                      for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
        graphs.append(counters["stats"]["unique_graphs"])
    return {"losses": losses, "grads": grads, "graphs": graphs, "breaks": dict(counters["graph_break"])}


def compiled_and_eager(rank: int, world_size: int) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    mesh = ParallelDims(cp=2).build_mesh()
    results = {}
    for family, strategy in FAMILIES:
        eager, compiled = (_steps(family, strategy, mesh, backend) for backend in (False, "aot_eager"))
        grad_error = max(((c[n] - e[n]).abs().max() / e[n].abs().max().clamp_min(1.0)).item()
                         for c, e in zip(compiled["grads"], eager["grads"]) for n in e)
        results[family] = {"losses": (compiled["losses"], eager["losses"]), "grad_error": grad_error,
                           "graphs": compiled["graphs"], "breaks": compiled["breaks"],
                           "params": len(compiled["grads"][0])}
    return results


def test_compiled_recurrent_cp_cores_have_no_graph_break_and_match_eager():
    for rank, results in enumerate(run_ranks(2, compiled_and_eager, timeout_s=900)):
        for family, r in results.items():
            assert r["breaks"] == {}, (rank, family, r["breaks"])
            assert r["graphs"][0] > 0 and r["graphs"][1] == r["graphs"][0], (rank, family, r["graphs"])
            for got, want in zip(*r["losses"]):
                assert abs(got - want) < TOL * abs(want), (rank, family, r["losses"])
            assert r["params"] > 0 and r["grad_error"] < TOL, (rank, family, r["grad_error"])
