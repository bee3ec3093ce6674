"""The test harness itself: results by rank, errors with rank and traceback, no hangs."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import RankFailure, free_port, run_ranks


def _report_and_all_reduce(rank, world_size, payload):
    value = torch.tensor([float(rank + 1)], dtype=torch.float64)
    dist.all_reduce(value, group=dist.group.WORLD)
    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "sum": value.item(),
        "payload": payload,
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
    }


def _innermost_helper_that_raises(rank):
    raise ValueError(f"boom from rank {rank}")


def _rank_one_raises_while_rank_zero_waits(rank, world_size):
    if rank == 1:
        time.sleep(0.2)
        _innermost_helper_that_raises(rank)
    dist.barrier(group=dist.group.WORLD)  # rank 0 waits here for a peer that never comes
    return rank


def _rank_one_dies(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def _native_frame_that_crashes(rank):
    os.kill(os.getpid(), signal.SIGSEGV)  # as a native crash in a collective or kernel would


def _rank_one_crashes(rank, world_size):
    if rank == 1:
        _native_frame_that_crashes(rank)
    return rank


def _hang(rank, world_size, pid_dir):
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 0:
        dist.all_reduce(torch.ones(1), group=dist.group.WORLD)  # a collective rank 1 never joins
    while True:
        time.sleep(1.0)


def _is_gone(pid: int) -> bool:
    """True once the process no longer exists (or is a zombie nobody will run again)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_results_come_back_by_rank_and_all_reduce_works():
    results = run_ranks(2, _report_and_all_reduce, {"nested": [1, 2]}, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["dist_rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert all(r["sum"] == 3.0 for r in results)  # 1 + 2
    assert all(r["payload"] == {"nested": [1, 2]} for r in results)
    assert all(r["threads"] == 1 and r["omp"] == "1" for r in results)


def test_a_raising_rank_is_reported_with_rank_and_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _rank_one_raises_while_rank_zero_waits, timeout_s=60)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert info.value.rank == 1
    assert "rank 1 of 2 failed" in message
    assert "ValueError: boom from rank 1" in message
    assert "_innermost_helper_that_raises" in message  # the full traceback, not just the error
    assert "Traceback (most recent call last)" in info.value.tracebacks[1]
    # rank 0 was blocked in a barrier; it must be killed after the grace period, not at timeout_s
    assert elapsed < 30, f"waited {elapsed:.1f}s for a failed group"


def test_a_rank_that_dies_without_reporting_is_a_failure():
    with pytest.raises(RankFailure, match=r"(?s)rank 1 of 2 failed.*exit code 3"):
        run_ranks(2, _rank_one_dies, timeout_s=60)


def test_a_rank_that_crashes_is_reported_with_its_python_stacks():
    """A native crash (signal 11) says where the rank was: faulthandler's stacks come with the failure."""
    with pytest.raises(RankFailure, match=r"(?s)rank 1 of 2 failed.*killed by signal 11.*_native_frame_that_crashes"):
        run_ranks(2, _rank_one_crashes, timeout_s=60)


def test_a_hanging_group_is_killed_at_the_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish.*timeout_s=3"):
        run_ranks(2, _hang, str(tmp_path), timeout_s=3)
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"timeout of 3 s took {elapsed:.1f}s"
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while not all(_is_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if not _is_gone(pid)]
    assert not alive, f"rank processes {alive} survived the timeout"


def test_bad_arguments_are_rejected_before_starting_anything():
    with pytest.raises(ValueError, match="module-level function"):
        run_ranks(2, lambda rank, world_size: rank)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        run_ranks(0, _rank_one_dies)
    with pytest.raises(ValueError, match="backend 'no-such-backend' is not available"):
        run_ranks(2, _rank_one_dies, backend="no-such-backend")


def test_free_port_can_be_bound():
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
