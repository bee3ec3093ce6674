"""The command line as a user runs it: torchrun started by hybridpar itself, and plan."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = str(ROOT / "configs" / "tiny-hybrid.yaml")


def hybridpar(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridpar", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_check_through_torchrun_started_by_hybridpar(tmp_path):
    result = hybridpar("check", "--config", DEFAULT, "--nproc-per-node", "2", "parallel.tp=1", "parallel.cp=2",
                       "parallel.sequence_parallel=false", "parallel.cp_mamba=state", "model.dtype=float64",
                       f"output_dir={tmp_path}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check exact" in result.stdout and "cp_mamba=state" in result.stdout


def test_nproc_that_does_not_fit_the_layout_is_refused_before_launch():
    result = hybridpar("train", "--config", DEFAULT, "--nproc-per-node", "2")
    assert result.returncode == 2
    assert "--nproc-per-node 2 does not fit" in result.stderr and "pass --nproc-per-node 4" in result.stderr


def test_plan_prints_sizes_and_mamba_cp_bytes():
    result = hybridpar("plan", "--config", DEFAULT, "model.preset=nemotronh-8b", "parallel.cp=8", "parallel.tp=1",
                       "data.pack_size=131072")
    assert result.returncode == 0, result.stderr
    assert "parameters" in result.stdout and "a2a (z local)" in result.stdout and "state" in result.stdout
