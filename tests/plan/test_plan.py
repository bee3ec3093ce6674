"""``hybridpar plan``: refusals as ``train``, the JSON keys, the search, and exact parameters.

The CLI's exit code on a refusal runs in a fresh process; its ``--json`` and ``--fit`` output are read from
``hybridpar.cli.main(argv)`` in this one (what ``python -m hybridpar`` calls; an interpreter start each)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridpar.config import load_config
from hybridpar.plan import make_plan, parameter_count
from hybridpar.plan.report import plan_dict
from hybridpar.plan.search import search_layouts
from hybridpar.models.hybrid import PRESETS
from hybridpar.train.hf_model import meta_model
from hybridpar.train.preflight import validate_layout

TINY = ["parallel.cp=1", "parallel.tp=1"]


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridpar", "plan", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("overrides, world", [
    (["parallel.tp=3", "parallel.cp=1"], None),  # tiny has 8 Mamba heads, 2 groups, 4 attention heads
    (["parallel.tp=16", "parallel.cp=1", "model.preset=nemotronh-8b"], None),  # > 8 KV heads and groups
    (["parallel.cp=3", "parallel.tp=1"], None),
    (["parallel.cp=2", "parallel.tp=1", "data.pack_size=250"], None),
    (["parallel.dp_shard=2", "parallel.cp=1", "parallel.tp=1", "data.packs_per_step=3"], None),
    (TINY, 2),  # the degrees multiply to 1
])
def test_invalid_layouts_are_refused_with_trains_message(overrides, world):
    config = load_config(None, overrides)
    with pytest.raises(ValueError) as train_error:
        validate_layout(config, world)
    with pytest.raises(ValueError) as plan_error:
        make_plan(config, world)
    assert str(plan_error.value) == str(train_error.value)


def test_cli_refuses_tp3_with_exit_2_and_no_plan():
    result = plan_cli("parallel.tp=3", "parallel.cp=1", "--json")
    assert result.returncode == 2 and result.stdout == ""
    assert "tp=3" in result.stderr, result.stderr


def plan_main(capsys, *args: str) -> str:
    """``hybridpar plan ARGS`` in this process: its stdout (exit code 0 asserted)."""
    from hybridpar.cli import main

    capsys.readouterr()
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_json_has_the_documented_keys_and_types(capsys):
    out = json.loads(plan_main(capsys, "parallel.cp=2", "parallel.tp=2", "data.pack_size=4096", "--json", "--target", "cpu"))
    assert isinstance(out["peak_memory_gib_per_rank"], float) and out["peak_memory_gib_per_rank"] > 0
    assert isinstance(out["baseline_gib"], float) and out["baseline_gib"] > 0
    assert isinstance(out["parameters_per_rank"], int)
    assert {"all_gather", "reduce_scatter", "all_to_all", "all_reduce"} <= set(out["traffic_bytes_per_step"])
    assert all(isinstance(v, int) for v in out["traffic_bytes_per_step"].values())


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_parameter_shapes_equal_the_models(preset):
    """The plan's parameter list (``step_comm.unit_parameters``) is the model's, name by name,
    for every preset, on the meta model the planner validates with."""
    from hybridpar.models.hybrid import HybridConfig
    from hybridpar.parallel.comm.step import unit_parameters
    from hybridpar.parallel.tensor.hybrid import split_mamba_mixers

    config = HybridConfig.from_preset(preset)
    model = meta_model(config)
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())
    split_mamba_mixers(model)
    listed = {p.name: p.shape for params in unit_parameters(config).values() for p in params}
    assert listed == {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_meta_model_has_the_real_models_parameters():
    """The meta model skips initialization only: same names, shapes and dtypes as a real one."""
    from hybridpar.models.hybrid import HybridConfig, HybridLM

    config = HybridConfig.from_preset("tiny", mlp_gated=True, attention_bias=True, mamba_proj_bias=True)
    meta, real = meta_model(config), HybridLM(config)
    assert [(n, p.shape, p.dtype, p.requires_grad) for n, p in meta.named_parameters()] == \
        [(n, p.shape, p.dtype, p.requires_grad) for n, p in real.named_parameters()]
    assert all(p.is_meta for p in meta.parameters())


def test_planning_nemotronh_8b_builds_nothing_slow():
    """A fresh process plans ``nemotronh-8b`` at 128K on cp=8 without torch's compiler stack
    (torch's meta initializers import ``torch._dynamo``: about a second) or a process group."""
    code = ("import sys; from hybridpar.config import load_config; from hybridpar.plan import make_plan; "
            "make_plan(load_config(None, ['model.preset=nemotronh-8b', 'data.pack_size=131072', 'parallel.cp=8', "
            "'parallel.tp=1'])); import torch.distributed as dist; "
            "print('torch._dynamo' in sys.modules, dist.is_initialized())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_memory_falls_with_checkpointing_and_cp():
    def peak(*overrides):
        return plan_dict(make_plan(load_config(None, ["data.pack_size=8192", *overrides])))["peak_memory_gib_per_rank"]

    none, selective, full = (peak(*TINY, f"parallel.activation_checkpointing={p}") for p in ("none", "selective", "full"))
    assert none > selective > full
    assert peak("parallel.cp=2", "parallel.tp=1") < none


def test_fit_lists_fitting_layouts_fastest_first_and_says_why_others_fail():
    config = load_config(None, ["data.pack_size=16384", "data.packs_per_step=1"])
    candidates = search_layouts(config, 4, 0.1, baseline_gib=0.0)
    fitting = [c for c in candidates if c.fits(0.1)]
    assert fitting
    times = [c.plan.time.step_s for c in fitting]
    assert times == sorted(times)
    refused = [c.refused for c in candidates if c.refused]
    assert any("tp=4" in why and "mamba_n_groups=2" in why for why in refused), refused  # tiny has 2 groups
    too_big = [c for c in candidates if c.plan is not None and not c.fits(0.1)]
    assert too_big and all(c.needs_gib > 0.1 for c in too_big)


def test_fit_cli_prints_the_recommendation(capsys):
    out = plan_main(capsys, "data.pack_size=16384", "data.packs_per_step=1", "--fit", "1.1", "--world-size", "4")
    assert "recommended:" in out and "does not fit (" in out


def test_fit_names_the_keys_it_raised_so_train_takes_a_layout_as_written_and_its_text_stays_short(capsys):
    """Before: a layout's line left out the data.packs_per_step it had raised to a multiple of dp, so train
    refused the recommended layout; and a world of 1,024 printed 2,182 lines."""
    from hybridpar.train.preflight import validate_layout

    config = load_config(None, ["data.pack_size=16384", "data.packs_per_step=1"])
    candidates = search_layouts(config, 8, 1.1, baseline_gib=1.0)
    data_parallel = [c for c in candidates if c.plan and c.parallel["dp_replicate"] * c.parallel["dp_shard"] > 1]
    assert data_parallel
    for candidate in data_parallel[:3]:
        label = candidate.label()
        dp = candidate.parallel["dp_replicate"] * candidate.parallel["dp_shard"]
        assert label.endswith(f" data.packs_per_step={dp}"), label
        keys = {"checkpointing": "parallel.activation_checkpointing"}
        overrides = [k + "=" + v if "." in k else f"{keys.get(k, 'parallel.' + k)}={v}"
                     for k, v in (item.split("=") for item in label.split())]
        validate_layout(load_config(None, ["data.pack_size=16384", "data.packs_per_step=1", *overrides]), 8)
    out = plan_main(capsys, "data.pack_size=16384", "data.packs_per_step=1", "--fit", "1.1", "--world-size", "64")
    assert len(out.splitlines()) <= 60 and "more (--json lists every one)" in out, out
