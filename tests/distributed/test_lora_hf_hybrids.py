"""LoRA on the transformers Mamba2 hybrids people fine-tune, on packed rows, against each document
alone on one process (float64, real gloo ranks).

Granite 4.0-H (dense, NoPE; MoE, RoPE), Falcon-H1 (μP multipliers, gated norm) and Bamba, the tiny
models of ``tests/models/hf/hybrid_models.py`` with hybridpar's Mamba core in their mixers, take
``add_lora(r=4)`` on the default targets (attention q/k/v/o, the MLPs, the Mamba ``in_proj`` and
``out_proj``) with ``B`` perturbed so every adapter gradient is nonzero. Each layout runs a packed row
of four documents (7, 24, 13 and 16 real tokens, padded; documents cross the cp ranks' boundary)
through the trainer's loss (``pack_loss_sum``): tp=2 + SP, cp=2 with the ``state`` Mamba strategy
and ring attention, cp=2 with ``a2a`` and Ulysses, and dp_shard=2 (a row per rank); and Granite MoE and Falcon-H1 at cp=2 x tp=2 under ``full`` activation
checkpointing (4 ranks). The reference runs
every document alone, each in its own call, so a state or a key leaking across a boundary would show.
The loss and every adapter gradient (``canonical_state_dict(grads=True)``, gathered) agree to 1e-9,
and no base parameter has a gradient on any rank. One 2-rank launch for every case.
"""

from __future__ import annotations

import pytest
import torch

from hybridpar.models.lora import is_lora_parameter
from tests.distributed.context.test_model import PACKED_DOCS, make_batch
from tests.distributed.harness import run_ranks
from tests.distributed.test_lora import lora_model, parity_failures

MODELS = ("granite", "granite_moe", "falcon_h1", "bamba")
LAYOUTS = {  # name -> (ParallelDims kwargs, parallelize kwargs)
    "tp2-sp": (dict(tp=2), dict(sequence_parallel=True)),
    "cp2-state-ring": (dict(cp=2), dict(cp_mamba="state", cp_attention="ring")),
    "cp2-a2a-ulysses": (dict(cp=2), dict(cp_mamba="a2a", cp_attention="ulysses")),
    "dp_shard2": (dict(dp_shard=2), {}),
}
LAYOUTS_4 = {"cp2-tp2-state": (dict(cp=2, tp=2), dict(cp_mamba="state", activation_checkpointing="full"))}


def rows(dp: int) -> list:
    """``(ids, labels, packed)`` of one packed row per data-parallel rank."""
    from tests.models.hf.hybrid_models import VOCAB

    return [make_batch("packed", seed=40 + rank, vocab=VOCAB) for rank in range(dp)]


def reference(name: str, dp: int) -> dict:
    """One process: every (padded) document of every row alone; the loss over all their labels."""
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.train.trainer import pack_loss_sum

    model = lora_model(name)
    batches = rows(dp)
    count = sum(int((labels != -100).sum()) for _, labels, _ in batches)
    bounds = torch.cumsum(torch.tensor([0, *PACKED_DOCS]), 0).tolist()
    loss = 0.0
    for ids, labels, _ in batches:
        for start, end in zip(bounds, bounds[1:]):
            loss = loss + pack_loss_sum(model, shard_inputs(input_ids=ids[:, start:end], labels=labels[:, start:end]))[0]
    loss = loss / count
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def _parallel_case(name: str, dims_kwargs: dict, options: dict, mesh) -> dict:
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.parallel.state import canonical_state_dict
    from hybridpar.train.loss import global_sum, valid_token_count
    from hybridpar.train.trainer import pack_loss_sum

    dims = ParallelDims(**dims_kwargs)
    model = lora_model(name)
    if dims.cp == 1:  # as the trainer does: at cp > 1 parallelize installs the CP attention core
        use_hybridpar_attention(model)
    model = parallelize(model, dims, mesh=mesh, **options)
    dp_rank = ParallelDims.mesh(mesh, "dp").get_local_rank()
    ids, labels, packed = rows(dims.dp_shard)[dp_rank]
    dp_cp = ParallelDims.group(mesh, "dp_cp")
    local = shard_inputs(ids, labels=labels, packed=packed, cp_group=mesh["cp"].get_group(),
                         tp_group=mesh["tp"].get_group(), sequence_parallel=options.get("sequence_parallel", False))
    count = global_sum(valid_token_count(local.labels), dp_cp)
    loss_sum = pack_loss_sum(model, local)[0]
    (loss_sum / count).backward()
    base = [n for n, p in model.named_parameters() if not is_lora_parameter(n) and (p.grad is not None or p.requires_grad)]
    return {"loss": (global_sum(loss_sum.detach(), dp_cp) / count).item(), "grads": canonical_state_dict(model, grads=True),
            "base": base}


def _worker(rank: int, world_size: int, layouts: dict, models: tuple) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    results = {}
    for layout, (dims_kwargs, options) in layouts.items():
        mesh = ParallelDims(**dims_kwargs).build_mesh()
        for name in models:
            results[layout, name] = _parallel_case(name, dims_kwargs, options, mesh)
    return results


def _check(by_rank: list[dict], layouts: dict) -> None:
    references, failures = {}, []
    for (layout, name), got in by_rank[0].items():
        dp = layouts[layout][0].get("dp_shard", 1)
        want = references.setdefault((name, dp), reference(name, dp))
        assert len(want["grads"]) > 10, (layout, name)
        failures += parity_failures(f"{layout} {name}", got, want)
    failures += [f"rank {rank} {key}: base parameters with gradients {got['base'][:4]}"
                 for rank, results in enumerate(by_rank) for key, got in results.items() if got["base"]]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.timeout(900)
def test_lora_on_granite_falcon_h1_and_bamba_packed_at_tp_cp_fsdp_equals_each_document_alone():
    _check(run_ranks(2, _worker, LAYOUTS, MODELS, timeout_s=800), LAYOUTS)


@pytest.mark.timeout(600)
def test_lora_on_granite_moe_and_falcon_h1_at_cp2_tp2_with_checkpointing_equals_each_document_alone():
    """cp=2 x tp=2 on 4 ranks, state passing, every layer checkpointed (recomputed with its adapters)."""
    _check(run_ranks(4, _worker, LAYOUTS_4, ("granite_moe", "falcon_h1"), timeout_s=500), LAYOUTS_4)
