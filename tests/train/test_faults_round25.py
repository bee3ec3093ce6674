"""Round 25 of fault hunting (docs/reliability.md, "Round 25"): mixed precision everywhere.

``parallel.mixed_precision=bf16``, ``model.dtype`` and ``parallel.tf32`` swept over every layout, model family,
LoRA, checkpoints, export, ``check`` and ``plan``: what was silently different from what the config said."""

from __future__ import annotations

import pytest

from hybridpar.config import load_config

TINY = ["model.preset=tiny", "data.pack_size=64", "parallel.cp=1"]


def test_the_plans_step_time_follows_the_precision_its_matmuls_run_in():
    """``hybridpar plan`` priced every run's matmuls at the bf16 tensor-core peak: a float32 run (TF32, half of it)
    or one with ``parallel.tf32=false`` or in float64 (about 1/15) was estimated as fast as bf16 mixed precision.
    The rate now follows what the matmuls run in, and the time line names it."""
    from hybridpar.plan import make_plan
    from hybridpar.plan.estimate import estimate_time
    from hybridpar.plan.layout import Layout
    from hybridpar.plan.report import plan_text

    plan = make_plan(load_config(None, TINY))
    assert "matmuls in tf32" in plan_text(plan).splitlines()[-1]
    layouts = {name: Layout.from_run(load_config(None, TINY + extra), plan.layout.model) for name, extra in {
        "bf16": ["parallel.mixed_precision=bf16"], "bfloat16": ["model.dtype=bfloat16"], "tf32": [],
        "float32": ["parallel.tf32=false"], "float64": ["model.dtype=float64"]}.items()}
    assert [layout.matmul_precision for layout in layouts.values()] == ["bf16", "bf16", "tf32", "float32", "float64"]
    times = {name: estimate_time(layout, 0, {}) for name, layout in layouts.items()}
    assert len({t.flops for t in times.values()}) == 1  # the same matmuls: only their rate differs
    bf16 = times["bf16"].compute_s
    assert times["bfloat16"].compute_s == pytest.approx(bf16)
    assert times["tf32"].compute_s == pytest.approx(2 * bf16)
    assert times["float32"].compute_s == pytest.approx(989 / 67 * bf16)
    assert times["float64"].compute_s == pytest.approx(989 / 67 * bf16)
    assert times["tf32"].compute_s == pytest.approx(plan.time.compute_s)
