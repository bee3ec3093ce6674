"""Tensor (+sequence) parallelism of Mamba, FalconMamba and Jamba (attention, experts) against one process, float64.

Tiny models of ``tests/models/hf/mamba1_models.py``; ``parallelize`` switches their Mamba1 mixers to
hybridpar's selective scan, stores ``in_proj`` per component ``x, z`` and shards each mixer by channel
(``parallel/tensor/hf_plans/mamba1.py``: ``in_proj`` rows, conv, ``dt_proj``, ``A_log``, ``D`` by
channel, ``x_proj`` row-parallel with its output all-reduced, ``out_proj`` row-parallel), Jamba's
attention by heads, its MLPs and experts on their intermediate dim. One row of two packed documents
(12 and 20 tokens). The loss and every parameter gradient (fused back to transformers' names,
``canonical_state_dict``) equal the one-process model's to 1e-9: on 2 ranks at tp=2 and tp=2 + SP, and
on 4 ranks at cp=2 x tp=2 (state passing on the local channels, FSDP over cp); also Jamba at tp=2 + SP
with LoRA on ``in_proj`` (per component), ``dt_proj`` (by rows), ``out_proj`` and attention (every adapter
gradient). ``d_inner`` not divisible by tp and LoRA on ``x_proj`` are refused in one line before any
collective; so is transformers' own forward (a mask) on a sharded mixer.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks

TOL = 1e-9
DOCS = [0, 12, 32]
NAMES = ("mamba", "falcon_mamba", "jamba")
LORA = ("in_proj", "dt_proj", "out_proj", "q_proj", "o_proj")


def _model(name: str, lora: tuple[str, ...] = ()):
    from hybridpar.models.hf.mixers.mamba1 import install_mamba1_core
    from hybridpar.models.lora import add_lora
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from tests.models.hf.mamba1_models import build_mamba1

    model = build_mamba1(name)
    install_mamba1_core(model)
    if lora:
        add_lora(model, r=2, seed=0, targets=lora)
        with torch.no_grad():  # nonzero B: every adapter's A gets a gradient too
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.copy_(0.01 * torch.arange(param.numel(), dtype=param.dtype).view_as(param).sin())
    return use_hybridpar_attention(model)


def _case(name: str, sizes: dict, sp: bool, mesh, lora: tuple[str, ...] = ()) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.mixers.mamba1 import mamba1_mixers
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.train.trainer import pack_loss_sum
    from hybridpar.parallel.state import canonical_state_dict
    from tests.distributed.tensor.hf_models import relative_error
    from tests.models.hf.mamba1_models import VOCAB

    gen = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(0, VOCAB, (1, DOCS[-1]), generator=gen) for _ in range(2))
    labels[:, ::5] = -100
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    count = int((labels != -100).sum())
    reference = _model(name, lora)
    want = pack_loss_sum(reference, shard_inputs(input_ids=ids, labels=labels, packed=packed))[0] / count
    want.backward()
    model = _model(name, lora)
    parallelize(model, ParallelDims(**sizes), mesh=mesh, sequence_parallel=sp)
    mixers = [m for _, m in mamba1_mixers(model)]
    sharded = all(isinstance(m.in_proj.weight_x, DTensor) and m.in_proj.weight_x.placements[-1] == Shard(0)
                  and m.x_proj.weight.placements[-1].is_shard(1) for m in mixers)
    cp_group, tp_group = ParallelDims.group(mesh, "cp"), ParallelDims.group(mesh, "tp")
    inputs = shard_inputs(input_ids=ids, labels=labels, packed=packed, cp_group=cp_group, tp_group=tp_group,
                          sequence_parallel=sp)
    loss = pack_loss_sum(model, inputs)[0] / count
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    grads = canonical_state_dict(model, grads=True)  # DTensor gradients gathered, in_proj fused back
    errors = {n: relative_error(grads[n], p.grad) for n, p in reference.named_parameters() if p.grad is not None}
    refused = None
    if not sp and name == "mamba":  # transformers' own forward (a cache, a mask) cannot run on a shard
        try:
            mixers[0](torch.zeros(1, 4, 16, dtype=torch.float64), attention_mask=torch.ones(1, 4))
        except ValueError as error:
            refused = str(error)
        assert refused is not None and "sharded by channel" in refused, refused
    worst = max(errors, key=errors.get)
    return {"loss_error": abs(total.item() - want.item()), "grad_error": errors[worst], "worst": worst,
            "sharded": sharded and len(mixers) > 0, "grads": len(errors),
            "expected": len(list(reference.parameters())) if not lora else sum("lora_" in n for n, _ in
                                                                               reference.named_parameters())}


def _run(rank, world_size, layouts) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    torch.set_num_threads(1)
    out = {}
    for sizes, sp, names in layouts:
        mesh = ParallelDims(**sizes).build_mesh()
        for name in names:
            name, lora = (name, ()) if isinstance(name, str) else name
            out[(str(sizes), sp, name, lora)] = _case(name, sizes, sp, mesh, lora)
    return out


def _assert_exact(results):
    for rank_results in results:
        for case, r in rank_results.items():
            assert r["sharded"] and r["grads"] == r["expected"], (case, r)
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (case, r)


def test_tp2_and_sp_of_mamba1_models_match_one_process():
    adapted = ("jamba", LORA)  # LoRA on in_proj (per component), dt_proj (by rows), out_proj (rowwise), attention
    layouts = [(dict(tp=2), False, NAMES), (dict(tp=2), True, (*NAMES, adapted))]
    _assert_exact(run_ranks(2, _run, layouts, timeout_s=300))


def test_cp2_tp2_of_jamba_matches_one_process():
    _assert_exact(run_ranks(4, _run, [(dict(cp=2, tp=2), False, ("jamba",))], timeout_s=300))


def test_channels_not_divisible_by_tp_are_refused():
    from hybridpar.models.hf.mixers.mamba1 import install_mamba1_core
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import validate_parallelize
    from hybridpar.parallel.tensor.hf_plans.mamba1 import Mamba1ChannelParallel
    from tests.models.hf.mamba1_models import build_mamba1

    model = build_mamba1("jamba")
    mixer = model.model.layers[0].mamba
    with pytest.raises(ValueError, match=r"switched by install_mamba1_core"):
        Mamba1ChannelParallel().check("model.layers.0.mamba", mixer, 2)
    install_mamba1_core(model)
    with pytest.raises(ValueError, match=r"^[^\n]*'model.layers.0.mamba'.*d_inner=32 channels, not divisible by "
                                         r"tp=3.*one of \[1, 2, 4, 8, 16, 32\]\)\.$"):
        validate_parallelize(model, ParallelDims(tp=3))
    with pytest.raises(ValueError, match=r"d_inner=32 channels, not divisible by tp=3"):
        Mamba1ChannelParallel().check("model.layers.0.mamba", mixer, 3)


def test_lora_on_x_proj_is_refused_under_tp():
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import validate_parallelize

    model = _model("mamba", ("x_proj",))
    with pytest.raises(ValueError, match=r"^[^\n]*LoRA target 'backbone.layers.0.mixer.x_proj'.*parallel.tp=1\.$"):
        validate_parallelize(model, ParallelDims(tp=2))
    validate_parallelize(_model("mamba", ("in_proj", "dt_proj", "out_proj")), ParallelDims(tp=2))  # paired
