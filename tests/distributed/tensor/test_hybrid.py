"""Tensor parallelism of ``HybridLM`` (Mamba2 mixer by heads) on 2 gloo ranks.

One 2-rank group checks:

- parity: ``parallelize(model, ParallelDims(tp=2))`` with and without sequence parallel, on a
  dense batch and a packed row, and a model with tied embeddings and an odd vocabulary (uneven
  vocab shards): float64 loss, every full gradient and the parameters after each of 2 AdamW
  steps equal the single-process model's to 1e-9;
- sequence parallel fed with sequence-sharded ``inputs_embeds``: logits equal;
- a Hugging Face Llama through ``parallelize`` at tp=2: loss and every gradient equal;
- ``apply_tp`` alone (no ``parallelize``) splits and shards the Mamba mixer itself, and
  ``load_canonical_state_dict`` puts full tensors back into the shards exactly;
- ``parameter_layouts`` classifies every Mamba mixer parameter under TP with the right dim
  (in_proj components, conv1d components, A_log, dt_bias, D and the gated norm weight on dim
  0, out_proj on dim 1, its bias replicated) and the block norms and ``norm_f`` as replicated;
- one B/C group (``mamba_n_groups=1``, as Mamba2 and Bamba checkpoints): B and C replicated, the
  gated norm's sum of squares all-reduced; the same parity with and without SP, and at cp=2 x tp=2
  under both Mamba CP strategies (a 4-rank group);
- ``ValueError``s, raised before anything is changed: Mamba heads or groups, attention heads
  not divisible by tp, degrees that do not multiply to the world size, a mesh that does not
  match the dims, an unknown plan name or strategy, context parallelism on a non-HybridLM,
  mixed precision without FSDP.
"""

from __future__ import annotations


import pytest
import torch

from hybridpar.train.loss import token_loss_sum
from tests.distributed.harness import run_ranks
from tests.distributed.context.test_model import (
    DENSE_BATCH, DENSE_SEQ, KINDS, MODEL, TOL, build_model, compare, distributed_run, make_batch, reference_run,
)
from tests.distributed.tensor.test_hf import SEQ as HF_SEQ
from tests.distributed.tensor.test_hf import VOCAB as HF_VOCAB

STEPS, LR = 2, 1e-2  # the second step sees the first's AdamW state
TIED = dict(vocab_size=61, tie_word_embeddings=True)
# name -> (build_model overrides, batch kind, sequence parallel)
CASES = {f"tp2 {kind}{' sp' if sp else ''}": ({}, kind, sp) for kind in KINDS for sp in (False, True)}
CASES["tp2 tied odd-vocab sp packed"] = (TIED, "packed", True)
# one B/C group (Mamba2 and Bamba checkpoints): B/C replicated, the gated norm's sum of squares all-reduced
CASES.update({f"tp2 one-group{' sp' if sp else ''} packed": (dict(mamba_n_groups=1), "packed", sp) for sp in (False, True)})


def batches_for(overrides: dict, kind: str) -> list:
    return [make_batch(kind, seed=30, vocab=overrides.get("vocab_size", 64))]


def mamba_layout_problems(layouts: dict) -> list[str]:
    """Names whose layout differs from the head-parallel Mamba plan (mixers of layers 0 and 3)."""
    from hybridpar.parallel.state import canonical_name

    layouts = {canonical_name(n): layout for n, layout in layouts.items()}  # activation-checkpoint wrappers
    want = {}
    for layer in (0, 3):
        mixer = f"backbone.layers.{layer}.mixer"
        for part in ("z", "x", "B", "C", "dt"):
            want[f"{mixer}.in_proj.weight_{part}"] = (True, 0)
            want[f"{mixer}.in_proj.bias_{part}"] = (True, 0)
        for part in ("x", "B", "C"):
            want[f"{mixer}.conv1d.weight_{part}"] = (True, 0)
            want[f"{mixer}.conv1d.bias_{part}"] = (True, 0)
        for name in ("A_log", "dt_bias", "D", "norm.weight"):
            want[f"{mixer}.{name}"] = (True, 0)
        want[f"{mixer}.out_proj.weight"] = (True, 1)
        want[f"{mixer}.out_proj.bias"] = (False, None)
    for layer in range(4):
        want[f"backbone.layers.{layer}.norm.weight"] = (False, None)
    want["backbone.norm_f.weight"] = (False, None)
    mamba_names = {n for n in layouts if ".mixer." in n and n.split(".")[2] in ("0", "3")}
    problems = [f"{n}: Mamba parameter not covered by the expected layouts" for n in mamba_names - set(want)]
    for name, (sharded, dim) in want.items():
        got = layouts.get(name)
        if got is None or (got.sharded, got.dim) != (sharded, dim):
            problems.append(f"{name}: got {got}, want sharded={sharded} dim={dim}")
    return problems


def _error(fn) -> str | None:
    try:
        fn()
    except ValueError as error:
        return str(error)
    return None


def error_checks(mesh) -> dict:
    """Every rank runs the same checks; each must raise before the model changes."""
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize

    tp2 = ParallelDims(tp=2)
    out = {}
    cases = {
        "mamba heads": (dict(mamba_num_heads=3, mamba_n_groups=1), tp2, {}),
        "mamba groups": (dict(mamba_num_heads=6, mamba_n_groups=3), tp2, {}),
        "attention heads": (dict(num_attention_heads=3, num_key_value_heads=1), tp2, {}),
        "world size": ({}, ParallelDims(tp=4), {}),
        "mesh mismatch": ({}, ParallelDims(cp=2), {"mesh": mesh}),
        "unknown plan": ({}, tp2, {"tp_plan": "no-such-plan"}),
        "unknown strategy": ({}, tp2, {"cp_mamba": "ring"}),
        # without FSDP mixed precision is autocast: bf16 by name, never an FSDP policy object
        "mixed precision without fsdp": ({}, tp2, {"mixed_precision": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}),
    }
    for name, (overrides, dims, options) in cases.items():
        model = build_model(**overrides)
        message = _error(lambda: parallelize(model, dims, **{"mesh": mesh if dims == tp2 else None, **options}))
        out[name] = (message, type(model.backbone.layers[0].mixer.in_proj).__name__)
    not_hybrid = nn.Sequential(nn.Linear(4, 4))
    out["cp on another model"] = (_error(lambda: parallelize(not_hybrid, ParallelDims(cp=2))), "Linear")
    return out


def tp_worker(rank: int, world_size: int) -> dict | None:
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.data.fsdp import parameter_layouts
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.parallel.state import canonical_state_dict, load_canonical_state_dict
    from hybridpar.parallel.tensor.apply import apply_tp
    from tests.distributed.tensor.test_hf import build_model as build_hf_model

    dims = ParallelDims(tp=2)
    mesh = dims.build_mesh()
    results = {}
    for name, (overrides, kind, sp) in CASES.items():
        model = parallelize(build_model(**overrides), dims, mesh=mesh, sequence_parallel=sp)
        results[name] = distributed_run(model, mesh, batches_for(overrides, kind), steps=STEPS, lr=LR,
                                        sequence_parallel=sp)
        if name == "tp2 dense":
            results["layouts"] = parameter_layouts(model)
        if name == "tp2 packed sp":
            results["layouts sp"] = parameter_layouts(model)

    # apply_tp on an unsplit model, then a full state loaded into the shards
    model = apply_tp(build_model(), mesh["tp"])
    ids, _, _ = make_batch("dense", seed=30)
    results["apply_tp logits"] = model(ids).detach()
    results["apply_tp names"] = sorted(n for n, _ in model.named_parameters())
    state = {n: p.detach() * 1.5 + 0.25 for n, p in build_model(seed=3).named_parameters()}
    load_canonical_state_dict(model, state)
    back = canonical_state_dict(model)
    results["load error"] = max((back[n] - state[n]).abs().max().item() for n in state)
    results["load names"] = set(back) == set(state)

    # sequence parallel fed with inputs_embeds (sequence-sharded by shard_inputs) instead of ids
    model = parallelize(build_model(), dims, mesh=mesh, sequence_parallel=True)
    embeds = torch.randn(DENSE_BATCH, DENSE_SEQ, MODEL["hidden_size"], dtype=torch.float64,
                         generator=torch.Generator().manual_seed(4))
    local = shard_inputs(inputs_embeds=embeds, tp_group=mesh["tp"].get_group(), sequence_parallel=True)
    results["embeds logits"] = model(inputs_embeds=local.inputs_embeds).detach()

    # a Hugging Face model through parallelize (its registered plan; no Mamba split to do)
    model = parallelize(build_hf_model("llama"), dims, mesh=mesh)
    model.zero_grad(set_to_none=True)
    results["hf"] = hf_loss_and_grads(model, canonical_state_dict)

    results["errors"] = error_checks(mesh)
    return results if rank == 0 else None


def hf_loss_and_grads(model, canonical_state_dict=None) -> tuple[float, dict]:
    """Token cross entropy (sum / count) of a Hugging Face causal LM on a fixed batch, and the gradients."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, HF_VOCAB, (2, HF_SEQ), generator=gen)
    labels = torch.randint(0, HF_VOCAB, (2, HF_SEQ), generator=gen)
    loss = token_loss_sum(model(input_ids=ids).logits, labels) / labels.numel()
    loss.backward()
    if canonical_state_dict is None:
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), canonical_state_dict(model, grads=True)


@pytest.fixture(scope="module")
def tp_results():
    return run_ranks(2, tp_worker, timeout_s=300)[0]


def test_tp_and_sequence_parallel_match_single_process_over_adamw_steps(tp_results):
    failures = []
    for name, (overrides, kind, _) in CASES.items():
        reference = reference_run(build_model(**overrides), batches_for(overrides, kind), steps=STEPS, lr=LR)
        failures += compare(name, tp_results[name], reference)
    assert not failures, "\n".join(failures[:40])


def test_apply_tp_splits_mamba_itself_and_full_state_loads_into_shards(tp_results):
    reference = build_model()
    ids, _, _ = make_batch("dense", seed=30)
    assert (tp_results["apply_tp logits"] - reference(ids)).abs().max().item() < 1e-9
    names = tp_results["apply_tp names"]
    assert "backbone.layers.0.mixer.in_proj.weight_z" in names and "backbone.layers.0.mixer.in_proj.weight" not in names
    assert tp_results["load names"]
    assert tp_results["load error"] == 0.0


def test_sequence_parallel_with_inputs_embeds_matches_single_process(tp_results):
    embeds = torch.randn(DENSE_BATCH, DENSE_SEQ, MODEL["hidden_size"], dtype=torch.float64,
                         generator=torch.Generator().manual_seed(4))
    reference = build_model()(inputs_embeds=embeds).detach()
    assert (tp_results["embeds logits"] - reference).abs().max().item() < TOL


def test_hugging_face_model_through_parallelize_matches_single_process(tp_results):
    pytest.importorskip("transformers")
    from tests.distributed.tensor.test_hf import build_model as build_hf_model

    loss, grads = hf_loss_and_grads(build_hf_model("llama"))
    got_loss, got_grads = tp_results["hf"]
    assert abs(got_loss - loss) < TOL * max(1.0, abs(loss))
    assert set(got_grads) == set(grads)
    errors = {n: (got_grads[n] - g).abs().max().item() / max(1.0, g.abs().max().item()) for n, g in grads.items()}
    assert max(errors.values()) < TOL, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("key", ["layouts", "layouts sp"])
def test_parameter_layouts_shard_every_mamba_parameter(tp_results, key):
    assert not mamba_layout_problems(tp_results[key])


EXPECTED_ERRORS = {
    "mamba heads": ["mamba_num_heads=3", "tp=2"],
    "mamba groups": ["mamba_n_groups=3", "tp=2", "a single group is replicated"],
    "attention heads": ["num_attention_heads=3", "tp=2"],
    "world size": ["world size is 2"],
    "mesh mismatch": ["mesh has dims", "build_mesh"],
    "unknown plan": ["no-such-plan", "known plans"],
    "unknown strategy": ["ring", "a2a"],
    "mixed precision without fsdp": ["bf16", "FSDP"],
    "cp on another model": ["cp > 1", "Sequential"],
}


@pytest.mark.parametrize("name", sorted(EXPECTED_ERRORS))
def test_bad_layouts_raise_before_anything_changes(tp_results, name):
    message, in_proj_class = tp_results["errors"][name]
    assert message is not None, f"{name}: no ValueError"
    for fragment in EXPECTED_ERRORS[name]:
        assert fragment in message, f"{name}: {fragment!r} not in {message!r}"
    assert in_proj_class == "Linear", f"{name}: the model was changed before the error"


@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_process_parallelize_splits_mamba_with_same_values_and_gradients(checkpointing):
    """At world size 1 (no process group) parallelize only splits the Mamba projections (and
    checkpoints blocks): same loss and gradients, names fused back by canonical_state_dict."""
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.parallel.state import canonical_state_dict, load_canonical_state_dict

    batches = [make_batch("packed", seed=30)]
    (want,) = reference_run(build_model(), batches)
    model = parallelize(build_model(), ParallelDims(), activation_checkpointing=checkpointing)
    names = [n for n, _ in model.named_parameters()]
    assert any(n.endswith("mixer.in_proj.weight_dt") for n in names)
    assert not any(n.endswith("mixer.in_proj.weight") or n.endswith("conv1d.weight") for n in names)
    (got,) = reference_run(model, batches)
    got["grads"] = canonical_state_dict(model, grads=True)
    assert not compare("world size 1", [got], [want])

    state = {n: p.detach() + 1.0 for n, p in build_model(seed=3).named_parameters()}
    load_canonical_state_dict(model, state)
    back = canonical_state_dict(model)
    assert set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)


def _one_group_cp_tp(rank, world_size):
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from tests.distributed.context.test_model import distributed_run

    out = {}
    for name, options in {"a2a sp": dict(cp_attention="allgather", cp_mamba="a2a", sequence_parallel=True),
                          "state": dict(cp_attention="ulysses", cp_mamba="state")}.items():
        dims = ParallelDims(cp=2, tp=2)
        mesh = dims.build_mesh()
        model = parallelize(build_model(mamba_n_groups=1), dims, mesh=mesh, **options)
        out[name] = distributed_run(model, mesh, [make_batch("packed", seed=20)], steps=2, lr=LR,
                                    sequence_parallel=options.get("sequence_parallel", False))
    return out if rank == 0 else None


def test_one_group_at_cp2_tp2_matches_single_process():
    """One B/C group (replicated over TP) under both Mamba CP strategies: 2 AdamW steps exact."""
    from tests.distributed.context.test_model import reference_run

    results = run_ranks(4, _one_group_cp_tp, timeout_s=300)[0]
    reference = reference_run(build_model(mamba_n_groups=1), [make_batch("packed", seed=20)], steps=2, lr=LR)
    failures = [f for name, got in results.items() for f in compare(f"cp2 tp2 {name}", got, reference)]
    assert not failures, "\n".join(failures[:20])
