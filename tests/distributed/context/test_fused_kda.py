"""The fused KDA rule (``models/linear/kda_fused.py``) behind both Kimi Delta Attention CP strategies, on CPU.

FLA's contract written out in float64 (``tests/models/linear/kda_contract.py``) stands in for the
kernel (``use_stand_in(..., family="kda")``), so the fused op runs where FLA's ``chunk_kda`` would on a
GPU: ``a2a`` (heads exchanged, the rule on whole sequences with global documents) and ``state`` (each
chunk-padded segment one of FLA's sequences, fed ``[I | 0]``, its final ``[M | S_end|0]`` read). The
tiny Kimi Linear (``tests/models/hf/kda_models.py``) at cp=2 on two rows of three packed documents:
the loss and every parameter gradient equal the one-process pure-PyTorch model's to 1e-9, and the
stand-in ran on every rank for every KDA layer.
"""

from __future__ import annotations

import torch

from tests.distributed.context.test_hf_kda import DOCS, TOL
from tests.distributed.harness import run_ranks

# (attention strategy for the MLA layer, KDA strategy, chunk of the rule): chunks of 2 put segments across chunks
CASES = [("allgather", "a2a", 8), ("ring", "state", 2)]


def _loss(model, ids, labels, packed, count, cp_group=None):
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.train.trainer import pack_loss_sum

    loss = pack_loss_sum(model, shard_inputs(input_ids=ids, labels=labels, packed=packed, cp_group=cp_group))[0] / count
    loss.backward()
    return loss.detach()


def _case(attention, strategy, chunk, mesh, calls) -> dict:
    import torch.distributed as dist

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.mixers.kda import install_kda_core
    from hybridpar.models.mamba.fused import use_stand_in
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from tests.distributed.tensor.hf_models import gradient_errors
    from tests.models.hf.kda_models import VOCAB, build_kda

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, DOCS[-1]), generator=gen)
    labels = torch.randint(0, VOCAB, (2, DOCS[-1]), generator=gen)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    count = int((labels != -100).sum())

    reference = build_kda(chunk=chunk)  # one process, the pure core
    install_kda_core(reference)
    use_hybridpar_attention(reference)
    ref_loss = _loss(reference, ids, labels, packed, count)

    model = build_kda(chunk=chunk)
    parallelize(model, ParallelDims(cp=2), mesh=mesh, cp_attention=attention, cp_mamba=strategy)
    cp_group = ParallelDims.group(mesh, "cp")
    calls.clear()
    with use_stand_in("counted", family="kda"):
        loss = _loss(model, ids, labels, packed, count, cp_group)
    dist.all_reduce(loss, group=cp_group)
    errors = gradient_errors(model, reference)
    worst = max(errors, key=errors.get)
    return {"loss_error": abs(loss.item() - ref_loss.item()), "grad_error": errors[worst], "worst": worst,
            "params": len(errors), "calls": len(calls)}


def _run(rank, world_size) -> dict:
    from hybridpar.models.linear.kda_fused import register_kda_rule
    from hybridpar.parallel.dims import ParallelDims
    from tests.models.linear.kda_contract import kda_contract

    calls = []
    register_kda_rule("counted", lambda *args, **kwargs: calls.append(1) or kda_contract(*args, **kwargs))
    mesh = ParallelDims(cp=2).build_mesh()
    return {case: _case(*case, mesh, calls) for case in CASES}


def test_fused_rule_under_both_cp_strategies_matches_one_process():
    from tests.models.hf.kda_models import LAYERS

    for rank_results in run_ranks(2, _run, timeout_s=300):
        for case, r in rank_results.items():
            assert r["calls"] == 2 * LAYERS, (case, r)  # forward and the backward's recompute, every layer
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (case, r)
