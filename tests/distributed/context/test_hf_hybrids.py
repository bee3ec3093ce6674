"""Context parallelism (cp=2) of transformers' Mamba2 hybrids against one process, float64.

Tiny models of ``tests/models/hf/hybrid_models.py`` with hybridpar's Mamba core in their mixers
(``install_mamba_core``); ``parallelize(cp=2)`` installs the Mamba CP strategy (``a2a``,
``state``) through ``mixer.core`` and the attention strategy (``allgather``, ``ulysses``, ``ring``)
through the transformers attention bridge. Two rows of two packed documents (12 and 20
tokens: both cut across the ranks); the one-process reference runs the same cores at cp=1
(``tests/models/hf/test_mamba_mixers.py`` proves it equals one document per row). The loss and
every parameter gradient agree to 1e-9 (the loss through the trainer's ``pack_loss_sum``: NemotronH's
own logits are float32).
"""

from __future__ import annotations

from tests.distributed.harness import run_ranks
from tests.distributed.context.mixer_cp import cp_case

TOL = 1e-9
CASES = [("granite_moe", "a2a", "allgather"), ("granite_moe", "state", "ulysses"), ("falcon_h1", "state", "allgather"),
         ("nemotron_h_moe", "a2a", "ulysses"), ("bamba", "state", "allgather"), ("zamba2", "a2a", "allgather"),
         # the other attention strategy for each, and Granite dense and NemotronH dense as transformers models
         ("falcon_h1", "a2a", "ulysses"), ("nemotron_h_moe", "state", "allgather"), ("bamba", "a2a", "ulysses"),
         ("zamba2", "state", "ulysses"), ("granite", "state", "allgather"), ("granite", "a2a", "ulysses"),
         ("nemotron_h", "a2a", "allgather"), ("nemotron_h", "state", "ulysses"),
         # ring attention on every architecture's attention layers (Granite NoPE and RoPE with multipliers,
         # Falcon-H1's key multiplier, Zamba2's shared block)
         ("granite", "a2a", "ring"), ("granite_moe", "state", "ring"), ("falcon_h1", "a2a", "ring"),
         ("nemotron_h_moe", "state", "ring"), ("bamba", "a2a", "ring"), ("zamba2", "state", "ring"),
         # two hybrid layers reusing one shared block (tied parameters: one FSDP unit), adapters, RoPE
         ("zamba2_shared", "state", "ulysses")]


def _case(name, mamba, attention, mesh) -> dict:
    from hybridpar.models.hf.mixers.mamba2 import bridged_mixers, install_mamba_core
    from tests.models.hf.hybrid_models import VOCAB, build_hybrid

    return cp_case(build_hybrid, install_mamba_core, bridged_mixers, VOCAB, name, attention, mesh, mamba=mamba)


def _run(rank, world_size) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    mesh = ParallelDims(cp=2).build_mesh()
    return {case: _case(*case, mesh) for case in CASES}


def test_cp2_of_transformers_hybrids_matches_one_process():
    for rank_results in run_ranks(2, _run, timeout_s=600):
        for (name, mamba, _), r in rank_results.items():
            assert r["params"] == r["expected"], name
            assert r["cores"] == {"HiddenParallelMamba" if mamba == "a2a" else "StatePassingMamba"}, (name, r["cores"])
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (name, mamba, r)
