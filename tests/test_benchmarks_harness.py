"""``benchmarks/harness.py``: the fresh-process round trip, its failures, the log-log fit, the writer;
``benchmarks/paths.py``: a step timed here and its peak measured in a fresh process, the table."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import harness  # noqa: E402
import paths  # noqa: E402


def child_case(n: int, label: str) -> dict:
    """Runs in the fresh process: its pid, its thread setting and the arguments, echoed."""
    print("noise before the result")
    return {"pid": os.getpid(), "threads": os.environ.get("OMP_NUM_THREADS"), "n": n * 2, "label": label}


def child_failure() -> None:
    raise ValueError("a case that fails")


def test_run_fresh_returns_the_json_of_a_new_process():
    got = harness.run_fresh(child_case, 21, "x", threads=1)
    assert got["n"] == 42 and got["label"] == "x" and got["threads"] == "1"
    assert got["pid"] != os.getpid()


def step_fn(arch: str, path: str, tokens: int):
    """A step that holds ``tokens`` MiB while it runs (``paths.time_and_peak`` measures it in a child)."""
    import torch

    return lambda: torch.ones(tokens * 2**18).sum()


def test_paths_time_a_step_and_measure_its_peak_in_a_fresh_process():
    row = paths.time_and_peak(step_fn, "toy", "ours", 64, repeats=1, threads=1)
    assert row["error"] is None and row["seconds"] > 0 and 60 <= row["peak_mib"] < 200, row
    lines = paths.paths_table([row], [64], ["toy"], "ours", "transformers")
    assert lines[-1].startswith("| toy | 64 |") and "not run" in lines[-1]


def test_run_fresh_names_the_childs_error():
    with pytest.raises(harness.CaseError, match="ValueError: a case that fails"):
        harness.run_fresh(child_failure)


def test_log_slope_fits_the_exponent_and_skips_what_is_not_a_number():
    points = [(x, 3.0 * x**1.5) for x in (1, 2, 4, 8)] + [(16, "OOM"), (32, None), (64, 0)]
    assert harness.log_slope(points) == pytest.approx(1.5)
    assert harness.log_slope([(1, 1.0)]) is None


def test_write_results_writes_json_and_markdown_with_the_command(tmp_path):
    meta = harness.environment("mine.py", ["--quick"])
    harness.write_results("mine", {"meta": meta}, "\n".join(harness.header("Mine", meta)), tmp_path, echo=False)
    assert json.loads((tmp_path / "mine.json").read_text())["meta"]["command"] == "python benchmarks/mine.py --quick"
    text = (tmp_path / "mine.md").read_text()
    assert text.startswith("# Mine\n") and "Command: `python benchmarks/mine.py --quick`" in text and "Device: " in text
