"""The fused Mamba path (``models/mamba/fused_op.py``) behind hybridpar's parallel seams, on CPU.

FLA's contract, written out in float64 (``tests/models/mamba/test_fused.py``), stands in for the
kernel (``use_stand_in``), so the fused op runs where the kernel would on a GPU: context
parallelism with both Mamba strategies (``a2a``: heads exchanged, whole sequences; ``state``:
conv histories and SSM states passed between ranks, entering at document-segment starts) and
tensor parallelism (the mixer split by heads). The float64 loss and every parameter gradient
equal the single-process pure-PyTorch model's to 1e-9, and the stand-in ran on every rank.
"""

from __future__ import annotations

import copy

from tests.distributed.context.test_model import (
    build_model,
    compare,
    distributed_run,
    make_batch,
    reference_run,
)
from tests.distributed.harness import run_ranks

CASES = [("cp", "a2a"), ("cp", "state"), ("tp", "a2a")]


def _fused_worker(rank: int, world_size: int) -> dict:
    from hybridpar.models.mamba.fused import use_stand_in
    from hybridpar.models.mamba.fused_op import register_scan
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from tests.models.mamba.test_fused import simple_gla_contract

    calls = []
    register_scan("counted", lambda *args, **kwargs: calls.append(1) or simple_gla_contract(*args, **kwargs))
    base = build_model()
    results = {}
    for dim, mamba in CASES:
        dims = ParallelDims(**{dim: world_size})
        mesh = dims.build_mesh()
        model = parallelize(copy.deepcopy(base), dims, mesh=mesh, cp_mamba=mamba)
        calls.clear()
        with use_stand_in("counted"):
            results[dim, mamba] = (distributed_run(model, mesh, [make_batch("packed", seed=10)]), len(calls))
    return results


def test_fused_path_under_cp_and_tp_matches_one_process():
    ranks = run_ranks(2, _fused_worker, timeout_s=300)
    reference = reference_run(build_model(), [make_batch("packed", seed=10)])
    failures = []
    for rank, results in enumerate(ranks):
        assert set(results) == set(CASES)
        for (dim, mamba), (got, calls) in results.items():
            assert calls >= 2 * build_model().config.pattern.count("M"), (rank, dim, mamba, calls)
            if rank == 0:
                failures += compare(f"{dim}=2 {mamba} fused", got, reference)
    assert not failures, "\n".join(failures[:40])
