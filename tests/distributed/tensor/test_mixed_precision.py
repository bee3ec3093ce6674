"""bf16 mixed precision under tensor parallelism without FSDP (autocast on every TP rank): the
same loss and gradients as one process in bf16 mixed precision, up to bf16 rounding, on float32
master weights; and not the float32 result (autocast really ran)."""

from __future__ import annotations

import copy

import torch

from tests.distributed.context.test_model import build_model, distributed_run, make_batch, reference_run
from tests.distributed.harness import run_ranks

BF16_TOL = 3e-2  # relative to each quantity's largest value: a few bf16 roundings


def _worker(rank: int, world_size: int) -> dict | None:
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.parallel.precision import apply_autocast, autocast_dtype

    base = build_model(dtype=torch.float32)
    batches = [make_batch("packed", seed=3)]
    fp32 = reference_run(copy.deepcopy(base), batches)[0]
    bf16 = reference_run(apply_autocast(copy.deepcopy(base), "bf16"), batches)[0]  # what parallelize does at world size 1
    dims = ParallelDims(tp=2)
    mesh = dims.build_mesh()
    model = parallelize(copy.deepcopy(base), dims, mesh=mesh, mixed_precision="bf16", sequence_parallel=True)
    tp = distributed_run(model, mesh, batches, sequence_parallel=True)[0]
    weights = sorted({str(p.dtype) for p in model.parameters()})
    return {"fp32": fp32, "bf16": bf16, "tp": tp, "weights": weights, "autocast": str(autocast_dtype(model))} \
        if rank == 0 else None


def _worst(got: dict, want: dict) -> float:
    worst = abs(got["loss"] - want["loss"]) / abs(want["loss"])
    for name, expected in want["grads"].items():
        worst = max(worst, float((got["grads"][name].float() - expected).abs().max() / expected.abs().max().clamp_min(1e-12)))
    return worst


def test_tp2_bf16_mixed_precision_matches_one_process_bf16():
    result = run_ranks(2, _worker, timeout_s=300)[0]
    assert result["weights"] == ["torch.float32"] and result["autocast"] == "torch.bfloat16"
    assert set(result["tp"]["grads"]) == set(result["bf16"]["grads"])
    assert _worst(result["tp"], result["bf16"]) <= BF16_TOL
    assert _worst(result["bf16"], result["fp32"]) > 1e-5  # bf16 matmuls ran: not the float32 numbers
    assert _worst(result["tp"], result["fp32"]) <= 2 * BF16_TOL
