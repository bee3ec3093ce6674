"""Start N real gloo ranks for a test, collect their results, never hang.

    results = run_ranks(4, check_fn, seed, timeout_s=60)   # [result of rank 0, ..., rank 3]
    results = run_each(2, check_fn, [(1,), (2,)])           # per call, by rank: one launch for both

Each rank is a separate process that
  1. sets ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)`` (the test machine has 2 cores),
  2. joins a gloo process group (gloo's pairs use TCP on 127.0.0.1; the rendezvous goes
     through a FileStore in a fresh temporary directory, see below),
  3. calls ``fn(rank, world_size, *args)``, destroys the group,
  4. sends the pickled return value back through its own pipe.

Failure rules:
  * a rank that raises makes ``run_ranks`` raise :class:`RankFailure` with the rank number
    and the full traceback text of the first failure; the other ranks get a short grace period
    to report their own errors (listed in the message), then are killed;
  * at ``timeout_s`` every rank still running is killed (SIGKILL, its whole process group)
    and ``TimeoutError`` names the ranks that had not finished.

Start-up: children come from a multiprocessing "forkserver" that has already imported torch,
torch.distributed (``set_forkserver_preload``) and the project's entry points
(``tests/distributed/warm.py``), so a child costs a fork instead of a ~1-3 s torch import. The
server starts once per test session. Set ``HYBRIDPAR_HARNESS_START_METHOD=spawn`` to use plain
spawn; spawn is also the fallback if the forkserver cannot start. Output printed by children goes
to the forkserver's stdout, which is the test session's, not necessarily the current test's
captured output; report values through the return value instead.

Rendezvous: a FileStore rather than a TCPStore on a free port. In this sandbox (gVisor
netstack) about 1 in 20 TCPStore client connects stalled for exactly 5 s (c10d's connect
retry backoff), which would add minutes to the suite; the FileStore never did (120 runs at
world sizes 4 and 8), needs no port, and cannot collide with another run.

``fn`` and ``args`` must be picklable: ``fn`` a module-level function.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["RankFailure", "free_port", "run_each", "run_ranks"]

# Modules the forkserver imports once; each child inherits them for free. The server skips a module
# that raises ImportError (transformers is in the `hf` extra) and dies on any other error, so the
# project's modules come through `warm`, which swallows their errors (the rank's own import reports
# them) and freezes the collector last. transformers' model base (~3 s to import) is preloaded
# because the HF tests' ranks each paid for it.
_FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "transformers.modeling_utils",
    "transformers.generation",
    "pytest",
    __name__,
    "tests.distributed.warm",
]
_GRACE_AFTER_FAILURE_S = 2.0  # time other ranks get to report after the first failure
_JOIN_AFTER_SUCCESS_S = 10.0  # time a rank that reported gets to exit before it is killed

_context_cache: multiprocessing.context.BaseContext | None = None


class RankFailure(RuntimeError):
    """A rank raised (or died). ``rank`` is the first to fail; ``tracebacks`` maps rank -> text."""

    def __init__(self, message: str, rank: int, tracebacks: dict[int, str]):
        super().__init__(message)
        self.rank = rank
        self.tracebacks = tracebacks


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _start_context() -> multiprocessing.context.BaseContext:
    """The forkserver context with torch preloaded, or spawn if that is unavailable."""
    global _context_cache
    if _context_cache is not None:
        return _context_cache
    method = os.environ.get("HYBRIDPAR_HARNESS_START_METHOD", "forkserver")
    if method == "forkserver":
        try:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
            # The server reads OMP_NUM_THREADS when it imports torch (libgomp init).
            saved = os.environ.get("OMP_NUM_THREADS")
            os.environ["OMP_NUM_THREADS"] = "1"
            try:
                from multiprocessing import forkserver

                forkserver.ensure_running()
            finally:
                if saved is None:
                    os.environ.pop("OMP_NUM_THREADS", None)
                else:
                    os.environ["OMP_NUM_THREADS"] = saved
            _context_cache = ctx
            return ctx
        except (ValueError, OSError, RuntimeError):
            pass
    _context_cache = multiprocessing.get_context("spawn")
    return _context_cache


class _InitFailure(RuntimeError):
    """gloo could not connect the ranks; nothing of the test ran, so the launch is retried."""


_INIT_ATTEMPTS = 3


def _fault_path(store_path: str, rank: int) -> str:
    """Where rank ``rank``'s ``faulthandler`` writes the Python stacks of a native crash (signal 11)."""
    return f"{store_path}.fault{rank}"


def _child_main(rank, world_size, store_path, backend, timeout_s, fn, args, conn):
    """Body of one rank. Sends exactly one message: ("ok", result) or ("error", (time, text))."""
    os.environ["OMP_NUM_THREADS"] = "1"
    faulthandler.enable(open(_fault_path(store_path, rank), "w"), all_threads=True)  # noqa: SIM115 - lives as long as the rank
    try:
        os.setpgid(0, 0)  # own process group, so the parent can kill anything this rank starts
    except OSError:
        pass
    try:
        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.FileStore(store_path, world_size)
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        except RuntimeError as error:
            raise _InitFailure(str(error)) from error
        result = fn(rank, world_size, *args)
        dist.destroy_process_group()
        payload = pickle.dumps(("ok", result))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent as text
        # Report before tearing anything down: the time stamp orders failures across ranks,
        # so a peer's later "connection closed" error is not mistaken for the first failure.
        payload = pickle.dumps(("error", (time.time(), traceback.format_exc())))
    conn.send_bytes(payload)
    conn.close()


def _kill(processes) -> None:
    """SIGKILL every live rank and its process group, then reap."""
    for proc in processes:
        if proc.pid is None or proc.exitcode is not None:
            continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.kill()
        except (ProcessLookupError, OSError, ValueError):
            pass
    for proc in processes:
        if proc.pid is not None:
            proc.join(timeout=5.0)


def _check_arguments(world_size, fn, timeout_s, backend) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_ranks: world_size must be a positive int, got {world_size!r}")
    if not callable(fn) or "<locals>" in getattr(fn, "__qualname__", "<locals>") or getattr(fn, "__name__", "") == "<lambda>":
        raise ValueError(
            f"run_ranks: fn must be a module-level function (picklable by name), got {fn!r}; "
            "define it at the top level of the test module"
        )
    if not timeout_s > 0:
        raise ValueError(f"run_ranks: timeout_s must be > 0, got {timeout_s!r}")
    if not isinstance(backend, str) or not dist.is_backend_available(backend):
        raise ValueError(f"run_ranks: backend {backend!r} is not available here; use backend='gloo' on CPU")


def run_ranks(world_size: int, fn, *args, timeout_s: float = 120, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    Raises RankFailure if a rank raises or dies, TimeoutError if any rank is still running
    after ``timeout_s`` seconds (all ranks are killed in both cases).
    """
    _check_arguments(world_size, fn, timeout_s, backend)
    for attempt in range(1, _INIT_ATTEMPTS + 1):
        try:
            return _launch(world_size, fn, args, timeout_s, backend)
        except RankFailure as failure:
            # On this sandbox gloo's connect occasionally drops a fresh connection ("Connection
            # closed by peer") before any test code runs (init is collective: no rank got past
            # it), so such a launch is started again.
            if attempt == _INIT_ATTEMPTS or not any("_InitFailure" in text for text in failure.tracebacks.values()):
                raise


def _each(rank, world_size, fn, calls):
    return [fn(rank, world_size, *args) for args in calls]


def run_each(world_size: int, fn, calls: list[tuple], *, timeout_s: float = 120, backend: str = "gloo") -> list[list]:
    """``fn(rank, world_size, *args)`` for each ``args`` of ``calls``, in order, on one launch of the
    ranks (one start and one process group for several jobs); ``results[call][rank]``."""
    _check_arguments(world_size, fn, timeout_s, backend)
    by_rank = run_ranks(world_size, _each, fn, list(calls), timeout_s=timeout_s, backend=backend)
    return [[results[index] for results in by_rank] for index in range(len(calls))]


def _launch(world_size: int, fn, args: tuple, timeout_s: float, backend: str) -> list:
    """One start of the ranks (see ``run_ranks``)."""
    ctx = _start_context()
    store_dir = tempfile.mkdtemp(prefix="hybridpar-ranks-")
    store_path = os.path.join(store_dir, "store")
    processes, readers = [], []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main,
                args=(rank, world_size, store_path, backend, timeout_s, fn, args, writer),
                name=f"hybridpar-rank{rank}",
                daemon=False,  # a rank may start its own workers (e.g. DataLoader); we kill it ourselves
            )
            proc.start()
            writer.close()
            processes.append(proc)
            readers.append(reader)
        fault_paths = [_fault_path(store_path, rank) for rank in range(world_size)]
        results, tracebacks = _collect(processes, readers, timeout_s, fn, fault_paths)
    finally:
        _kill(processes)
        for reader in readers:
            reader.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    if tracebacks:
        first = next(iter(tracebacks))
        others = [r for r in tracebacks if r != first]
        also = f" (ranks {others} failed too)" if others else ""
        raise RankFailure(
            f"rank {first} of {world_size} failed in {fn.__module__}.{fn.__qualname__}{also}:\n"
            f"{tracebacks[first]}",
            rank=first,
            tracebacks=tracebacks,
        )
    return results


def _collect(processes, readers, timeout_s, fn, fault_paths):
    """Wait for every rank's message. Returns (results by rank, {rank: traceback}, earliest failure first)."""
    world_size = len(processes)
    results: list = [None] * world_size
    failures: list[tuple[float, int, str]] = []  # (time of failure, rank, traceback text)
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout_s
    failure_deadline = None
    rank_of_reader = {id(r): i for i, r in enumerate(readers)}
    rank_of_sentinel = {proc.sentinel: i for i, proc in enumerate(processes)}
    while pending:
        now = time.monotonic()
        if failure_deadline is not None and now >= failure_deadline:
            break  # report the failures; the stragglers get killed
        if now >= deadline:
            if failures:
                break  # a rank failed: report that rather than the ranks it left waiting
            raise TimeoutError(
                f"run_ranks: ranks {sorted(pending)} of {world_size} did not finish "
                f"{fn.__module__}.{fn.__qualname__} within timeout_s={timeout_s}; all ranks were killed"
            )
        limit = min(deadline, failure_deadline or deadline) - now
        waitables = [readers[r] for r in pending] + [processes[r].sentinel for r in pending]
        for ready in multiprocessing.connection.wait(waitables, timeout=limit):
            rank = rank_of_sentinel[ready] if isinstance(ready, int) else rank_of_reader[id(ready)]
            if rank not in pending:
                continue
            message = _receive(readers[rank], processes[rank], fault_paths[rank])
            if message is None:
                continue  # sentinel fired before the pipe was readable; the pipe says EOF next
            pending.discard(rank)
            status, value = message
            if status == "ok":
                results[rank] = value
            else:
                failures.append((value[0], rank, value[1]))
                if failure_deadline is None:
                    failure_deadline = time.monotonic() + _GRACE_AFTER_FAILURE_S
    if not failures:
        for proc in processes:  # everyone reported: give them a moment to exit cleanly
            proc.join(timeout=_JOIN_AFTER_SUCCESS_S)
    tracebacks = {rank: text for _, rank, text in sorted(failures)}  # first failure first
    return results, tracebacks


def _receive(reader, proc, fault_path: str):
    """One rank's message, ("error", text) if it died without one (with the Python stacks
    ``faulthandler`` wrote if it crashed), None if not ready yet."""
    try:
        if not reader.poll():
            if proc.exitcode is None and proc.is_alive():
                return None
            raise EOFError
        data = reader.recv_bytes()
    except (EOFError, OSError):
        proc.join(timeout=5.0)
        code = proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        stacks = Path(fault_path).read_text(errors="replace")[-8000:] if os.path.exists(fault_path) else ""
        stacks = f"; its Python stacks at the crash:\n{stacks}" if stacks.strip() else ""
        return ("error", (time.time(), f"process exited without reporting a result ({how}){stacks}"))
    try:
        return pickle.loads(data)
    except Exception:  # noqa: BLE001 - e.g. a result class the parent cannot import
        text = "the parent could not unpickle this rank's result:\n" + traceback.format_exc()
        return ("error", (time.time(), text))
