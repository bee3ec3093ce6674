"""Make ``import hybridpar`` work from a plain checkout (src layout, no install needed)."""

import sys
from pathlib import Path

import pytest

_SRC = str(Path(__file__).resolve().parents[1] / "src")
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)

# The slowest test files (seconds, summed over their tests, two workers, 2026-11-27), run first: with
# `-n 2 --dist loadfile` a worker takes the next file when it finishes one, so a long file scheduled
# last would leave the other worker idle. xdist's own order (most tests first, which the Makefile
# turns off with --no-loadscope-reorder) put single-test files such as test_hf_hybrids_tp.py (85 s) last.
SLOWEST_FIRST = [
    "tests/train/test_packing_safety.py",  # 115
    "tests/distributed/test_compile.py",  # 90
    "tests/train/test_trainer.py",  # 87
    "tests/distributed/tensor/test_hf_hybrids_tp.py",  # 86
    "tests/train/test_cli.py",  # 80
    "tests/distributed/test_parallelize.py",  # 60
    "tests/plan/test_plan_hf.py",  # 58
    "tests/plan/test_plan_measured.py",  # 51
    "tests/models/linear/test_kda_fused.py",  # 50
    "tests/train/test_text_stdlib.py",  # 44
    "tests/distributed/test_accumulation.py",  # 44
    "tests/distributed/context/test_compile_recurrent.py",  # 37
    "tests/distributed/test_lora.py",  # 36
]


def pytest_collection_modifyitems(config, items):
    """The files of ``SLOWEST_FIRST`` first, in that order; the rest as collected (each file's tests
    keep their order)."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture
def fresh_compiled_steps(monkeypatch):
    """``hybridpar.models.cuda_compile`` with no step compiled or failed yet, and dynamo's caches empty
    before and after: a test's compiled steps are its own."""
    import torch

    from hybridpar.models import cuda_compile

    monkeypatch.setattr(cuda_compile, "_COMPILED", {})
    monkeypatch.setattr(cuda_compile, "_FAILED", set())
    torch._dynamo.reset()
    yield cuda_compile
    torch._dynamo.reset()
