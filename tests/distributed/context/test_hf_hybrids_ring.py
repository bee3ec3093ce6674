"""Ring attention context parallelism (cp=2) of transformers' Mamba2 hybrids against one process, float64.

The same check as ``test_hf_hybrids.py`` (two rows of two packed documents cut across the ranks,
hybridpar's cores, loss and every parameter gradient at 1e-9) with ``cp_attention="ring"`` on each
architecture's attention layers (Granite dense NoPE, Granite MoE RoPE and multipliers, Falcon-H1's
key multiplier, Nemotron-H MoE, Bamba, Zamba2's shared attention block), and each with the Mamba
strategy its other test does not run.
"""

from __future__ import annotations

from tests.distributed.context.test_hf_hybrids import TOL, _case
from tests.distributed.harness import run_ranks

CASES = [("granite", "a2a", "ring"), ("granite_moe", "state", "ring"), ("falcon_h1", "a2a", "ring"),
         ("nemotron_h_moe", "state", "ring"), ("bamba", "a2a", "ring"), ("zamba2", "state", "ring")]


def _run(rank, world_size) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    mesh = ParallelDims(cp=2).build_mesh()
    return {case: _case(*case, mesh) for case in CASES}


def test_ring_attention_cp2_of_transformers_hybrids_matches_one_process():
    for rank_results in run_ranks(2, _run, timeout_s=600):
        for (name, mamba, _), r in rank_results.items():
            assert r["params"] == r["expected"], name
            assert r["cores"] == {"HiddenParallelMamba" if mamba == "a2a" else "StatePassingMamba"}, (name, r["cores"])
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (name, mamba, r)
