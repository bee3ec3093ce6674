"""Context parallelism (cp=2) of Mamba, FalconMamba and Jamba (attention, experts) against one process, float64.

Tiny models of ``tests/models/hf/mamba1_models.py``; ``parallelize(cp=2)`` switches their Mamba1 mixers
to hybridpar's selective scan and installs state passing (``parallel/context/mamba_state.py``) as their
``core``. Two rows of two packed documents (12 and 20 tokens, zigzag chunks of 3 and 5: the conv
kernel of 4 reads a halo of 3, a whole chunk). The one-process reference runs the same model at cp=1
(``tests/models/hf/test_mamba1_mixers.py`` proves it equals transformers on each document alone).
The loss and every parameter gradient agree to 1e-9; FSDP2 shards the model over the CP ranks.
Tensor parallelism of a Mamba1 mixer is refused in one line before any mesh.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.tensor.hf_models import gradient_errors

TOL = 1e-9
DOCS = [0, 12, 32]
CASES = [("mamba", "allgather"), ("falcon_mamba", "allgather"), ("jamba", "ulysses")]


def _case(name, attention, mesh) -> dict:
    import torch.distributed as dist

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.mamba1_mixers import install_mamba1_core, mamba1_mixers
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.train.trainer import pack_loss_sum
    from tests.models.hf.mamba1_models import VOCAB, build_mamba1

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, DOCS[-1]), generator=gen)
    labels = torch.randint(0, VOCAB, (2, DOCS[-1]), generator=gen)
    labels[:, ::5] = -100
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    count = int((labels != -100).sum())

    reference = build_mamba1(name)
    install_mamba1_core(reference)
    use_hybridpar_attention(reference)
    ref_loss = pack_loss_sum(reference, shard_inputs(input_ids=ids, labels=labels, packed=packed))[0] / count
    ref_loss.backward()

    model = build_mamba1(name)
    parallelize(model, ParallelDims(cp=2), mesh=mesh, cp_attention=attention)
    cores = {type(m.core).__name__ for _, m in mamba1_mixers(model)}
    cp_group = ParallelDims.group(mesh, "cp")
    loss = pack_loss_sum(model, shard_inputs(input_ids=ids, labels=labels, packed=packed, cp_group=cp_group))[0] / count
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    errors = gradient_errors(model, reference)
    worst = max(errors, key=errors.get)
    return {"loss_error": abs(total.item() - ref_loss.item()), "grad_error": errors[worst], "worst": worst,
            "params": len(errors), "expected": len(dict(reference.named_parameters())), "cores": cores}


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


def test_tensor_parallel_mamba1_is_refused_before_any_mesh():
    from hybridpar.models.hf.mamba1_mixers import install_mamba1_core
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import validate_parallelize
    from tests.models.hf.mamba1_models import build_mamba1

    model = build_mamba1("jamba")
    install_mamba1_core(model)
    with pytest.raises(ValueError, match=r"Mamba1 mixer 'model.layers.0.mamba'.*tp=2\): use parallel.tp=1") as error:
        validate_parallelize(model, ParallelDims(tp=2))
    assert "\n" not in str(error.value)
