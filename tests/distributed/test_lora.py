"""LoRA adapters under every layout against one process (float64, real gloo ranks).

Models: the tiny ``HybridLM`` of ``context/test_model.py`` (packed row, documents crossing rank
boundaries; adapters on attention q/k/v/o, the MLP and the Mamba ``in_proj``/``out_proj``), a
transformers Llama and a transformers NemotronH (Mamba, attention and MLP layers; dense rows; its Mamba
mixers on hybridpar's core and float64 throughout, as the trainer runs it),
with ``add_lora(r=4)`` on the default targets and ``B`` perturbed so every adapter gradient is
nonzero. Layouts: tp=2, tp=2 + SP, cp=2 (with activation checkpointing), dp_shard=2 (and the
HybridLM with its blocks compiled, ``aot_eager``) on one 2-rank group, which also runs the
dropout and Zamba2 checks (one launch for every 2-rank test); cp=2 x tp=2 on a 4-rank group.
FSDP's reduce-scatter (``CommStats``) sends exactly the adapters' padded gradients: the frozen
base has none to reduce. The loss and every adapter gradient
(``canonical_state_dict(grads=True)``: gathered, Mamba components fused back) equal the
single-process model's to 1e-9; no base parameter has a gradient, on any rank. One process:
the ``ValueError``s of bad targets, ranks and unpairable TP styles.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybridpar.models.lora import DEFAULT_TARGETS, add_lora, is_lora_parameter
from hybridpar.models.token_dropout import set_dropout_tokens, token_keys
from hybridpar.train.loss import global_sum, token_loss_sum, valid_token_count
from tests.distributed.context.test_model import TOL, build_model as build_hybrid, make_batch
from tests.distributed.harness import run_each, run_ranks

RANK = 4
MODELS = ("hybrid", "llama", "nemotron_h")
LAYOUTS_2 = {  # name -> (ParallelDims kwargs, parallelize kwargs)
    "tp2": (dict(tp=2), {}),
    "tp2-sp": (dict(tp=2), dict(sequence_parallel=True)),
    "cp2-ac": (dict(cp=2), dict(activation_checkpointing="full")),
    "dp_shard2": (dict(dp_shard=2), {}),
    "dp_shard2-compiled": (dict(dp_shard=2), dict(compile="aot_eager")),  # HybridLM only (time)
}
LAYOUTS_4 = {"cp2-tp2": (dict(cp=2, tp=2), {})}
HF_HYBRIDS = ("granite", "granite_moe", "falcon_h1", "bamba", "zamba2_shared")  # built by hybrid_models.build_hybrid
LAYOUTS_DROPOUT = {name: LAYOUTS_2[name] for name in ("tp2", "tp2-sp", "cp2-ac", "dp_shard2", "dp_shard2-compiled")}


def lora_model(name: str, dropout: float = 0.0):
    """A float64 model with adapters whose B is perturbed (seeded: every process builds the same)."""
    if name == "hybrid":
        model = build_hybrid()
    elif name in HF_HYBRIDS:  # tests/models/hf/hybrid_models.py (zamba2_shared: two hybrid layers on one shared block)
        from hybridpar.models.hf.mixers.mamba2 import install_mamba_core
        from tests.models.hf.hybrid_models import build_hybrid as build_hf_hybrid

        model = build_hf_hybrid(name)
        install_mamba_core(model)
    else:
        from hybridpar.models.hf.float64 import keep_float64
        from hybridpar.models.hf.mixers.mamba2 import install_mamba_core
        from tests.distributed.tensor.hf_models import build_model

        model = build_model(name)
        install_mamba_core(model)  # what parallelize does: the reference runs the same Mamba core
        keep_float64(model)  # as the trainer does: transformers' float32 casts stay float64
    targets = None if name != "zamba2_shared" else [  # and each layer's linear: under SP on the rank's tokens
        t for t in (*DEFAULT_TARGETS, "linear") if any(n.rsplit(".", 1)[-1] == t for n, _ in model.named_modules())]
    add_lora(model, r=RANK, alpha=8.0, seed=1, dropout=dropout, targets=targets)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("lora_B.weight"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator, dtype=torch.float64))
    return model


def batches_for(name: str, dp: int) -> list:
    vocab = {"hybrid": 64, "zamba2_shared": 97}.get(name, 127)
    return [make_batch("packed" if name == "hybrid" else "dense", seed=30 + d, vocab=vocab) for d in range(dp)]


def _logits(name: str, model, ids, packed):
    if name == "hybrid":
        return model(ids, packed=packed)
    return model(input_ids=ids, use_cache=False).logits


def key_masks(model, rank: int, ids, positions) -> None:
    """LoRA dropout masks keyed by each token's global row (data-parallel rank ``rank``'s rows) and position."""
    rows = rank * ids.shape[0] + torch.arange(ids.shape[0])
    set_dropout_tokens(model, 0, token_keys(rows, positions))


def reference(name: str, dp: int, dropout: float = 0.0) -> dict:
    model = lora_model(name, dropout)
    batches = batches_for(name, dp)
    count = sum(valid_token_count(labels) for _, labels, _ in batches)
    loss = 0.0
    for rank, (ids, labels, packed) in enumerate(batches):
        key_masks(model, rank, ids, torch.arange(ids.shape[1]))
        loss = loss + token_loss_sum(_logits(name, model, ids, packed), labels)
    loss = loss / count
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def _parallel_case(name: str, dims_kwargs: dict, options: dict, mesh, dropout: float = 0.0) -> dict:
    from hybridpar.parallel.comm.stats import CommStats
    from hybridpar.parallel.context.hf import hf_cp_inputs
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.parallel.state import canonical_state_dict

    dims = ParallelDims(**dims_kwargs)
    model = parallelize(lora_model(name, dropout), dims, mesh=mesh, **options)
    dp = dims.dp_replicate * dims.dp_shard
    dp_rank = ParallelDims.mesh(mesh, "dp").get_local_rank()
    ids, labels, packed = batches_for(name, dp)[dp_rank]
    dp_cp = ParallelDims.group(mesh, "dp_cp")
    local = shard_inputs(ids, labels=labels, packed=packed, cp_group=mesh["cp"].get_group(),
                         tp_group=mesh["tp"].get_group(), sequence_parallel=options.get("sequence_parallel", False))
    count = global_sum(valid_token_count(local.labels), dp_cp)
    key_masks(model, dp_rank, ids, local.global_positions())
    with CommStats(mesh) as stats:
        if name == "hybrid":
            logits = model(local.input_ids, packed=local.packed)
        else:
            logits = model(**hf_cp_inputs(local)).logits
        loss_sum = token_loss_sum(logits, local.labels)
        (loss_sum / count).backward()
    # FSDP2 reduce-scatters each group's padded trainable gradients [P * ceil(d0/P), ...]: a rank
    # sends (P-1)/P of them, at P = 2 one shard's worth
    shard = dims.dp_shard * dims.cp
    trainable = sum(-(-p.shape[0] // shard) * p[0].numel() * p.element_size()
                    for p in model.parameters() if p.requires_grad)
    base_grads = [n for n, p in model.named_parameters() if not is_lora_parameter(n) and p.grad is not None]
    frozen_trainable = [n for n, p in model.named_parameters() if not is_lora_parameter(n) and p.requires_grad]
    return {"loss": (global_sum(loss_sum, dp_cp) / count).item(), "grads": canonical_state_dict(model, grads=True),
            "base_grads": base_grads, "frozen_trainable": frozen_trainable,
            "reduce_scatter": (stats.bytes_sent.get("reduce_scatter", 0), trainable if dims.tp == 1 else None)}


def lora_worker(rank: int, world_size: int, layouts: dict, dropout: float = 0.0, models=MODELS) -> dict:
    from hybridpar.parallel.dims import ParallelDims

    results = {}
    for layout, (dims_kwargs, options) in layouts.items():
        mesh = ParallelDims(**dims_kwargs).build_mesh()
        for name in models:
            if "compile" in options and name != "hybrid":
                continue
            results[(layout, name)] = _parallel_case(name, dims_kwargs, options, mesh, dropout)
    return results


def parity_failures(where: str, got: dict, want: dict) -> list[str]:
    """What differs between a layout's ``{"loss", "grads"}`` and the reference's beyond ``TOL``;
    the reference's gradients must be adapters' only."""
    assert set(want["grads"]) and all(is_lora_parameter(n) for n in want["grads"]), where
    failures = []
    if abs(got["loss"] - want["loss"]) > TOL * max(1.0, abs(want["loss"])):
        failures.append(f"{where}: loss {got['loss']!r} != {want['loss']!r}")
    if set(got["grads"]) != set(want["grads"]):
        return failures + [f"{where}: gradient names differ: {sorted(set(got['grads']) ^ set(want['grads']))[:6]}"]
    for pname, expected in want["grads"].items():
        err = (got["grads"][pname] - expected).abs().max().item()
        if err > TOL * max(1.0, expected.abs().max().item()):
            failures.append(f"{where}: {pname} gradient error {err:.3e}")
    return failures


def _check(results: list[dict], layouts: dict, dropout: float = 0.0) -> None:
    references = {}
    failures = []
    for (layout, name), got in results[0].items():
        dp = layouts[layout][0].get("dp_shard", 1)
        want = references.setdefault((name, dp), reference(name, dp, dropout))
        failures += parity_failures(f"{layout} {name}", got, want)
    for rank_results in results:
        for key, got in rank_results.items():
            sent, trainable = got["reduce_scatter"]
            if trainable is not None and layouts[key[0]][0] == dict(dp_shard=2):  # (CP reduce-scatters dK, dV too)
                if sent != trainable:  # frozen base weights: no gradient reduce-scatter
                    failures.append(f"{key}: FSDP reduce-scattered {sent} bytes, the adapters' gradients are {trainable}")
            if got["base_grads"] or got["frozen_trainable"]:
                failures.append(f"{key}: base parameters with gradients {got['base_grads'][:4]} / trainable "
                                f"{got['frozen_trainable'][:4]}")
    assert not failures, "\n".join(failures[:40])


ZAMBA_LAYOUTS = {"cp2-ac": LAYOUTS_2["cp2-ac"], "tp2-sp": LAYOUTS_2["tp2-sp"]}
JOBS_2 = {  # the 2-rank checks, one launch: name -> (layouts, dropout, models)
    "plain": (LAYOUTS_2, 0.0, MODELS),
    "dropout": (LAYOUTS_DROPOUT, 0.3, MODELS),
    "zamba2_shared": (ZAMBA_LAYOUTS, 0.0, ("zamba2_shared",)),
}


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list[dict]]:
    """Every 2-rank job on one group (the launch and the process group once, not per test): job -> results by rank."""
    return dict(zip(JOBS_2, run_each(2, lora_worker, list(JOBS_2.values()), timeout_s=900)))


@pytest.mark.timeout(900)
def test_lora_tp_sp_cp_fsdp_match_one_process(two_ranks):
    _check(two_ranks["plain"], LAYOUTS_2)


@pytest.mark.timeout(900)
def test_lora_dropout_draws_the_single_process_masks_at_every_layout(two_ranks):
    """peft.dropout=0.3 at tp=2, tp=2 + SP, cp=2 (activation checkpointing: recomputed masks) and
    dp_shard=2 (and compiled blocks): masks keyed by each token's global row and position (``models/token_dropout.py``;
    a row-parallel adapter's feature shard by its global features, ``ShardedTokenDropout``), so the
    loss and every adapter gradient equal one process's (column-, row- and per-component adapters)."""
    _check(two_ranks["dropout"], LAYOUTS_DROPOUT, 0.3)


@pytest.mark.timeout(600)
def test_lora_cp2_tp2_matches_one_process():
    _check(run_ranks(4, lora_worker, LAYOUTS_4, timeout_s=500), LAYOUTS_4)


@pytest.mark.timeout(900)
def test_lora_on_zamba2_with_a_shared_block_matches_one_process(two_ranks):
    """Adapters on each hybrid layer's copy of the shared block are its own; the copies' tied base
    weights form one FSDP unit with them (cp=2), and under tp=2 + SP the copies are sharded and
    re-tied: the loss and every adapter gradient equal one process's. The adapters on each layer's
    ``linear`` run on the rank's tokens under SP (``TokenwiseParallel``), their gradients summed over TP
    (before: refused, no pairing)."""
    _check(two_ranks["zamba2_shared"], ZAMBA_LAYOUTS)


def test_bad_lora_input_is_refused_before_parallelizing():
    model = build_hybrid()
    with pytest.raises(ValueError, match=r"'qkv'.*matches no module.*e\.g\."):
        add_lora(copy.deepcopy(model), targets=["q_proj", "qkv"])
    with pytest.raises(ValueError, match=r"peft\.r=0.*>= 1"):
        add_lora(copy.deepcopy(model), r=0)
    with pytest.raises(ValueError, match=r"'norm'.*non-Linear"):
        add_lora(copy.deepcopy(model), targets=["norm"])


def test_a_tp_style_lora_cannot_pair_is_refused_before_any_collective():
    from hybridpar.parallel.tensor.apply import check_tp_plan
    from hybridpar.parallel.tensor.linear_styles import PackedColwiseParallel
    from tests.distributed.tensor.hf_models import build_model

    plan = {"model.layers.*.mlp.up_proj": PackedColwiseParallel(split_factor=2)}  # a fused [gate | up]-style split
    model = build_model("llama")
    add_lora(model, r=2, targets=["up_proj", "o_proj"])
    with pytest.raises(ValueError, match=r"LoRA target 'model\.layers\.0\.mlp\.up_proj'.*PackedColwiseParallel"
                                         r".*drop it from peft\.target_modules or use parallel\.tp=1"):
        check_tp_plan(model, 2, plan)
    check_tp_plan(build_model("llama"), 2, plan)  # the same model without adapters passes
