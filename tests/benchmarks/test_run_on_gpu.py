"""``benchmarks/run_on_gpu.sh`` is run once, on a borrowed GPU with minutes to spare: what it calls must
exist. Its Python one-liners that import hybridpar run here, and every flag it passes to a
benchmark script is one that script's ``--help`` lists."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "benchmarks" / "run_on_gpu.sh").read_text()
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def test_its_hybridpar_one_liners_run():
    snippets = [s for s in re.findall(r'"\$PY" -c "([^"]+)"', SCRIPT) if "hybridpar" in s]
    assert snippets
    for snippet in snippets:
        done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120, env=ENV)
        assert done.returncode == 0, (snippet, done.stderr[-1500:])


def test_every_flag_it_passes_is_one_the_benchmark_takes():
    calls = re.findall(r'"\$PY" (benchmarks/\w+\.py)([^|\n;]*)', SCRIPT)
    assert {script for script, _ in calls} == {"benchmarks/gpu_parity.py", "benchmarks/gdn_parity.py",
                                               "benchmarks/kda_parity.py", "benchmarks/gpu_throughput.py"}
    for script, arguments in calls:
        usage = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                               timeout=120, env=ENV, cwd=ROOT)
        assert usage.returncode == 0, usage.stderr[-1500:]
        for flag in re.findall(r"(--[a-z-]+)", arguments):
            assert flag in usage.stdout, (script, flag)


def test_its_timeouts_stay_inside_the_budget():
    """The commands it bounds add up to under 8 minutes at the default budget, leaving the install and a
    10-minute call's margin; the throughput process gets its row budget and 90 s to finish a row."""
    budget = int(re.search(r'BUDGET_S="\$\{BUDGET_S:-(\d+)\}"', SCRIPT).group(1))
    bounds = re.findall(r"^\s*(?:if (?:has \w+ && ! )?)?timeout (\d+|\$\(\(BUDGET_S \+ 90\)\)) ", SCRIPT, flags=re.M)
    timeouts = [budget + 90 if "BUDGET_S" in t else int(t) for t in bounds]
    assert len(timeouts) == 4 and sum(timeouts) <= 570, timeouts
    assert '--budget-s "$BUDGET_S"' in SCRIPT


@pytest.mark.parametrize("name", ["gdn_parity", "kda_parity"])
def test_parity_dry_run_passes(tmp_path, name):
    """``gdn_parity.py`` / ``kda_parity.py --dry-run``: both sections on CPU with FLA's contract standing in for
    the kernel."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--dry-run", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-1500:]
    record = json.loads((tmp_path / f"{name}.json").read_text())
    assert set(record["sections"]) == {"model", "states"}
    rows = [row for rows in record["sections"].values() for row in rows]
    assert len(record["sections"]["model"]) > 20 and all(row["ok"] for row in rows), rows
