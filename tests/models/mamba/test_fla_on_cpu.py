"""FLA's own Triton kernels (fla-core 0.6.0: conv and scan, forward and backward) behind the fused Mamba op, run on
CPU by triton's interpreter (``fla_on_cpu.py``, a fresh process): outputs, final states and every
input's gradient within 1e-5 of the pure-PyTorch core in float64, on packed documents with and
without the CP ``state`` strategy's initial states and conv histories, and within 5e-5 after a saturated ``dt``
(``dt A`` ~ -7e6: 1.5e-2 and 2.9 off before the op floored ``g``, ``fused_op.py``); so are the output and every
gradient of FLA's gated group RMSNorm behind Mamba2's norm (``models/norm_kernels.py``). The pure core in float32
is shown beside it as the floor float32 reaches (both measured ~1e-6 or below). And a tiny
hybrid of one block of each kind (2 Mamba heads), blocks compiled (aot_eager) with its Mamba layer on FLA's
kernels: no graph break, loss and every parameter gradient within 5e-5 of the eager pure model in float64
(3.7e-6 measured). And the fused op's backward by its two routes (``run_routes``): FLA's backward alone
(``models/mamba/fla_backward.py``) gives every gradient bit for bit as autograd through FLA's forward
did, and runs no forward output kernel (``chunk_fwd_o``) and one ``chunk_fwd_h`` fewer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TOL = 1e-5
SATURATED_TOL = 5e-5  # after a saturated dt, FLA's float32 chunk cumsums hold the -104.3 floor (ulp 7.6e-6)
MODEL_TOL = 5e-5  # a whole float32 model: errors compound over layers (the pure core's: 5.0e-6)


def _kernels_folder() -> Path:
    """Where ``make`` installs the ``fla-interpret`` extra: beside the interpreter running the suite
    (``.venv/fla-interpret``), kept off the environment's own path (pyproject.toml says why)."""
    folder = Path(sys.prefix) / "fla-interpret"
    assert (folder / "fla").is_dir() and (folder / "triton").is_dir(), (
        f"FLA's kernels are not in {folder}; `make install` puts them there (the fla-interpret extra)")
    return folder


def test_fla_kernels_stay_off_the_environment_path():
    """Where fla imports, transformers swaps FLA's kernels into Qwen3-Next and other models on any
    device; on a CPU they cannot run, so the suite's environment must not import it."""
    done = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('fla') is None)"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True", done.stdout + done.stderr


def test_fla_kernels_under_the_triton_interpreter_match_the_pure_core():
    paths = [str(_kernels_folder()), str(ROOT / "src"), str(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run([sys.executable, "-m", "tests.models.mamba.fla_on_cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["fla"] == "0.6.0"
    assert set(report["cases"]) == {"1 group, no states", "2 groups, CP states", "2 groups, CP states, saturated dt"}
    assert {"final_states", "grad init_states", "grad conv_history"} <= set(report["cases"]["2 groups, CP states"])
    for case, errors in report["cases"].items():
        for quantity, (fla_error, pure_error) in errors.items():
            assert fla_error <= (SATURATED_TOL if "saturated" in case else TOL), (case, quantity, fla_error, pure_error)
            assert pure_error <= TOL, (case, quantity, fla_error, pure_error)
    norm = report["gated_norm"]
    assert norm["kernel"] == "fla"
    assert set(norm["errors"]) == {"y", "grad x", "grad projection", "grad weight"}
    for quantity, (fla_error, pure_error) in norm["errors"].items():
        assert fla_error <= TOL and pure_error <= TOL, (quantity, fla_error, pure_error)
    model = report["model"]
    assert model["graph_breaks"] == 0
    assert "loss" in model["errors"] and len(model["errors"]) > 20  # the loss and every parameter's gradient
    for quantity, (fla_error, pure_error) in model["errors"].items():
        assert fla_error <= MODEL_TOL, (quantity, fla_error, pure_error)
    assert_backward_routes(report["routes"], "chunk_fwd_kernel_o")


def assert_backward_routes(routes: dict, output_kernel: str) -> None:
    """A backward call on FLA's kernels (``fla_on_cpu.backward_routes``): FLA's backward alone gives every
    gradient bit for bit as autograd through FLA's forward, and launches two kernels fewer, the forward's
    states (FLA's backward recomputes its own) and its output (``output_kernel``), calling no output function."""
    assert routes["same_bits"], routes
    assert routes["forward_output_calls"] == {"direct": 0, "autograd": 1}, routes
    direct, autograd = routes["launches"]["direct"], routes["launches"]["autograd"]
    assert set(autograd) - set(direct) == {output_kernel}, routes
    assert sum(direct.values()) == sum(autograd.values()) - 2, routes
