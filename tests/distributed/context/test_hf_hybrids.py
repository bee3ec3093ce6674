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

import torch

from tests.distributed.harness import run_ranks
from tests.distributed.tensor.hf_models import gradient_errors

TOL = 1e-9
DOCS = [0, 12, 32]
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
    import torch.distributed as dist

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.mamba_mixers import bridged_mixers, install_mamba_core
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.train.trainer import pack_loss_sum
    from tests.models.hf.hybrid_models import VOCAB, build_hybrid

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, DOCS[-1]), generator=gen)
    labels = torch.randint(0, VOCAB, (2, DOCS[-1]), generator=gen)
    labels[:, ::5] = -100
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    count = int((labels != -100).sum())

    reference = build_hybrid(name)
    install_mamba_core(reference)
    use_hybridpar_attention(reference)
    ref_loss = pack_loss_sum(reference, shard_inputs(input_ids=ids, labels=labels, packed=packed))[0] / count
    ref_loss.backward()

    model = build_hybrid(name)  # parallelize switches its Mamba2 mixers to hybridpar's core
    parallelize(model, ParallelDims(cp=2), mesh=mesh, cp_attention=attention, cp_mamba=mamba)
    cores = {type(m.core).__name__ for _, m in bridged_mixers(model)}
    cp_group = ParallelDims.group(mesh, "cp")
    sharded = shard_inputs(input_ids=ids, labels=labels, packed=packed, cp_group=cp_group)
    loss = pack_loss_sum(model, sharded)[0] / count
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_group)

    errors = gradient_errors(model, reference)
    worst = max(errors, key=errors.get)
    return {"loss_error": abs(total.item() - ref_loss.item()), "grad_error": errors[worst], "worst": worst,
            "params": len(errors), "expected": len(dict(reference.named_parameters())), "cores": cores}


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
