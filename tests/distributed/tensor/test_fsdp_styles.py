"""The new tensor-parallel styles under FSDP: ``parallelize`` at dp_shard=2 x tp=2 with sequence
parallelism, against the single-process model, float64.

FSDP shards dim 0 of every (TP-local) parameter, so each TP layout must compose with it:
GPT-2's ``Conv1D`` weights (``Shard(1)``/``Shard(0)``) and packed ``c_attn`` (``_StridedShard(1)``,
bias replicated), Mixtral's experts (``_StridedShard(1)`` / ``Shard(2)``: the expert dim 0 is
FSDP's). Plain ``Shard(0)``/``Shard(1)`` projections (Phi3's gathered ones too) are covered by
``test_fsdp``; a packed ``nn.Linear`` weight (``_StridedShard(0)``) is refused with FSDP
(``tests/parallel/tensor/test_check.py``). Each data-parallel rank
runs its own batch; FSDP sums the gradients (divide factor 1), so the reference gradient is
the sum over both batches. Loss and every gradient (``full_tensor``) must match to 1e-9.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.distributed.harness import run_ranks

TOL = 1e-9
MODELS = ("gpt2", "mixtral")


def _batch(dp_rank: int):
    from tests.distributed.tensor.hf_models import SEQ, VOCAB, model_inputs

    inputs = model_inputs()
    generator = torch.Generator().manual_seed(10 + dp_rank)
    inputs["input_ids"] = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    return inputs, torch.randn(2, SEQ, VOCAB, dtype=torch.float64, generator=generator)


def fsdp_tp_checks(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import DTensor

    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from tests.distributed.tensor.hf_models import build_model, relative_error

    dims = ParallelDims(dp_shard=2, tp=2)
    mesh = dims.build_mesh()
    dp_rank = mesh["dp_shard"].get_local_rank()
    results = {}
    for name in MODELS:
        reference = build_model(name)
        ref_loss = 0.0
        for d in range(dims.dp_shard):  # the sum of both ranks' losses: what FSDP's gradients are
            inputs, weights = _batch(d)
            loss = (reference(**inputs).logits * weights).sum()
            loss.backward()
            ref_loss = ref_loss + loss.detach()
        model = build_model(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parallelize(model, dims, mesh=mesh, sequence_parallel=True)
        inputs, weights = _batch(dp_rank)
        loss = (model(**inputs).logits * weights).sum()
        loss.backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=mesh["dp_shard"].get_group())
        ref_params = dict(reference.named_parameters())
        grads = {n: relative_error(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad, ref_params[n].grad)
                 for n, p in model.named_parameters()}
        results[name] = {"loss_error": relative_error(total, ref_loss), "grad_errors": grads}
    return results


@pytest.fixture(scope="module")
def fsdp_tp_results():
    return run_ranks(4, fsdp_tp_checks, timeout_s=500)


@pytest.mark.parametrize("name", MODELS)
def test_tp_styles_compose_with_fsdp(fsdp_tp_results, name):
    for result in fsdp_tp_results:
        case = result[name]
        assert case["loss_error"] < TOL
        worst = max(case["grad_errors"], key=case["grad_errors"].get)
        assert case["grad_errors"][worst] < TOL, f"{worst}: {case['grad_errors'][worst]:.3e}"
