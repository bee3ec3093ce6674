"""``benchmarks/run_on_gpu.sh`` is run once, on a borrowed GPU with minutes to spare: what it calls must
exist. Its Python one-liners that import hybridpar run here, every flag it passes to a benchmark script
is one that script's ``--help`` lists, and ``gdn_parity.py`` / ``kda_parity.py --dry-run`` pass on CPU.

All of that runs in ONE fresh interpreter (``DRIVER``), each item as Python would run it on its own:
a one-liner in a fresh ``__main__`` namespace (it must import what it uses), a script through
``runpy`` as ``__main__`` with its own ``sys.argv`` and its directory first on ``sys.path``. One
start instead of nine (each paid torch's and hybridpar's import)."""

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
SNIPPETS = [s for s in re.findall(r'"\$PY" -c "([^"]+)"', SCRIPT) if "hybridpar" in s]
CALLS = re.findall(r'"\$PY" (benchmarks/\w+\.py)([^|\n;]*)', SCRIPT)
PARITY = ["gdn_parity", "kda_parity"]

# argv: a JSON list of jobs, ["snippet", code] or ["script", path, [arguments]]; prints one JSON list of
# {"ok", "stdout", "error"}. Each job's stdout is captured apart; a script's SystemExit is its exit code.
DRIVER = r"""
import contextlib, io, json, runpy, sys, traceback
results = []
for job in json.loads(sys.argv[1]):
    out, ok, error = io.StringIO(), False, ""
    argv0, folder = sys.argv, None
    try:
        with contextlib.redirect_stdout(out):
            if job[0] == "snippet":
                exec(compile(job[1], "<snippet>", "exec"), {"__name__": "__main__"})
                ok = True
            else:
                folder, sys.argv = job[1].rsplit("/", 1)[0], [job[1], *job[2]]
                sys.path.insert(0, folder)
                try:
                    runpy.run_path(job[1], run_name="__main__")
                    ok = True
                except SystemExit as done:
                    ok, error = done.code in (0, None), f"exit code {done.code}"
    except BaseException:
        error = traceback.format_exc()
    finally:
        sys.argv = argv0
        if folder:
            sys.path.remove(folder)
    results.append({"ok": ok, "stdout": out.getvalue(), "error": error})
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict:
    """Every job in one interpreter: key -> result (``("snippet", i)``, ``("help", script)``, ``("dry", name)``)."""
    out = tmp_path_factory.mktemp("run_on_gpu")
    jobs = {("snippet", i): ["snippet", s] for i, s in enumerate(SNIPPETS)}
    jobs.update({("help", script): ["script", str(ROOT / script), ["--help"]] for script, _ in CALLS})
    for name in PARITY:
        (out / name).mkdir()
    jobs.update({("dry", name): ["script", str(ROOT / "benchmarks" / f"{name}.py"), ["--dry-run", "--out", str(out / name)]]
                 for name in PARITY})
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(list(jobs.values()))], capture_output=True,
                          text=True, timeout=300, env=ENV, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.rsplit("RESULTS ", 1)[1])
    return {"out": out, **dict(zip(jobs, results))}


def test_its_hybridpar_one_liners_run(ran):
    assert SNIPPETS
    for i, snippet in enumerate(SNIPPETS):
        assert ran["snippet", i]["ok"], (snippet, ran["snippet", i]["error"][-1500:])


def test_every_flag_it_passes_is_one_the_benchmark_takes(ran):
    assert {script for script, _ in CALLS} == {"benchmarks/gpu_parity.py", "benchmarks/gdn_parity.py",
                                               "benchmarks/kda_parity.py", "benchmarks/gpu_throughput.py",
                                               "benchmarks/attention_cuda_check.py"}
    for script, arguments in CALLS:
        usage = ran["help", script]
        assert usage["ok"], (script, usage["error"][-1500:])
        assert "usage:" in usage["stdout"], (script, usage["stdout"][-500:])
        for flag in re.findall(r"(--[a-z-]+)", arguments):
            assert flag in usage["stdout"], (script, flag)


def test_its_timeouts_stay_inside_the_budget():
    """The commands the default parts bound add up to under 8 minutes at the default budget, leaving the
    install and a 10-minute call's margin, and so do those of the lease recipe (``parity attention
    throughput`` at ``BUDGET_S=200``); the throughput process gets its row budget and 90 s to finish a row."""
    budget = int(re.search(r'BUDGET_S="\$\{BUDGET_S:-(\d+)\}"', SCRIPT).group(1))
    bounds = re.findall(r'^\s*(?:if (?:has \w+ && ! )?)?timeout (\d+|\$\(\(BUDGET_S \+ 90\)\)|"\$\{\w+:-\d+\}") '
                        r'"\$PY" benchmarks/(\w+)\.py', SCRIPT, flags=re.M)
    timeouts = {script: (int(re.findall(r"\d+", t)[-1]), "BUDGET_S" in t) for t, script in bounds}
    assert set(timeouts) == {"gpu_parity", "attention_cuda_check", "gpu_throughput", "gdn_parity", "kda_parity"}

    def total(scripts, row_budget):
        return sum(row_budget + 90 if rows else seconds for s, (seconds, rows) in timeouts.items() if s in scripts)

    assert 'PARTS="${*:-parity throughput gdn kda}"' in SCRIPT  # attention only when named
    assert total({"gpu_parity", "gpu_throughput", "gdn_parity", "kda_parity"}, budget) <= 570, timeouts
    assert total({"gpu_parity", "attention_cuda_check", "gpu_throughput"}, 200) <= 570, timeouts
    assert '--budget-s "$BUDGET_S"' in SCRIPT


@pytest.mark.parametrize("name", PARITY)
def test_parity_dry_run_passes(ran, name):
    """``gdn_parity.py`` / ``kda_parity.py --dry-run``: both sections on CPU with FLA's contract standing in for
    the kernel."""
    assert ran["dry", name]["ok"], ran["dry", name]["stdout"][-1500:] + ran["dry", name]["error"][-1500:]
    record = json.loads((ran["out"] / name / f"{name}.json").read_text())
    assert set(record["sections"]) == {"model", "states"}
    rows = [row for rows in record["sections"].values() for row in rows]
    assert len(record["sections"]["model"]) > 20 and all(row["ok"] for row in rows), rows
