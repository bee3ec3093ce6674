"""``hybridpar check`` cannot pass falsely: non-finite values fail, the tolerance must be a
finite positive number, and only float64 results within 1e-9 are called exact."""

import contextlib
import io
import math
from pathlib import Path

import pytest
import torch

from hybridpar.config import load_config
from hybridpar.train.proof.layout import default_tolerance, within
from tests.distributed.harness import run_ranks

DEFAULT = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-hybrid.yaml")
SMALL = ["model.preset=tiny", "parallel.cp=1", "parallel.tp=1", "parallel.sequence_parallel=false", "data.pack_size=64",
         "data.task_options={min_len: 16, max_len: 32, num_kv_pairs: 2, vocab_size: 32}"]


@pytest.mark.parametrize(
    "difference, scale, tolerance, expected",
    [(0.0, 1.0, 1e-9, True), (1e-10, 5.0, 1e-9, True), (1e-3, 1.0, 1e-9, False), (math.nan, 1.0, 1e-9, False),
     (0.0, math.nan, 1e-9, False), (math.inf, 1.0, 1e-9, False), (0.0, math.inf, 1e-9, False)],
)
def test_the_pass_rule_fails_every_non_finite_value(difference, scale, tolerance, expected):
    assert within(difference, scale, tolerance) is expected


def test_default_tolerance_follows_the_dtype_the_step_runs_in():
    assert default_tolerance(load_config(DEFAULT, ["model.dtype=float64"])) == 1e-9
    assert default_tolerance(load_config(DEFAULT, ["model.dtype=float32"])) == 1e-4
    assert default_tolerance(load_config(DEFAULT, ["parallel.mixed_precision=bf16"])) == 5e-2


@pytest.mark.parametrize("tolerance", ["nan", "inf", "-1e-6", "0"])
def test_a_tolerance_that_is_not_finite_and_positive_is_refused(tolerance, capsys):
    from hybridpar.cli import main

    assert main(["check", "--config", DEFAULT, f"--tolerance={tolerance}", *SMALL]) == 2
    assert "must be a finite number > 0" in capsys.readouterr().err


def _run_check(*overrides) -> tuple[int, str]:
    """``(exit code, stdout)`` of ``run_check`` on the small job with ``overrides``, in this process."""
    import hybridpar.train.proof.layout as check

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = check.run_check(load_config(DEFAULT, SMALL + list(overrides)), torch.device("cpu"))
    return code, out.getvalue()


def _checks(rank, world_size):
    import hybridpar.train.proof.layout as check
    import hybridpar.train.trainer as trainer

    run = _run_check
    results = {"float64": run("model.dtype=float64"), "float32": run("model.dtype=float32")}
    original = trainer.build_model

    def poisoned(config):  # both sides compute NaN: every difference is NaN
        model = original(config)
        with torch.no_grad():
            model.lm_head.weight[0, 0] = float("nan")
        return model

    check.build_model = trainer.build_model = poisoned
    try:
        results["nan"] = run("model.dtype=float64")
    finally:
        check.build_model = trainer.build_model = original
    return results


def test_check_calls_only_float64_exact_and_fails_nan():
    results = run_ranks(1, _checks, timeout_s=300)[0]
    code, report = results["float64"]
    assert code == 0 and "check exact: all" in report and "in float64" in report
    code, report = results["float32"]
    assert code == 0 and "check passed: all" in report and "not exact" in report and "check exact" not in report
    code, report = results["nan"]
    assert code == 1 and "check FAILED" in report and "not finite" in report and "max|diff| nan" in report


def _lora_checks(rank, world_size):
    import hybridpar.train.proof.layout as check

    def run(*overrides) -> tuple[int, str]:
        return _run_check("model.dtype=float64", "peft.method=lora", "peft.r=4", *overrides)

    results = {"right": run()}
    real = check.Trainer

    class WrongAGradients(real):  # a layout that got every adapter's A gradient wrong (doubled)
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for name, param in self.model.named_parameters():
                if ".lora_A." in name:
                    param.register_hook(lambda grad: 2 * grad)

    check.Trainer = WrongAGradients
    try:
        results["wrong"] = run()
    finally:
        check.Trainer = real
    return results


def test_check_under_lora_proves_the_a_gradients_too():
    """LoRA's B factors start at zero, where every A's gradient is zero in both models: ``check`` passed a layout
    whatever it did to them (a doubled A gradient was "ok", 0 against 0). It now draws the same random B into both
    models for the proof and says so; the doubled A gradients fail."""
    results = run_ranks(1, _lora_checks, timeout_s=300)[0]
    code, report = results["right"]
    assert code == 0 and "check exact" in report and "B factors drawn at random" in report, report
    code, report = results["wrong"]
    assert code == 1 and "check FAILED" in report, report
    failed = [line.strip() for line in report.splitlines() if line.endswith("FAIL")]
    grads = [line for line in failed if line.startswith("grad ")]
    assert grads and all(".lora_A." in line for line in grads[:-1]), report
    assert grads[-1].startswith("grad norm"), report  # their norm too (round 27)
    assert all(line.startswith("AdamW update of ") for line in failed[len(grads):]), report  # and the updates


def _update_checks(rank, world_size):
    import hybridpar.train.proof.layout as check

    def run(*overrides) -> tuple[int, str]:
        return _run_check("model.dtype=float64", "parallel.dp_shard=2", "data.packs_per_step=2", *overrides)

    results = {"sharded": run()}
    original = check.Trainer

    class OneStepAhead(original):  # the layout's schedule one step ahead: every gradient right, every update not
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.scheduler.step()

    check.Trainer = OneStepAhead
    try:
        results["schedule"] = run()
    finally:
        check.Trainer = original
    return results


def test_check_compares_the_first_adamw_update_in_float64():
    """The update of every parameter after one AdamW step (clipping, the schedule's first rate, weight decay) under
    FSDP's sharded optimizer equals one process's; a layout whose schedule runs a step ahead (its gradients all
    exact) fails on the updates alone."""
    results = run_ranks(2, _update_checks, timeout_s=300)[0]
    code, report = results["sharded"]
    assert code == 0 and "AdamW update at step 1 (" in report and "check exact" in report, report
    code, report = results["schedule"]
    assert code == 1 and "AdamW update of " in report and "grad lm_head.weight" in report, report
    failed = [line for line in report.splitlines() if line.rstrip().endswith("FAIL")]
    assert failed and all("AdamW update of " in line for line in failed), report
