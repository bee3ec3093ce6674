"""Context parallelism (cp=2) of transformers' gated DeltaNet models against one process, float64.

Tiny Qwen3-Next, Qwen3.5 and OLMo-Hybrid models (``tests/models/hf/gdn_models.py``: 2 key heads, 4 value heads,
chunks of 8) with hybridpar's gated DeltaNet core (``install_gdn_core``); ``parallelize(cp=2)``
installs the all-to-all core (``parallel/context/gdn.py``) and an attention strategy. Two rows of
three packed documents (4, 12 and 16 tokens: cut across the ranks in zigzag order); the one-process
reference runs the same cores at cp=1 (``tests/models/hf/test_gdn_mixers.py`` proves it equals one
document per row). The loss and every parameter gradient agree to 1e-9. A Qwen3-Next with one key
head runs at cp=2 with the key head repeated. Bad layouts are refused in one line before any collective:
``cp_mamba=state``, tp=2, value heads cp does not divide.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.tensor.hf_models import gradient_errors

TOL = 1e-9
DOCS = [0, 4, 16, 32]
CASES = [("qwen3_next", "allgather", 2), ("qwen3_5", "ulysses", 2), ("qwen3_next", "ulysses", 1), ("olmo_hybrid", "ring", 2)]


def _build(name: str, k_heads: int):
    from tests.models.hf.gdn_models import build_gdn

    return build_gdn(name, k_heads=k_heads)


def _case(name, attention, k_heads, mesh) -> dict:
    import torch.distributed as dist

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.gdn_mixers import gdn_layers, install_gdn_core
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.train.trainer import pack_loss_sum
    from tests.models.hf.gdn_models import VOCAB

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, DOCS[-1]), generator=gen)
    labels = torch.randint(0, VOCAB, (2, DOCS[-1]), generator=gen)
    labels[:, ::5] = -100
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    count = int((labels != -100).sum())

    reference = _build(name, k_heads)
    install_gdn_core(reference)
    use_hybridpar_attention(reference)
    ref_loss = pack_loss_sum(reference, shard_inputs(input_ids=ids, labels=labels, packed=packed))[0] / count
    ref_loss.backward()

    model = _build(name, k_heads)  # parallelize switches its gated DeltaNets to hybridpar's core
    parallelize(model, ParallelDims(cp=2), mesh=mesh, cp_attention=attention, cp_mamba="a2a")
    cores = {type(m.core).__name__ for _, m in gdn_layers(model)}
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


def _refusals(mesh) -> dict:
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from tests.models.hf.gdn_models import build_gdn

    found = {}
    for label, dims, kwargs, model in [
        ("state", ParallelDims(cp=2), {"cp_mamba": "state"}, build_gdn("qwen3_next")),
        ("tp", ParallelDims(tp=2), {}, build_gdn("qwen3_next")),
        ("heads", ParallelDims(cp=2), {}, build_gdn("qwen3_next", v_heads=3, k_heads=1)),
    ]:
        try:
            parallelize(model, dims, mesh=mesh, **kwargs)
            found[label] = None
        except ValueError as error:
            found[label] = str(error)
    return found


def _run(rank, world_size) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    mesh = ParallelDims(cp=2).build_mesh()
    results = {case: _case(*case, mesh) for case in CASES}
    results["refused"] = _refusals(mesh)
    return results


def test_cp2_of_gated_deltanet_models_matches_one_process():
    for rank_results in run_ranks(2, _run, timeout_s=300):
        refused = rank_results.pop("refused")
        assert "set parallel.cp_mamba=a2a" in refused["state"], refused
        assert "tensor parallelism is not supported for gated DeltaNet" in refused["tp"], refused
        assert "splits the 3 value heads" in refused["heads"], refused
        assert all(message and "\n" not in message for message in refused.values())
        for (name, _, _), r in rank_results.items():
            assert r["params"] == r["expected"], name
            assert r["cores"] == {"HiddenParallelGDN"}, (name, r["cores"])
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (name, r)
