"""Activation checkpointing under tensor (+sequence) parallelism of transformers models, against one process, float64.

``parallelize`` applies the TP plan, then wraps every decoder layer in a non-reentrant checkpoint (``full`` or
``selective``): the layer's plan hooks (the DTensor entry of ``SummedBranchesLayer``, row-parallel ``Partial``
exits, replicated or sequence-parallel norms) are registered on the layer and its children, inside the wrapper,
so the backward's recomputation runs them again, with the same layouts. Falcon-H1 (attention + Mamba2 summed
before one reduction), Granite 4.0-H MoE (MoE block + shared MLP summed), Llama (a dense sequential plan) and
Mixtral (a MoE block: its experts all-reduce; under SP their partial sum is reduce-scattered at the block's exit) at
tp=2 and tp=2 + SP on 2 gloo ranks, one row of two packed documents: the loss and every parameter gradient
equal the one-process model's to 1e-9, and every layer is a checkpoint wrapper.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks

TOL = 1e-9
DOCS = [0, 12, 32]
MODELS = ("falcon_h1", "granite_moe", "llama", "mixtral")
HYBRIDS = ("falcon_h1", "granite_moe")  # tests/models/hf/hybrid_models; the others: tests/distributed/tensor/hf_models
POLICIES = ("full", "selective")


def _model(name: str):
    """The tiny float64 model; its Mamba2 mixers on hybridpar's core (documents reset it, as ``parallelize``'s)."""
    from hybridpar.models.hf.float64 import keep_float64
    from hybridpar.models.hf.mixers.mamba2 import install_mamba_core
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from tests.distributed.tensor.hf_models import build_model
    from tests.models.hf.hybrid_models import build_hybrid

    model = build_hybrid(name) if name in HYBRIDS else build_model(name)
    install_mamba_core(model)
    return use_hybridpar_attention(keep_float64(model))  # float64 throughout, as the trainer's float64 models


def _loss(model, tp_group=None, sequence_parallel: bool = False):
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.train.trainer import pack_loss_sum

    gen = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(0, 97, (1, DOCS[-1]), generator=gen) for _ in range(2))
    labels[:, ::5] = -100
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    inputs = shard_inputs(input_ids=ids, labels=labels, packed=packed, tp_group=tp_group,
                          sequence_parallel=sequence_parallel)
    loss = pack_loss_sum(model, inputs)[0] / int((labels != -100).sum())
    loss.backward()
    return loss.item()


def _run(rank: int, world_size: int) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from hybridpar.parallel.checkpointing import find_blocks
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from tests.distributed.tensor.hf_models import gradient_errors

    torch.set_num_threads(1)
    dims = ParallelDims(tp=2)
    mesh = dims.build_mesh()
    out = {}
    for name in MODELS:
        reference = _model(name)
        want = _loss(reference)
        for sp in (False, True):
            for policy in POLICIES:
                model = _model(name)
                parallelize(model, dims, mesh=mesh, sequence_parallel=sp, activation_checkpointing=policy)
                got = _loss(model, ParallelDims.group(mesh, "tp"), sp)
                errors = gradient_errors(model, reference)
                worst = max(errors, key=errors.get)
                out[(name, sp, policy)] = {
                    "loss_error": abs(got - want), "grad_error": errors[worst], "worst": worst,
                    "wrapped": all(isinstance(block, CheckpointWrapper) for block in find_blocks(model))}
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, _run, timeout_s=300)


@pytest.mark.parametrize("name", MODELS)
def test_checkpointed_tp_layers_match_one_process(results, name):
    for rank_results in results:
        for (model, sp, policy), r in rank_results.items():
            if model == name:
                assert r["wrapped"], (name, sp, policy)
                assert r["loss_error"] < TOL and r["grad_error"] < TOL, (name, sp, policy, r)
