"""Tensor (+sequence) parallelism of gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, OLMo-Hybrid) against one process, float64.

Tiny models of ``tests/models/hf/gdn_models.py`` (2 key heads, 4 value heads); ``parallelize`` switches
their gated DeltaNets to hybridpar's core, stores ``conv1d`` (Qwen3.5: ``in_proj_qkv``) per component
q, k, v and shards them by heads (``parallel/tensor/hf_plans/dense.py``: ``GDNHeadParallel``; ``out_proj``
row-parallel), the gated attention by heads, MLPs and MoE experts on their intermediate dim. One row of
two packed documents (12 and 20 tokens). The loss and every parameter gradient (fused back to
transformers' names, ``canonical_state_dict``) equal the one-process model's to 1e-9: on 2 ranks at
tp=2 and tp=2 + SP for Qwen3-Next, Qwen3.5 (dense, MoE) and OLMo-Hybrid, and with a LoRA adapter on
every projection (B sharded by rows like its base, Qwen3.5's in_proj_qkv per component); on 4 ranks with
cp=2 x tp=2 (FSDP over cp) for Qwen3-Next, Qwen3.5-MoE and OLMo-Hybrid. Key heads not divisible by tp, and a gated DeltaNet model type without a
head-sharding plan, are refused in one line before any collective.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks

TOL = 1e-9
DOCS = [0, 12, 32]


LORA = {"qwen3_next": ["in_proj_qkvz", "in_proj_ba"], "qwen3_5": ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"]}


def _model(name: str):
    """``name``, or ``name+lora``: a LoRA adapter on every gated DeltaNet projection, out_proj and q_proj."""
    from hybridpar.models.hf.mixers.gdn import install_gdn_core
    from hybridpar.models.lora import add_lora
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from tests.models.hf.gdn_models import build_gdn

    name, _, lora = name.partition("+")
    model = build_gdn(name)
    install_gdn_core(model)
    use_hybridpar_attention(model)
    if lora:
        add_lora(model, r=4, seed=0, targets=[*LORA[name], "out_proj", "q_proj"])
        with torch.no_grad():  # nonzero B: every adapter's A gets a gradient too
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.copy_(0.01 * torch.arange(param.numel(), dtype=param.dtype).view_as(param).sin())
    return model


def _case(name: str, sizes: dict, sp: bool, mesh) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.parallel.state import canonical_state_dict
    from hybridpar.train.trainer import pack_loss_sum
    from tests.models.hf.gdn_models import VOCAB

    gen = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(0, VOCAB, (1, DOCS[-1]), generator=gen) for _ in range(2))
    labels[:, ::5] = -100
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    count = int((labels != -100).sum())
    reference = _model(name)
    want = pack_loss_sum(reference, shard_inputs(input_ids=ids, labels=labels, packed=packed))[0] / count
    want.backward()
    model = _model(name)
    dims = ParallelDims(**sizes)
    parallelize(model, dims, mesh=mesh, sequence_parallel=sp)
    weight = model.model.layers[0].linear_attn.conv1d.weight_v
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
    names = set(canonical_state_dict(model))
    errors = [((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1.0)).item()
              for n, p in reference.named_parameters() if p.grad is not None]
    return {"loss_error": abs(total.item() - want.item()), "grad_error": max(errors), "sharded": sharded,
            "grads": len(errors), "expected": sum(p.grad is not None for p in reference.parameters()),
            "names_equal": names == set(reference.state_dict())}


def _run(rank, world_size, layouts) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    torch.set_num_threads(1)
    out = {}
    for sizes, sp, cases in layouts:
        mesh = ParallelDims(**sizes).build_mesh()
        for name in cases:
            out[(str(sizes), sp, name)] = _case(name, sizes, sp, mesh)
    return out


def _assert_exact(results):
    for rank_results in results:
        for case, r in rank_results.items():
            assert r["sharded"] and r["grads"] == r["expected"] and r["names_equal"], (case, r)
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (case, r)


def test_tp2_and_sp_of_gated_deltanet_models_match_one_process():
    layouts = [(dict(tp=2), False, ["qwen3_next", "qwen3_5", "olmo_hybrid", "qwen3_next+lora"]),
               (dict(tp=2), True, ["qwen3_next_moe", "qwen3_5_moe", "olmo_hybrid", "qwen3_5+lora"])]
    _assert_exact(run_ranks(2, _run, layouts, timeout_s=300))


def test_cp2_tp2_of_gated_deltanet_models_matches_one_process():
    cases = ["qwen3_next", "qwen3_5_moe", "olmo_hybrid"]
    _assert_exact(run_ranks(4, _run, [(dict(cp=2, tp=2), False, cases)], timeout_s=300))


def test_key_heads_not_divisible_by_tp_and_model_types_without_a_plan_are_refused():
    from hybridpar.models.hf.mixers.gdn import install_gdn_core
    from hybridpar.parallel.context.recurrent.gdn import validate_gdn_parallel
    from hybridpar.parallel.tensor.hf_plans.dense import GDNHeadParallel
    from tests.models.hf.gdn_models import build_gdn

    model = build_gdn("qwen3_next")
    layer = model.model.layers[0].linear_attn
    with pytest.raises(ValueError, match=r"switched by install_gdn_core"):
        GDNHeadParallel().check("model.layers.0.linear_attn", layer, 2)
    install_gdn_core(model)
    with pytest.raises(ValueError, match=r"^[^\n]*2 key heads \(4 value heads\) are not divisible by tp=4[^\n]*$"):
        validate_gdn_parallel(model, 1, 4, "a2a")
    with pytest.raises(ValueError, match=r"^[^\n]*2 key heads \(4 value heads\) are not divisible by tp=4[^\n]*$"):
        GDNHeadParallel().check("model.layers.0.linear_attn", layer, 4)
    validate_gdn_parallel(model, 1, 2, "a2a")  # 1 key head and 2 value heads a rank
    validate_gdn_parallel(model, 2, 2, "a2a")  # cp=2 on the local heads: the key head repeated
    with pytest.raises(ValueError, match=r"^[^\n]* at tp=2: [^\n]*$"):
        validate_gdn_parallel(model, 4, 2, "a2a")  # 2 local value heads over cp=4
    model.config.model_type = "a_new_gdn_model"  # a gated DeltaNet model type without a head-sharding plan
    with pytest.raises(ValueError, match=r"^[^\n]*not 'a_new_gdn_model'; use parallel.tp=1[^\n]*$"):
        validate_gdn_parallel(model, 1, 2, "a2a")
