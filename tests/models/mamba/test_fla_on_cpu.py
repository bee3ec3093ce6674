"""FLA's own Triton kernels (fla-core 0.6.0: conv and scan, forward and backward) behind the fused Mamba op, run on
CPU by triton's interpreter (``fla_on_cpu.py``, a fresh process): outputs, final states and every
input's gradient within 1e-5 of the pure-PyTorch core in float64, on packed documents with and
without the CP ``state`` strategy's initial states and conv histories. The pure core in float32
is shown beside it as the floor float32 reaches (both measured ~1e-6 or below)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TOL = 1e-5


def test_fla_kernels_under_the_triton_interpreter_match_the_pure_core():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "tests.models.mamba.fla_on_cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["fla"] == "0.6.0"
    assert set(report["cases"]) == {"1 group, no states", "2 groups, CP states"}
    assert {"final_states", "grad init_states", "grad conv_history"} <= set(report["cases"]["2 groups, CP states"])
    for case, errors in report["cases"].items():
        for quantity, (fla_error, pure_error) in errors.items():
            assert fla_error <= TOL, (case, quantity, fla_error, pure_error)
            assert pure_error <= TOL, (case, quantity, fla_error, pure_error)
