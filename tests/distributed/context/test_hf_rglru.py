"""Context parallelism (cp=2) of RecurrentGemma against one process, float64.

The tiny model of ``tests/models/hf/rglru_models.py`` (two RG-LRU blocks, a sliding-window MQA layer
with partial RoPE); ``parallelize(cp=2)`` switches its RG-LRU blocks to hybridpar's conv + scan and
installs state passing (``parallel/context/recurrent/rglru.py``) as their ``core``. Two rows of two
packed documents (12 and 20 tokens, zigzag chunks of 3 and 5: the conv kernel of 4 reads a halo of 3, a
whole chunk; the window of 6 crosses the seams). The one-process reference runs the same model at cp=1
(``tests/models/hf/test_rglru_blocks.py`` proves it equals transformers on each document alone). The
loss and every parameter gradient agree to 1e-9 (ring attention); FSDP2 shards the model over the CP ranks. One
block's forward sends the bytes of ``rglru_state_bytes_per_layer`` (``CommStats``). Tensor parallelism (and
cp=2 x tp=2): ``tests/distributed/tensor/hf/test_hf_rglru_tp.py``.
"""

from __future__ import annotations

import torch

from tests.distributed.harness import run_ranks
from tests.distributed.context.mixer_cp import cp_case

TOL = 1e-9
ATTENTION = ("ring",)  # allgather: `hybridpar check` at cp=2 (tests/train/test_packing_safety.py)


def _run(rank, world_size) -> dict:
    from hybridpar.models.hf.mixers.rglru import install_rglru_core, rglru_blocks
    from hybridpar.parallel.dims import ParallelDims
    from tests.models.hf.rglru_models import VOCAB, build_recurrent_gemma

    torch.set_num_threads(1)
    mesh = ParallelDims(cp=2).build_mesh()
    results = {attention: cp_case(build_recurrent_gemma, install_rglru_core, rglru_blocks, VOCAB, "recurrent_gemma",
                                  attention, mesh) for attention in ATTENTION}
    results["bytes"] = _traffic(ParallelDims.group(mesh, "cp"))
    return results


def _traffic(cp_group) -> tuple[int, int]:
    """(all-gather bytes one block's forward sends, the closed form) on two rows of documents 12 and 20."""
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.mixers.rglru import install_rglru_core, rglru_blocks
    from hybridpar.parallel.comm.stats import CommStats
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.context.recurrent.rglru import StatePassingRglru, rglru_state_bytes_per_layer
    from tests.distributed.context.mixer_cp import DOCS
    from tests.models.hf.rglru_models import build_recurrent_gemma

    model = build_recurrent_gemma()
    install_rglru_core(model)
    block = rglru_blocks(model)[0][1]
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    local = shard_inputs(input_ids=torch.zeros(2, DOCS[-1], dtype=torch.long), packed=packed, cp_group=cp_group).packed
    width, kernel = block.conv_1d.in_channels, block.conv_1d.kernel_size[0]
    with CommStats() as stats:
        StatePassingRglru(cp_group)(block, torch.randn(2, DOCS[-1] // 2, width, dtype=torch.float64), local)
    return stats.bytes_sent["all_gather"], rglru_state_bytes_per_layer(2, len(DOCS) - 1, 2, width, kernel, 8, 8)


def test_cp2_of_recurrent_gemma_matches_one_process():
    for rank_results in run_ranks(2, _run, timeout_s=300):
        sent, formula = rank_results.pop("bytes")
        assert sent == formula > 0, (sent, formula)
        for attention, r in rank_results.items():
            assert r["params"] == r["expected"] and r["cores"] == {"StatePassingRglru"}, (attention, r)
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (attention, r)
