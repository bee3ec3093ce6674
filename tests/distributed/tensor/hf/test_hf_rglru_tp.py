"""Tensor (+sequence) parallelism of RecurrentGemma (RG-LRU blocks and MQA by heads) against one process, float64.

The tiny RecurrentGemma of ``tests/models/hf/rglru_models.py`` (two RG-LRU blocks of 4 heads, then a local
sliding-window MQA layer with one KV head; tied embeddings) through ``parallelize``, one row of two packed
documents (12 and 20 tokens): the loss and every parameter gradient equal the one-process model's to 1e-9 on 2
gloo ranks at tp=2 and tp=2 + SP (``parallel/tensor/hf_plans/recurrent_gemma.py``: RG-LRU parameters by heads,
``k_proj``/``v_proj`` replicated with their gradient summed over TP), with LoRA on ``linear_x``, ``linear_y``,
``linear_out``, ``q_proj`` and ``o_proj`` (every adapter gradient), and on 4 ranks at cp=2 x tp=2 (RG-LRU state
passing on the local heads, ring attention, FSDP over cp). The tp=2 model's DCP checkpoint loads into a one-process
model under the same names. A tp that does not divide the heads, a LoRA on ``k_proj`` and a cache under TP are
refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks

TOL = 1e-9
DOCS = [0, 12, 32]
LORA = ("linear_x", "linear_y", "linear_out", "q_proj", "o_proj")


def _model(lora: tuple[str, ...] = (), seed: int = 0):
    from hybridpar.models.hf.mixers.rglru import install_rglru_core
    from hybridpar.models.lora import add_lora
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from tests.models.hf.rglru_models import build_recurrent_gemma

    model = build_recurrent_gemma(seed=seed)
    install_rglru_core(model)
    if lora:
        add_lora(model, r=2, seed=0, targets=lora)
        with torch.no_grad():  # nonzero B: every adapter's A gets a gradient too
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(0.01 * torch.arange(param.numel(), dtype=param.dtype).view_as(param).sin())
    return use_hybridpar_attention(model)


def _case(sizes: dict, sp: bool, mesh, lora: tuple[str, ...], root) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.parallel.state import canonical_state_dict
    from hybridpar.train.trainer import pack_loss_sum
    from tests.distributed.tensor.hf_models import relative_error
    from tests.models.hf.rglru_models import VOCAB

    gen = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(0, VOCAB, (1, DOCS[-1]), generator=gen) for _ in range(2))
    labels[:, ::5] = -100
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    count = int((labels != -100).sum())
    reference = _model(lora)
    want = pack_loss_sum(reference, shard_inputs(input_ids=ids, labels=labels, packed=packed))[0] / count
    want.backward()
    model = _model(lora)
    dims = ParallelDims(**sizes)
    parallelize(model, dims, mesh=mesh, sequence_parallel=sp, cp_attention="ring")

    def tp_placement(param):  # its placement on the tp mesh dim (FSDP adds its own dims)
        return param.placements[param.device_mesh.mesh_dim_names.index("tp")] if isinstance(param, DTensor) else None

    block, attention = model.model.layers[0].temporal_block, model.model.layers[2].temporal_block
    placements = {"linear_x": tp_placement(block.linear_x.weight), "gate": tp_placement(block.rg_lru.input_gate_weight),
                  "conv": tp_placement(block.conv_1d.weight), "q": tp_placement(attention.q_proj.weight),
                  "k": tp_placement(attention.k_proj.weight), "out": tp_placement(block.linear_out.weight)}
    layout_ok = placements == {"linear_x": Shard(0), "gate": Shard(0), "conv": Shard(0), "q": Shard(0),
                               "k": Replicate(), "out": Shard(1)}
    cp_group = ParallelDims.group(mesh, "cp")
    inputs = shard_inputs(input_ids=ids, labels=labels, packed=packed, cp_group=cp_group,
                          tp_group=ParallelDims.group(mesh, "tp"), sequence_parallel=sp)
    replicas = dims.dp_shard  # data-parallel ranks see the same row: FSDP sums their gradients
    loss = pack_loss_sum(model, inputs)[0] / (count * replicas)
    loss.backward()
    total = loss.detach() * replicas
    dist.all_reduce(total, group=cp_group)
    grads = canonical_state_dict(model, grads=True)
    expected = [n for n, p in reference.named_parameters() if p.grad is not None and (not lora or "lora_" in n)]
    errors = {n: relative_error(grads[n], dict(reference.named_parameters())[n].grad) for n in expected}
    worst = max(errors, key=errors.get)
    if root is not None:  # a DCP checkpoint of the sharded model, for a one-process load
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model.state_dict()}, checkpoint_id=root)
    return {"loss_error": abs(total.item() - want.item()), "grad_error": errors[worst], "worst": worst,
            "grads": len(errors), "expected": len(expected), "layout_ok": layout_ok, "placements": str(placements),
            "names_same": sorted(model.state_dict()) == sorted(reference.state_dict())}


def _run(rank, world_size, sizes, cases, root=None) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    torch.set_num_threads(1)
    mesh = ParallelDims(**sizes).build_mesh()
    return {(sp, lora): _case(sizes, sp, mesh, lora, root if (sp, lora) == (False, ()) else None)
            for sp, lora in cases}


def _assert_exact(results) -> None:
    for rank_results in results:
        for case, r in rank_results.items():
            assert r["layout_ok"] and r["names_same"] and r["grads"] == r["expected"] > 0, (case, r)
            assert r["loss_error"] < TOL and r["grad_error"] < TOL, (case, r)


def test_tp2_and_sp_of_recurrent_gemma_match_one_process_and_its_checkpoint_loads_at_tp1(tmp_path):
    import torch.distributed.checkpoint as dcp

    cases = [(False, ()), (True, ()), (True, LORA)]
    _assert_exact(run_ranks(2, _run, dict(tp=2), cases, str(tmp_path), timeout_s=300))
    want, model = _model(), _model(seed=1)  # the tp=2 model's parameters are seed 0's
    state = {"model": model.state_dict()}
    assert any(not torch.equal(v, want.state_dict()[k]) for k, v in state["model"].items())
    dcp.load(state, checkpoint_id=str(tmp_path))
    model.load_state_dict(state["model"])
    assert all(torch.equal(v, want.state_dict()[k]) for k, v in model.state_dict().items())


def test_cp2_tp2_of_recurrent_gemma_matches_one_process():
    _assert_exact(run_ranks(4, _run, dict(cp=2, tp=2), [(False, ())], timeout_s=300))


def test_what_tp_cannot_shard_is_refused_in_one_line():
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import validate_parallelize
    from hybridpar.parallel.tensor.apply import check_tp_plan
    from hybridpar.parallel.tensor.hf_plans.recurrent_gemma import HEAD_SHARDED, MQAHeadParallel

    model = _model()
    with pytest.raises(ValueError, match=r"^[^\n]*'model.layers.0.temporal_block'[^\n]*4 heads, not divisible by "
                                         r"tp=3[^\n]*use a tp dividing 4[^\n]*$"):
        validate_parallelize(model, ParallelDims(tp=3))
    with pytest.raises(ValueError, match=r"^[^\n]*'model.layers.2.temporal_block'[^\n]*8 query heads, not divisible "
                                         r"by tp=3[^\n]*$"):
        MQAHeadParallel().check("model.layers.2.temporal_block", _Heads(8, 1), 3)
    with pytest.raises(ValueError, match=r"^[^\n]*2 key/value heads; its TP plan is multi-query[^\n]*tp=1[^\n]*$"):
        MQAHeadParallel().check("attention", _Heads(8, 2), 2)
    with pytest.raises(ValueError, match=r"^[^\n]*LoRA target 'model.layers.2.temporal_block.k_proj'[^\n]*$"):
        check_tp_plan(_model(("k_proj",)), 2)
    block = model.model.layers[0].temporal_block
    setattr(block, HEAD_SHARDED, True)
    with pytest.raises(ValueError, match=r"^[^\n]*sharded by heads[^\n]*use_cache=False[^\n]*$"):
        block(torch.zeros(1, 4, 32, dtype=torch.float64), use_cache=True)


class _Heads:
    def __init__(self, heads: int, kv_heads: int):
        self.num_attention_heads, self.num_key_value_heads = heads, kv_heads
