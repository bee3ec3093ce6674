"""Activation checkpointing policies and the new Mamba core under TP and CP, float64.

The reference is the single-process ``HybridLM`` with the *old* Mamba core
(``tests/models/mamba/reference.py``) and no checkpointing. One 2-rank group runs, on a packed
row: tp=2 (Mamba by heads, DTensor projections) with each policy none/full/selective, and
cp=2 (FSDP over the CP ranks) with each Mamba strategy a2a/state and policies full/selective.
Loss and every gradient (gathered, Mamba components fused back) equal the reference to 1e-10.
Two steps per run: the selective policy learns each block's matmul count in the first.
One process: policy names, the old booleans, and the errors for anything else.
"""

from __future__ import annotations

import copy

import pytest

from hybridpar.config import ConfigError, load_config
from hybridpar.models.mamba.mixer import Mamba2Mixer
from hybridpar.parallel.checkpointing import checkpointing_policy
from tests.distributed.harness import run_ranks
from tests.distributed.context.test_model import build_model, distributed_run, make_batch, reference_run
from tests.models.mamba.reference import local_conv_scan as old_core

TOL = 1e-10
STEPS = 2
CASES = [("tp", 2, None, policy) for policy in ("none", "full", "selective")]
CASES += [("cp", 2, mamba, policy) for mamba in ("a2a", "state") for policy in ("full", "selective")]


def old_core_model():
    model = build_model()
    for module in model.modules():
        if isinstance(module, Mamba2Mixer):
            module.core = old_core
    return model


def worker(rank: int, world_size: int) -> dict | None:
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize

    batches = [make_batch("packed", seed=40)]
    base = build_model()
    results = {}
    for dim, size, mamba, policy in CASES:
        dims = ParallelDims(**{dim: size})
        mesh = dims.build_mesh()
        model = parallelize(copy.deepcopy(base), dims, mesh=mesh, cp_mamba=mamba or "a2a", activation_checkpointing=policy)
        results[(dim, mamba, policy)] = distributed_run(model, mesh, batches, steps=STEPS)
    return results if rank == 0 else None


def differences(got: list[dict], want: list[dict]) -> list[str]:
    problems = []
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        if abs(g["loss"] - w["loss"]) > TOL * max(1.0, abs(w["loss"])):
            problems.append(f"step {step}: loss {g['loss']!r} != {w['loss']!r}")
        for name, expected in w["grads"].items():
            err = (g["grads"][name] - expected).abs().max().item()
            if err > TOL * max(1.0, expected.abs().max().item()):
                problems.append(f"step {step}: grad {name} max error {err:.3e}")
    return problems


def test_policies_under_tp_and_cp_match_the_old_core_without_checkpointing():
    results = run_ranks(2, worker, timeout_s=300)[0]
    want = reference_run(old_core_model(), [make_batch("packed", seed=40)], steps=STEPS)
    problems = [f"{case}: {p}" for case, got in results.items() for p in differences(got, want)]
    assert not problems, "\n".join(problems[:30])


@pytest.mark.parametrize("value, policy", [("none", "none"), ("full", "full"), ("selective", "selective"),
                                           (True, "full"), (False, "none")])
def test_policy_names_and_old_booleans(value, policy):
    assert checkpointing_policy(value) == policy
    override = f"parallel.activation_checkpointing={str(value).lower()}"
    assert load_config(overrides=[override]).parallel.activation_checkpointing == policy


@pytest.mark.parametrize("value", ["partial", "Full", 2])
def test_unknown_policy_is_rejected_with_the_choices(value):
    choices = r"\['none', 'full', 'selective'\]"
    with pytest.raises(ValueError, match=rf"not a policy; choose one of {choices}"):
        checkpointing_policy(value)
    must = "'none', 'full' or 'selective'" if isinstance(value, str) else "a string or true or false"
    match = rf"parallel\.activation_checkpointing={value!r} is invalid: it must be {must}"
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[f"parallel.activation_checkpointing={value}"])
