"""Tensor (+sequence) parallelism of transformers' Mamba2 hybrids by heads, against one process, float64.

Tiny models of ``tests/models/hf/hybrid_models.py``; ``parallelize`` puts hybridpar's core in their
Mamba2 mixers and shards them by heads (``parallel/tensor/hf_plans/moe_hybrid.py``: z/x/dt/conv/dt_bias/
A_log/D/norm by heads, B/C by groups, ``out_proj`` row-parallel; Falcon-H1's ``mup_vector`` cut
like its channels), attention and MLPs as their plans say, MoE experts on their intermediate dim.
One row of two packed documents (12 and 20 tokens; the trainer packs rows of one: a transformers
head under TP fails in DTensor on an empty [B > 1, 0, D] input). One 4-rank group runs tp=2 with
FSDP over dp=2 (the same tokens on both dp ranks), tp=2 with sequence parallelism, and cp=2 x tp=2
(FSDP over cp), for Granite 4.0-H MoE, Falcon-H1, NemotronH MoE, Bamba and Zamba2 (its shared attention block
sharded by heads; also two hybrid layers reusing one block with per-layer attention adapters and RoPE), Granite
dense (NoPE), Falcon-H1 with the plain ``y * silu(z)`` gate and dense NemotronH as transformers models, and Granite MoE and
Falcon-H1 with one B/C group (as their released checkpoints: B/C replicated, the gated norm's sum
of squares all-reduced; these variants not at plain tp=2): the loss and every parameter gradient (fused back to transformers' names,
``canonical_state_dict``) equal the one-process model's to 1e-9. The same group checks the
``ValueError`` for heads not divisible by tp, raised before any collective. Each rank computes a
share of the one-process references and the group gathers them (each model's once, not on every rank).
"""

from __future__ import annotations

import torch

from tests.distributed.harness import run_ranks

TOL = 1e-9
DOCS = [0, 12, 32]
MODELS = ("falcon_h1", "nemotron_h_moe", "granite_moe", "granite_moe_g1", "falcon_h1_g1", "bamba", "zamba2",
          "zamba2_shared", "granite", "falcon_h1_gate", "nemotron_h")  # the last three: dense, the plain gate
LAYOUTS = (("tp2_sp", dict(dp_shard=2, tp=2), True), ("tp2", dict(dp_shard=2, tp=2), False),
           ("cp2_tp2", dict(cp=2, tp=2), False))
# one B/C group, the plain gate, dense MLPs: not at plain tp2 (+ FSDP), which adds to tp2 + SP only the
# unsharded residual stream that their base models (Granite MoE, Falcon-H1, NemotronH MoE) hold there
VARIANTS = ("granite_moe_g1", "falcon_h1_g1", "falcon_h1_gate", "granite", "nemotron_h")


def _batch():
    from hybridpar.data.thd import PackedSeqParams

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (1, DOCS[-1]), generator=gen)
    labels = torch.randint(0, 97, (1, DOCS[-1]), generator=gen)
    labels[:, ::5] = -100
    return ids, labels, PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))


def _reference(name) -> tuple[float, dict]:
    from hybridpar.models.hf.float64 import keep_float64
    from hybridpar.models.hf.mixers.mamba2 import install_mamba_core
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.train.trainer import pack_loss_sum
    from tests.models.hf.hybrid_models import build_hybrid

    ids, labels, packed = _batch()
    model = keep_float64(build_hybrid(name))  # float64 throughout, as the trainer's float64 models
    install_mamba_core(model)
    use_hybridpar_attention(model)
    loss = pack_loss_sum(model, shard_inputs(input_ids=ids, labels=labels, packed=packed))[0] / int((labels != -100).sum())
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _case(name, dims, sequence_parallel, mesh, reference) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hybridpar.models.hf.float64 import keep_float64
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.parallel.state import canonical_state_dict
    from hybridpar.train.trainer import pack_loss_sum
    from tests.models.hf.hybrid_models import build_hybrid

    ids, labels, packed = _batch()
    model = use_hybridpar_attention(keep_float64(build_hybrid(name)))  # as the trainer does
    parallelize(model, dims, mesh=mesh, cp_mamba="state", cp_attention="allgather", sequence_parallel=sequence_parallel)
    sharded_mixers = sum(bool(getattr(m, "_hybridpar_head_sharded", False)) for m in model.modules())
    dt_bias = next(p for n, p in model.named_parameters() if n.endswith("dt_bias"))
    attention = [p for n, p in model.named_parameters() if n.endswith(("q_proj.weight", "down_proj.weight"))]
    cp_group, tp_group = ParallelDims.group(mesh, "cp"), ParallelDims.group(mesh, "tp")
    sharded = shard_inputs(input_ids=ids, labels=labels, packed=packed, cp_group=cp_group, tp_group=tp_group,
                           sequence_parallel=sequence_parallel)
    replicas = dims.dp_shard  # data-parallel ranks here see the same rows: FSDP sums their gradients
    loss = pack_loss_sum(model, sharded)[0] / (int((labels != -100).sum()) * replicas)
    loss.backward()
    total = loss.detach() * replicas
    dist.all_reduce(total, group=cp_group)
    ref_loss, ref_grads = reference
    grads = canonical_state_dict(model, grads=True)
    errors = {n: ((grads[n] - g).abs().max() / g.abs().max().clamp_min(1.0)).item() for n, g in ref_grads.items()
              if n in grads}
    worst = max(errors, key=errors.get)
    return {"loss_error": abs(total.item() - ref_loss), "grad_error": errors[worst], "worst": worst,
            "grads": len(errors), "expected": len(ref_grads), "sharded_mixers": sharded_mixers,
            "dt_bias_tp": repr(dt_bias.placements[-1]) if isinstance(dt_bias, DTensor) else "plain",
            "attention_mlp_tp": sorted({repr(p.placements[-1]) if isinstance(p, DTensor) else "plain" for p in attention})}


def _errors(mesh) -> dict:
    import transformers as hf

    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from tests.models.hf.hybrid_models import _NEMOTRON

    config = hf.NemotronHConfig(layers_block_type=["mamba", "attention", "mlp"],
                                **{**_NEMOTRON, "mamba_num_heads": 3, "n_groups": 1})
    model = hf.NemotronHForCausalLM(config).to(torch.float64)
    out = {"heads": None}
    try:
        parallelize(model, ParallelDims(dp_shard=2, tp=2), mesh=mesh)
    except ValueError as error:
        out["heads"] = str(error)
    return out


def _run(rank, world_size) -> dict:
    import torch.distributed as dist

    from hybridpar.parallel.dims import ParallelDims

    mine = {name: _reference(name) for name in MODELS[rank::world_size]}  # each reference once, not per rank
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    references = {name: ref for part in gathered for name, ref in part.items()}
    out = {}
    for label, sizes, sp in LAYOUTS:
        dims = ParallelDims(**sizes)
        mesh = dims.build_mesh()
        for name in MODELS:
            if not (label == "tp2" and name in VARIANTS):
                out[(label, name)] = _case(name, dims, sp, mesh, references[name])
    out["errors"] = _errors(ParallelDims(dp_shard=2, tp=2).build_mesh())
    return out


def test_tp_and_cp_tp_of_transformers_hybrids_match_one_process():
    from tests.models.hf.hybrid_models import MIXERS

    for rank_results in run_ranks(4, _run, timeout_s=600):
        errors = rank_results.pop("errors")
        heads = errors["heads"]
        assert heads is not None and "num_heads=3" in heads and "tp=2" in heads and "one of [1, 3]" in heads, heads
        for (label, name), r in rank_results.items():
            assert r["grads"] == r["expected"], (label, name, r)
            assert r["sharded_mixers"] == MIXERS[name] and r["dt_bias_tp"] == "Shard(dim=0)", (label, name, r)
            assert "plain" not in r["attention_mlp_tp"] and "Replicate()" not in r["attention_mlp_tp"], (label, name, r)
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (label, name, r)
