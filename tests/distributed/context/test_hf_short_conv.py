"""Context parallelism (cp=2) of LFM2, LFM2-MoE and LFM3 against one process, float64.

Tiny models of ``tests/models/hf/lfm_models.py``; ``parallelize(cp=2)`` switches their short convs
to hybridpar's document-resetting conv and installs the halo exchange (``parallel/context/recurrent/short_conv.py``)
as their ``core``, and the attention strategy on the attention modules. Two rows of two packed
documents (12 and 20 tokens, zigzag chunks of 3 and 5: LFM2's kernel of 5 reads a halo of 4,
longer than a chunk). The one-process reference runs the same model at cp=1
(``tests/models/hf/test_short_conv.py`` proves it equals transformers on each document alone).
The loss and every parameter gradient agree to 1e-9; FSDP2 shards the model over the CP ranks.
"""

from __future__ import annotations

import torch

from tests.distributed.harness import run_ranks
from tests.distributed.context.mixer_cp import cp_case

TOL = 1e-9
CASES = [("lfm2", "allgather"), ("lfm2_moe", "ulysses"), ("lfm3", "ring")]


def _case(name, attention, mesh) -> dict:
    from hybridpar.models.hf.mixers.short_conv import install_short_conv, short_convs
    from tests.models.hf.lfm_models import VOCAB, build_lfm

    return cp_case(build_lfm, install_short_conv, short_convs, VOCAB, name, attention, mesh)


def _run(rank, world_size) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    torch.set_num_threads(1)
    mesh = ParallelDims(cp=2).build_mesh()
    return {case: _case(*case, mesh) for case in CASES}


def test_cp2_of_short_conv_models_matches_one_process():
    for rank_results in run_ranks(2, _run, timeout_s=300):
        for (name, attention), r in rank_results.items():
            assert r["params"] == r["expected"] and r["cores"] == {"HaloShortConv"}, (name, r)
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (name, attention, r)


def _refused(rank, world_size) -> str:
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from tests.models.hf.lfm_models import VOCAB, build_lfm

    mesh = ParallelDims(cp=2).build_mesh()
    parallelize(build_lfm("lfm2"), ParallelDims(cp=2), mesh=mesh)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 6, 16], dtype=torch.int32))  # 6: not a multiple of 4
    try:
        shard_inputs(input_ids=torch.randint(0, VOCAB, (1, 16)), packed=packed, cp_group=ParallelDims.group(mesh, "cp"))
    except ValueError as error:
        return str(error)
    return "accepted"


def test_documents_not_divisible_by_twice_cp_are_refused_before_any_collective():
    for message in run_ranks(2, _refused, timeout_s=120):
        assert message != "accepted" and "\n" not in message, message
