"""FSDP2 units and parameter layouts against the single-process model.

One 4-rank gloo group runs, for a tiny Hugging Face Llama and our ``HybridLM`` (float64):
FSDP over dp_shard=4, HSDP 2x2 and (Llama) FSDP dp_shard=2 on top of TP tp=2. Per layout:
the loss (sum of token losses / global count of valid tokens, some labels ignored so ranks
hold different counts) and every full gradient equal the single-process model's to 1e-9,
and parameters stay equal over 2 AdamW steps. A control run (one step) with stock FSDP gradient
division shows the check is sensitive to it (gradients come out divided by the dp size).
The group also checks bf16 mixed precision and that ``parameter_layouts`` reads TP layouts
through FSDP (DTensor placements, and parameter attributes FSDP re-creates parameters without).

``parameter_layouts`` rule order is tested in-process on plain modules.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridpar.parallel.dims import ParallelDims
from hybridpar.parallel.data.fsdp import Layout, apply_fsdp, fsdp_units, parameter_layouts
from tests.distributed.harness import run_ranks
from tests.distributed.tensor.test_hf import build_model as build_hf_model

TOL = 1e-9
STEPS = 2  # the second step sees the first's AdamW state and updated parameters
BATCH, SEQ = 8, 16
LAYOUTS = {  # name -> (dp_replicate, dp_shard, cp, tp)
    "fsdp4": (1, 4, 1, 1),
    "hsdp2x2": (2, 2, 1, 1),
    "fsdp2_tp2": (1, 2, 1, 2),
}
MODELS = {"llama": ("fsdp4", "hsdp2x2", "fsdp2_tp2"), "hybrid": ("fsdp4", "hsdp2x2")}


def build(name: str) -> nn.Module:
    if name == "llama":
        return build_hf_model("llama")
    from hybridpar.models.hybrid import HybridConfig, HybridLM

    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny", dtype=torch.float64))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def logits_of(model, input_ids):
    out = model(input_ids=input_ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def batch(step: int, vocab: int):
    """Global batch of a step: ids and labels with ~30% ignored (-100), unevenly per row."""
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels[torch.rand(BATCH, SEQ, generator=gen) < torch.linspace(0.0, 0.6, BATCH)[:, None]] = -100
    return ids, labels


def token_loss_sum(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def _full(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _max_error(model, reference, grads: bool) -> float:
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        got, want = (_full(param.grad), ref[name].grad) if grads else (_full(param.detach()), ref[name].detach())
        worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1.0)).item())
    return worst


def _train_parity(model_name: str, layout: str, stock_division: bool = False, steps: int = STEPS) -> dict:
    """``steps`` AdamW steps of the parallel model next to the reference; errors per step."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hybridpar.parallel.tensor.apply import apply_tp

    dims = ParallelDims(*LAYOUTS[layout])
    mesh = dims.build_mesh()
    dp_mesh = dims.mesh(mesh, "dp")
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()

    reference, model = build(model_name), build(model_name)
    vocab = reference.config.vocab_size
    if dims.tp > 1:
        apply_tp(model, dims.mesh(mesh, "tp"))
    if stock_division:  # control: FSDP's default gradient division
        for unit in fsdp_units(model):
            fully_shard(unit, mesh=dims.fsdp_mesh(mesh))
        fully_shard(model, mesh=dims.fsdp_mesh(mesh))
    else:
        apply_fsdp(model, mesh, dims)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)

    errors = []
    for step in range(steps):
        ids, labels = batch(step, vocab)
        count = (labels != -100).sum()
        ref_loss = token_loss_sum(logits_of(reference, ids), labels) / count
        ref_loss.backward()

        rows = slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size)
        local_loss = token_loss_sum(logits_of(model, ids[rows]), labels[rows]) / count
        local_loss.backward()
        loss = local_loss.detach().clone()
        dist.all_reduce(loss, group=dp_mesh.get_group())

        ratio = (_full(next(model.parameters()).grad).norm() / next(reference.parameters()).grad.norm()).item()
        grad_error = _max_error(model, reference, grads=True)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
        errors.append({"loss_error": abs(loss - ref_loss).item(), "grad_error": grad_error,
                       "param_error": _max_error(model, reference, grads=False), "grad_ratio": ratio})
    return {"steps": errors}


def _mixed_precision_step() -> dict:
    """bf16 compute, fp32 reduce: runs on gloo, logits in bf16, gradients near fp32's."""
    dims = ParallelDims(dp_shard=4)
    mesh = dims.build_mesh()
    torch.manual_seed(0)
    reference = build("llama").to(torch.float32)
    model = build("llama").to(torch.float32)
    apply_fsdp(model, mesh, dims, mixed_precision="bf16")
    ids, labels = batch(0, reference.config.vocab_size)
    count = (labels != -100).sum()
    token_loss_sum(logits_of(reference, ids).float(), labels).div(count).backward()
    rows = slice(mesh["dp_shard"].get_local_rank() * 2, mesh["dp_shard"].get_local_rank() * 2 + 2)
    logits = logits_of(model, ids[rows])
    token_loss_sum(logits.float(), labels[rows]).div(count).backward()
    ref = dict(reference.named_parameters())
    rel = max(((_full(p.grad).float() - ref[n].grad).norm() / ref[n].grad.norm()).item()
              for n, p in model.named_parameters())
    return {"logits_dtype": str(logits.dtype), "param_dtype": str(next(model.parameters()).dtype),
            "grad_dtype": str(next(model.parameters()).grad.dtype), "grad_rel_error": rel}


class MambaLike(nn.Module):
    """Megatron MambaMixer's TP metadata: on the parameters (conv, A_log, dt_bias, D, gated
    norm weight) and on the modules (in_proj column-parallel, out_proj row-parallel)."""

    def __init__(self, width: int = 8, tp_marked: bool = True):
        super().__init__()
        self.in_proj = nn.Linear(width, 2 * width)
        self.conv1d_weight = nn.Parameter(torch.randn(2 * width, 1, 4))
        self.A_log = nn.Parameter(torch.randn(4))
        self.dt_bias = nn.Parameter(torch.randn(4))
        self.D = nn.Parameter(torch.randn(4))
        self.norm = GatedRMSNormLike(2 * width)
        self.out_proj = nn.Linear(2 * width, width)
        if tp_marked:
            for param in (self.conv1d_weight, self.A_log, self.dt_bias, self.D, self.norm.weight):
                param.tensor_model_parallel, param.partition_dim = True, 0
            self.in_proj.tensor_model_parallel, self.in_proj.partition_dim = True, 0
            self.out_proj.tensor_model_parallel, self.out_proj.partition_dim = True, 1

    def forward(self, x):
        h = self.in_proj(x) * self.norm.weight + self.conv1d_weight.sum() + (self.A_log + self.dt_bias + self.D).sum()
        return self.out_proj(h)


class GatedRMSNormLike(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))


MAMBA_EXPECTED = {
    "in_proj.weight": Layout(True, 0, "module_attr"), "in_proj.bias": Layout(True, 0, "module_attr"),
    "conv1d_weight": Layout(True, 0, "param_attr"), "A_log": Layout(True, 0, "param_attr"),
    "dt_bias": Layout(True, 0, "param_attr"), "D": Layout(True, 0, "param_attr"),
    "norm.weight": Layout(True, 0, "param_attr"),  # a norm, but TP-sharded: attrs beat the name
    "out_proj.weight": Layout(True, 1, "module_attr"), "out_proj.bias": Layout(False, None, "module_attr"),
}


class StackOfMamba(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(MambaLike() for _ in range(2))
        self.final_norm = GatedRMSNormLike(8)
        self._fsdp_units = ["blocks.0", "blocks.1"]

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x * self.final_norm.weight


def _layouts_through_fsdp() -> dict:
    from hybridpar.parallel.tensor.apply import apply_tp

    out = {}
    stack = StackOfMamba()
    out["stack_before"] = parameter_layouts(stack)
    dims = ParallelDims(dp_shard=4)
    apply_fsdp(stack, dims.build_mesh(), dims)
    out["stack_after"] = parameter_layouts(stack)
    out["stack_units"] = sum(type(m).__name__.startswith("FSDP") for m in stack.modules())

    dims = ParallelDims(dp_shard=2, tp=2)
    mesh = dims.build_mesh()
    llama = apply_tp(build("llama"), dims.mesh(mesh, "tp"))
    out["llama_tp"] = parameter_layouts(llama)
    apply_fsdp(llama, mesh, dims)
    out["llama_tp_fsdp"] = parameter_layouts(llama)
    out["llama_tp_fsdp_placements"] = {
        n: repr(p.placements) for n, p in llama.named_parameters() if n.endswith("o_proj.weight")}
    return out


def fsdp_checks(rank: int, world_size: int) -> dict:
    results = {}
    for model_name, layouts in MODELS.items():
        for layout in layouts:
            results[(model_name, layout)] = _train_parity(model_name, layout)
    results["control"] = _train_parity("llama", "fsdp4", stock_division=True, steps=1)  # step 0 shows it
    results["mixed_precision"] = _mixed_precision_step()
    results["layouts"] = _layouts_through_fsdp()
    return results


@pytest.fixture(scope="module")
def fsdp_results():
    return run_ranks(4, fsdp_checks, timeout_s=500)


@pytest.mark.parametrize("model_name,layout", [(m, l) for m, ls in MODELS.items() for l in ls])
def test_fsdp_parity_over_adamw_steps(fsdp_results, model_name, layout):
    for result in fsdp_results:
        assert len(result[(model_name, layout)]["steps"]) == STEPS
        for step, errors in enumerate(result[(model_name, layout)]["steps"]):
            assert errors["loss_error"] < TOL, (step, errors)
            assert errors["grad_error"] < TOL, (step, errors)
            assert errors["param_error"] < TOL, (step, errors)


def test_stock_fsdp_division_is_what_the_parity_check_catches(fsdp_results):
    for result in fsdp_results:
        first = result["control"]["steps"][0]
        assert first["grad_error"] > 1e-3
        assert first["grad_ratio"] == pytest.approx(1 / 4, rel=1e-9)  # divided by dp_shard=4


def test_bf16_mixed_precision_runs_and_reduces_in_fp32(fsdp_results):
    for result in fsdp_results:
        mp = result["mixed_precision"]
        assert mp["logits_dtype"] == "torch.bfloat16"
        assert mp["param_dtype"] == mp["grad_dtype"] == "torch.float32"  # sharded params stay fp32
        assert mp["grad_rel_error"] < 5e-2


def test_parameter_layouts_survive_fsdp(fsdp_results):
    for result in fsdp_results:
        layouts = result["layouts"]
        assert layouts["stack_units"] == 3  # two hinted blocks and the root
        for block in ("blocks.0", "blocks.1"):
            for name, expected in MAMBA_EXPECTED.items():
                assert layouts["stack_before"][f"{block}.{name}"] == expected, name
                assert layouts["stack_after"][f"{block}.{name}"] == expected, name
        assert layouts["stack_after"]["final_norm.weight"] == Layout(False, None, "norm_name")


def test_parameter_layouts_read_tp_dim_and_ignore_fsdp_dim(fsdp_results):
    for result in fsdp_results:
        layouts = result["layouts"]
        for key in ("llama_tp", "llama_tp_fsdp"):
            got = layouts[key]
            assert got["model.layers.0.self_attn.q_proj.weight"] == Layout(True, 0, "dtensor")
            assert got["model.layers.1.self_attn.o_proj.weight"] == Layout(True, 1, "dtensor")
            assert got["model.layers.0.mlp.down_proj.weight"] == Layout(True, 1, "dtensor")
            assert got["model.embed_tokens.weight"] == Layout(True, 0, "dtensor")
            assert got["model.layers.0.input_layernorm.weight"] == Layout(False, None, "dtensor")
            assert got["model.norm.weight"] == Layout(False, None, "dtensor")
        # under FSDP the o_proj weight is (dp Shard(0) / _StridedShard, tp Shard(1)): only tp counts
        assert all("Shard(dim=1)" in p for p in layouts["llama_tp_fsdp_placements"].values())


# ------------------------------------------------------------------- in-process (no ranks)


def test_layout_rule_order_on_plain_modules():
    layouts = parameter_layouts(MambaLike())
    for name, expected in MAMBA_EXPECTED.items():
        assert layouts[name] == expected, name


def test_layout_fallbacks_without_tp_metadata():
    class ColumnParallelLinear(nn.Linear):
        pass

    class RowParallelLinear(nn.Linear):
        pass

    model = nn.ModuleDict({
        "mixer": MambaLike(tp_marked=False),
        "input_layernorm": nn.LayerNorm(4),
        "col": ColumnParallelLinear(4, 4),
        "row": RowParallelLinear(4, 4),
        "replicated_by_attr": nn.Linear(4, 4),
    })
    model["replicated_by_attr"].tensor_model_parallel = False
    layouts = parameter_layouts(model)
    assert layouts["mixer.norm.weight"] == Layout(False, None, "norm_name")  # no attrs: the name decides
    assert layouts["mixer.A_log"] == Layout(False, None, "default")
    assert layouts["input_layernorm.bias"] == Layout(False, None, "module_type")  # LayerNorm: Megatron's registry
    assert layouts["col.weight"] == layouts["col.bias"] == Layout(True, 0, "module_type")
    assert layouts["row.weight"] == Layout(True, 1, "module_type")
    assert layouts["row.bias"] == Layout(False, None, "module_type")  # row-parallel bias: replicated
    assert layouts["replicated_by_attr.weight"] == Layout(False, None, "module_attr")


def test_tied_parameters_are_listed_once():
    model = nn.ModuleDict({"embed": nn.Embedding(4, 2), "head": nn.Linear(2, 4, bias=False)})
    model["head"].weight = model["embed"].weight
    assert list(parameter_layouts(model)) == list(dict(model.named_parameters()))


def test_fsdp_units_are_found_generically():
    hf = build_hf_model("llama")
    assert fsdp_units(hf) == list(hf.model.layers)
    from hybridpar.models.hybrid import HybridConfig, HybridLM

    hybrid = HybridLM(HybridConfig.from_preset("tiny"))
    assert fsdp_units(hybrid) == list(hybrid.backbone.layers)
    stack = StackOfMamba()
    assert fsdp_units(stack) == [stack.blocks[0], stack.blocks[1]]  # the _fsdp_units hint wins
    assert fsdp_units(nn.Linear(2, 2)) == []
