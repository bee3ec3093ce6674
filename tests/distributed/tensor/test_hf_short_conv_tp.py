"""Tensor (+sequence) parallelism of LFM2, LFM2-MoE and LFM3 against one process, float64.

Tiny models of ``tests/models/hf/lfm_models.py``; ``parallelize`` switches their short convs to
hybridpar's conv, stores ``in_proj`` per component ``b, c, x`` and shards the short conv by channels
(``parallel/tensor/hf_plans/dense.py``: ``ShortConvChannelParallel``; ``out_proj`` row-parallel), attention
by heads (LFM3's per-head gate with them), MLPs and MoE experts on their intermediate dim. One row of
two packed documents (12 and 20 tokens). The loss and every parameter gradient (fused back to
transformers' names, ``canonical_state_dict``) equal the one-process model's to 1e-9: on 2 ranks at
tp=2 and tp=2 + SP (there LFM2 with a LoRA adapter on every linear layer, ``in_proj`` included); on 4
ranks with FSDP over dp=2 x tp=2 (the same tokens on both dp ranks) and cp=2 x tp=2 (the halo on the
local channels). Channels not divisible by tp are refused in one line before any collective.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks

TOL = 1e-9
DOCS = [0, 12, 32]


def _model(name: str, lora: bool):
    from hybridpar.models.hf.mixers.short_conv import install_short_conv
    from hybridpar.models.lora import add_lora
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from tests.models.hf.lfm_models import build_lfm

    model = build_lfm(name)
    install_short_conv(model)
    use_hybridpar_attention(model)
    if lora:
        add_lora(model, r=4, seed=0)
        with torch.no_grad():  # nonzero B: every adapter's A gets a gradient too
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.copy_(0.01 * torch.arange(param.numel(), dtype=param.dtype).view_as(param).sin())
    return model


def _case(name: str, lora: bool, sizes: dict, sp: bool, mesh) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.parallel.state import canonical_state_dict
    from hybridpar.train.trainer import pack_loss_sum
    from tests.models.hf.lfm_models import VOCAB

    gen = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(0, VOCAB, (1, DOCS[-1]), generator=gen) for _ in range(2))
    labels[:, ::5] = -100
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    count = int((labels != -100).sum())
    reference = _model(name, lora)
    want = pack_loss_sum(reference, shard_inputs(input_ids=ids, labels=labels, packed=packed))[0] / count
    want.backward()
    model = _model(name, lora)
    dims = ParallelDims(**sizes)
    parallelize(model, dims, mesh=mesh, sequence_parallel=sp)
    weight = model.model.layers[0].conv.in_proj.weight_b
    sharded = isinstance(weight, DTensor) and any(p.is_shard(0) for p in weight.placements)
    cp_group, tp_group = ParallelDims.group(mesh, "cp"), ParallelDims.group(mesh, "tp")
    inputs = shard_inputs(input_ids=ids, labels=labels, packed=packed, cp_group=cp_group, tp_group=tp_group,
                          sequence_parallel=sp)
    replicas = dims.dp_shard  # data-parallel ranks see the same row: FSDP sums their gradients
    loss = pack_loss_sum(model, inputs)[0] / (count * replicas)
    loss.backward()
    total = loss.detach() * replicas
    dist.all_reduce(total, group=cp_group)
    grads = canonical_state_dict(model, grads=True)
    errors = [((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1.0)).item()
              for n, p in reference.named_parameters() if p.grad is not None]
    return {"loss_error": abs(total.item() - want.item()), "grad_error": max(errors), "sharded": sharded,
            "grads": len(errors), "expected": sum(p.grad is not None for p in reference.parameters())}


def _run(rank, world_size, layouts) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    torch.set_num_threads(1)
    out = {}
    for sizes, sp, cases in layouts:
        mesh = ParallelDims(**sizes).build_mesh()
        for name, lora in cases:
            out[(str(sizes), sp, name, lora)] = _case(name, lora, sizes, sp, mesh)
    return out


def _assert_exact(results):
    for rank_results in results:
        for case, r in rank_results.items():
            assert r["sharded"] and r["grads"] == r["expected"], (case, r)
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (case, r)


def test_tp2_and_sp_of_short_conv_models_match_one_process():
    every = [("lfm2", False), ("lfm2_moe", False), ("lfm3", False)]
    layouts = [(dict(tp=2), False, every), (dict(tp=2), True, [("lfm2", True), ("lfm2_moe", False), ("lfm3", False)])]
    _assert_exact(run_ranks(2, _run, layouts, timeout_s=300))


def test_tp2_with_fsdp_over_dp_and_over_cp_matches_one_process():
    layouts = [(dict(dp_shard=2, tp=2), False, [("lfm2", False)]), (dict(cp=2, tp=2), False, [("lfm3", False)])]
    _assert_exact(run_ranks(4, _run, layouts, timeout_s=300))


def test_channels_not_divisible_by_tp_are_refused():
    from hybridpar.models.hf.mixers.short_conv import install_short_conv
    from hybridpar.parallel.tensor.hf_plans.dense import ShortConvChannelParallel
    from tests.models.hf.lfm_models import build_lfm

    model = build_lfm("lfm2")
    with pytest.raises(ValueError, match=r"switched by install_short_conv"):
        ShortConvChannelParallel().check("model.layers.0.conv", model.model.layers[0].conv, 2)
    install_short_conv(model)
    with pytest.raises(ValueError, match=r"^[^\n]*32 short-conv channels are not divisible by tp=3[^\n]*$"):
        ShortConvChannelParallel().check("model.layers.0.conv", model.model.layers[0].conv, 3)
