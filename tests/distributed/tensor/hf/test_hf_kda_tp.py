"""Tensor (+sequence) parallelism of Kimi Linear (KDA layers and MLA by heads) against one process, float64.

The tiny Kimi Linear of ``tests/models/hf/kda_models.py`` (a KDA layer with a dense MLP, an MLA layer and a
second KDA layer with MoE; 4 linear heads, 4 attention heads) through ``parallelize`` at tp=2 and tp=2 + SP
on 2 gloo ranks, one row of two packed documents (12 and 20 tokens): the loss and every parameter gradient
(``canonical_state_dict``: conv1d fused back from its q, k, v components) equal the one-process model's to
1e-9; on 4 ranks at cp=2 x tp=2 (FSDP over cp) with the ``a2a`` and ``state`` CP strategies on the local
heads too. ``KDAHeadParallel`` (``parallel/tensor/hf_plans/kimi_linear.py``) shards the KDA layers.
"""

from __future__ import annotations

import torch

from tests.distributed.harness import run_ranks

TOL = 1e-9
DOCS = [0, 12, 32]


def _case(sizes: dict, sp: bool, mesh, strategy: str = "a2a") -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.mixers.kda import install_kda_core
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.parallel.state import canonical_state_dict
    from hybridpar.train.trainer import pack_loss_sum
    from tests.models.hf.kda_models import VOCAB, build_kda

    gen = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(0, VOCAB, (1, DOCS[-1]), generator=gen) for _ in range(2))
    labels[:, ::5] = -100
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    count = int((labels != -100).sum())
    reference = build_kda()
    install_kda_core(reference)
    use_hybridpar_attention(reference)
    want = pack_loss_sum(reference, shard_inputs(input_ids=ids, labels=labels, packed=packed))[0] / count
    want.backward()
    model = build_kda()
    install_kda_core(model)
    use_hybridpar_attention(model)
    dims = ParallelDims(**sizes)
    parallelize(model, dims, mesh=mesh, sequence_parallel=sp, cp_mamba=strategy)
    kda, mla = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    def tp_placement(param):  # its placement on the tp mesh dim (FSDP adds its own dims)
        return param.placements[param.device_mesh.mesh_dim_names.index("tp")] if isinstance(param, DTensor) else None

    sharded = {name: tp_placement(p) is not None and tp_placement(p).is_shard() for name, p in
               [("conv_q", kda.conv1d.weight_q), ("f_b", kda.forget_gate.f_b_proj.weight),
                ("A_log", kda.forget_gate.A_log), ("kv_b", mla.kv_b_proj.weight)]}
    replicated = tp_placement(kda.forget_gate.f_a_proj.weight) == Replicate()
    inputs = shard_inputs(input_ids=ids, labels=labels, packed=packed, cp_group=ParallelDims.group(mesh, "cp"),
                          tp_group=ParallelDims.group(mesh, "tp"),
                          sequence_parallel=sp)
    replicas = dims.dp_shard  # data-parallel ranks see the same row: FSDP sums their gradients
    loss = pack_loss_sum(model, inputs)[0] / (count * replicas)
    loss.backward()
    total = loss.detach() * replicas
    dist.all_reduce(total, group=ParallelDims.group(mesh, "cp"))
    grads = canonical_state_dict(model, grads=True)
    errors = {n: ((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1.0)).item()
              for n, p in reference.named_parameters() if p.grad is not None}
    return {"loss_error": abs(total.item() - want.item()), "grad_errors": errors, "sharded": sharded,
            "replicated": replicated, "names_diff": sorted(set(canonical_state_dict(model, grads=True)) ^ set(dict(reference.named_parameters()))),
            "expected": sum(p.grad is not None for p in reference.parameters())}


def _run(rank, world_size, sizes, cases) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    torch.set_num_threads(1)
    mesh = ParallelDims(**sizes).build_mesh()
    return {(sp, strategy): _case(sizes, sp, mesh, strategy) for sp, strategy in cases}


def test_tp2_and_sp_of_kimi_linear_match_one_process():
    _assert_exact(run_ranks(2, _run, dict(tp=2), [(False, "a2a"), (True, "a2a")], timeout_s=300))


def test_cp2_tp2_of_kimi_linear_matches_one_process():
    cases = [(False, "a2a"), (False, "state")]
    _assert_exact(run_ranks(4, _run, dict(cp=2, tp=2), cases, timeout_s=300))


def _assert_exact(results) -> None:
    for rank_results in results:
        for sp, r in rank_results.items():
            assert all(r["sharded"].values()) and r["replicated"] and not r["names_diff"], (sp, r["sharded"], r["names_diff"][:6])
            assert len(r["grad_errors"]) == r["expected"], sp
            worst = max(r["grad_errors"], key=r["grad_errors"].get)
            assert r["loss_error"] < TOL and r["grad_errors"][worst] < TOL, (sp, r["loss_error"], worst,
                                                                            r["grad_errors"][worst])


def test_heads_that_tp_or_cp_do_not_divide_are_refused_in_one_line():
    import pytest

    from hybridpar.models.hf.mixers.kda import install_kda_core
    from hybridpar.parallel.context.recurrent.kda import validate_kda_parallel
    from hybridpar.parallel.tensor.hf_plans.kimi_linear import KDAHeadParallel
    from tests.models.hf.kda_models import build_kda

    model = build_kda(heads=2)
    layer = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match=r"^[^\n]*switched by install_kda_core[^\n]*$"):
        KDAHeadParallel().check("model.layers.0.self_attn", layer, 2)
    install_kda_core(model)
    with pytest.raises(ValueError, match=r"^[^\n]*2 heads are not divisible by tp=4[^\n]*$"):
        validate_kda_parallel(model, 1, 4, "a2a")
    with pytest.raises(ValueError, match=r"^[^\n]*2 heads are not divisible by tp=4[^\n]*$"):
        KDAHeadParallel().check("model.layers.0.self_attn", layer, 4)
    validate_kda_parallel(model, 2, 1, "a2a")  # 2 heads over cp=2
    validate_kda_parallel(model, 2, 2, "state")  # state passing has no head rule
    with pytest.raises(ValueError, match=r"^[^\n]*splits its 1 heads over the CP group, which cp=2 [^\n]*$"):
        validate_kda_parallel(model, 2, 2, "a2a")  # 1 local head at tp=2
