"""Context parallelism (cp=2) of Mamba, FalconMamba and Jamba (attention, experts) against one process, float64.

Tiny models of ``tests/models/hf/mamba1_models.py``; ``parallelize(cp=2)`` switches their Mamba1 mixers
to hybridpar's selective scan and installs state passing (``parallel/context/recurrent/mamba_state.py``) as their
``core``. Two rows of two packed documents (12 and 20 tokens, zigzag chunks of 3 and 5: the conv
kernel of 4 reads a halo of 3, a whole chunk). The one-process reference runs the same model at cp=1
(``tests/models/hf/test_mamba1_mixers.py`` proves it equals transformers on each document alone).
The loss and every parameter gradient agree to 1e-9; FSDP2 shards the model over the CP ranks.
Tensor parallelism (and cp x tp): ``tests/distributed/tensor/test_hf_mamba1_tp.py``.
"""

from __future__ import annotations

import torch

from tests.distributed.harness import run_ranks
from tests.distributed.context.mixer_cp import cp_case

TOL = 1e-9
CASES = [("mamba", "allgather"), ("falcon_mamba", "allgather"), ("jamba", "ulysses")]


def _case(name, attention, mesh) -> dict:
    from hybridpar.models.hf.mixers.mamba1 import install_mamba1_core, mamba1_mixers
    from tests.models.hf.mamba1_models import VOCAB, build_mamba1

    return cp_case(build_mamba1, install_mamba1_core, mamba1_mixers, VOCAB, name, attention, mesh)


def _run(rank, world_size) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    torch.set_num_threads(1)
    mesh = ParallelDims(cp=2).build_mesh()
    return {case: _case(*case, mesh) for case in CASES}


def test_cp2_of_mamba1_models_matches_one_process():
    for rank_results in run_ranks(2, _run, timeout_s=300):
        for (name, attention), r in rank_results.items():
            assert r["params"] == r["expected"] and r["cores"] == {"StatePassingMamba1"}, (name, r)
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (name, attention, r)
