"""Tensor (+sequence) parallelism of LFM2, LFM2-MoE and LFM3 against one process, float64.

Tiny models of ``tests/models/hf/lfm_models.py``; ``parallelize(tp=2)`` switches their short convs to
hybridpar's conv and shards them by channels (``parallel/tensor/plans_hf.py``: ``in_proj`` in
``b | c | x`` thirds, the conv per channel, ``out_proj`` row-parallel), attention by heads (LFM3's
per-head gate with them), MLPs and MoE experts on their intermediate dim. One row of two packed
documents (12 and 20 tokens). The loss and every parameter gradient equal the one-process model's
to 1e-9, at tp=2 and tp=2 + SP. TP with FSDP (data or context parallelism) and channels not
divisible by tp are refused in one line before any collective.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks

TOL = 1e-9
DOCS = [0, 12, 32]
NAMES = ("lfm2", "lfm2_moe", "lfm3")


def _run(rank, world_size) -> dict:
    from torch.distributed.tensor import DTensor

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.short_conv import install_short_conv
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.parallel.state import canonical_state_dict
    from hybridpar.train.trainer import pack_loss_sum
    from tests.models.hf.lfm_models import VOCAB, build_lfm

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(0, VOCAB, (1, DOCS[-1]), generator=gen) for _ in range(2))
    labels[:, ::5] = -100
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    mesh = ParallelDims(tp=2).build_mesh()
    out = {}
    for name in NAMES:
        reference = build_lfm(name)
        install_short_conv(reference)
        use_hybridpar_attention(reference)
        want = pack_loss_sum(reference, shard_inputs(input_ids=ids, labels=labels, packed=packed))[0]
        want.backward()
        for sp in (False, True):
            model = use_hybridpar_attention(build_lfm(name, seed=0))
            parallelize(model, ParallelDims(tp=2), mesh=mesh, sequence_parallel=sp)
            conv = model.model.layers[0].conv
            sharded = isinstance(conv.conv.weight, DTensor) and conv.conv.weight.to_local().shape[0] == 16
            inputs = shard_inputs(input_ids=ids, labels=labels, packed=packed, tp_group=ParallelDims.group(mesh, "tp"),
                                  sequence_parallel=sp)
            loss = pack_loss_sum(model, inputs)[0]
            loss.backward()
            grads = canonical_state_dict(model, grads=True)
            errors = [((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1.0)).item()
                      for n, p in reference.named_parameters() if p.grad is not None]
            out[(name, sp)] = {"loss_error": abs(loss.item() - want.item()), "grad_error": max(errors),
                               "grads": len(errors), "sharded": sharded}
    return out


def test_tp2_and_sp_of_short_conv_models_match_one_process():
    for rank_results in run_ranks(2, _run, timeout_s=300):
        for case, r in rank_results.items():
            assert r["sharded"] and r["grads"] > 20, (case, r)
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (case, r)


@pytest.mark.parametrize("dims", [dict(dp_shard=2, tp=2), dict(cp=2, tp=2)])
def test_tp_with_fsdp_is_refused_in_one_line(dims):
    from hybridpar.models.hf.short_conv import install_short_conv
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import validate_parallelize
    from tests.models.hf.lfm_models import build_lfm

    model = build_lfm("lfm2")
    install_short_conv(model)
    with pytest.raises(ValueError, match=r"^\['model.layers.\*.conv.in_proj'\]: PackedColwiseParallel[^\n]*$"):
        validate_parallelize(model, ParallelDims(**dims))


def test_channels_not_divisible_by_tp_are_refused():
    from hybridpar.parallel.tensor.linear_styles import ConvChannelParallel
    from tests.models.hf.lfm_models import build_lfm

    conv = build_lfm("lfm2").model.layers[0].conv.conv
    with pytest.raises(ValueError, match=r"32 short-conv channels are not divisible by tp=3"):
        ConvChannelParallel().check("model.layers.0.conv.conv", conv, 3)
