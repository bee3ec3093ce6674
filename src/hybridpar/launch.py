"""``--nproc-per-node N``: run torchrun's agent in this process and make failures readable.

    launcher (this process: torchrun's elastic agent, a watchdog thread)
      |-- worker rank 0 .. N-1 (``python -m hybridpar <command>``, each in its own session)

The launcher and its workers share a control directory (``$HYBRIDPAR_CONTROL_DIR``):

- ``heartbeat.<rank>``: its pid; a worker thread touches it every ``min(1, T/4)`` s. A
  worker whose heartbeat is older than ``T = train.collective_timeout_s`` (stopped, or stuck
  holding the interpreter) is named and killed by the watchdog; torchrun then stops the
  others. A collective that waits longer than ``T`` fails on its own (the process groups
  get ``T`` as their timeout).
- ``report.json``: the first worker to fail writes its message there (``O_EXCL``: first
  writer wins) and exits quietly: 2 for bad input (config, data, files), 1 for a run that
  failed (non-finite values, a failed write or collective). The launcher prints that one
  message instead of torchrun's per-rank failure dump, and exits with the worker's code. On
  bad input, found as the ranks start, the reporter first stops the other workers (SIGTERM,
  which ends them at once): a peer still joining a process group would otherwise meet its
  closed connections and log them from gloo's C++. A run that failed lets its peers fail in
  turn, so they clean up (a checkpoint's staging folder).

Signals: SIGINT and SIGTERM to the launcher reach torchrun's agent, which forwards them to
every worker (their default action ends them at once) and SIGKILLs any worker still there
after 5 s; the launcher exits with 128 + the signal number. Each worker also dies with the
launcher (``PR_SET_PDEATHSIG``), so a launcher killed outright leaves no process behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from hybridpar.config_rules import quoted

CONTROL_ENV = "HYBRIDPAR_CONTROL_DIR"
PARENT_ENV = "HYBRIDPAR_LAUNCHER_PID"
TIMEOUT_ENV = "HYBRIDPAR_HEARTBEAT_TIMEOUT_S"
REPORT = "report.json"
SHUTDOWN_S = 5  # torchrun's grace between its forwarded signal and SIGKILL


# ----------------------------------------------------------------------------- worker side


def free_port() -> int:
    """A TCP port nothing on this machine listens on now (a one-process run's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ignored_rendezvous() -> str | None:
    """A notice when the environment sets ``MASTER_ADDR``/``MASTER_PORT``, which a ``--nproc-per-node``
    job does not use (torchrun's standalone rendezvous picks a free local port), or None."""
    given = [f"{key}={quoted(os.environ[key], 60)}" for key in ("MASTER_ADDR", "MASTER_PORT") if key in os.environ]
    if not given:
        return None
    return (f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} not used: --nproc-per-node starts its "
            "processes on this machine, meeting at a free 127.0.0.1 port that torchrun picks; unset "
            f"{'it' if len(given) == 1 else 'them'}, or run torchrun yourself (torchrun --master-addr ... --master-port ... "
            "-m hybridpar ...) to choose the rendezvous.")


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent exits (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    expected = os.environ.get(PARENT_ENV)
    if expected and os.getppid() != int(expected):  # the launcher died before the call
        os._exit(128 + int(sig))


class WorkerChannel:
    """A worker's side of the control directory: heartbeat and the one failure report."""

    def __init__(self, directory: str | Path, rank: int, timeout_s: float):
        self.directory, self.rank = Path(directory), rank
        self.heartbeat = self.directory / f"heartbeat.{rank}"
        self.interval = max(0.05, min(1.0, timeout_s / 4))
        self._stop = threading.Event()

    @classmethod
    def from_env(cls) -> "WorkerChannel | None":
        directory = os.environ.get(CONTROL_ENV)
        if not directory:
            return None
        return cls(directory, int(os.environ.get("RANK", "0")), float(os.environ.get(TIMEOUT_ENV, "600")))

    def start(self) -> None:
        """Default SIGINT/SIGTERM (end at once) and die with the launcher."""
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        die_with_parent()

    def start_heartbeat(self) -> None:
        """Beat from now on. Call it after the heavy imports: loading torch's libraries holds
        the interpreter lock for seconds, which would read as a stall."""
        self.heartbeat.write_text(str(os.getpid()))
        threading.Thread(target=self._beat, name="hybridpar-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                os.utime(self.heartbeat)
            except OSError:
                return

    def stop(self) -> None:
        self._stop.set()
        self.heartbeat.unlink(missing_ok=True)

    def report(self, message: str, code: int) -> bool:
        """Record the job's failure unless another rank already did; True if this one was first."""
        ended = self.ended_peers()  # before the report exists: no rank has yet ended because of it
        try:
            fd = os.open(self.directory / REPORT, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            json.dump({"rank": self.rank, "code": code, "message": message, "ended_before": ended}, handle)
        if code == 2:  # bad input (module docstring)
            self.stop_peers()
        return True

    def ended_peers(self) -> list[int]:
        """The other ranks whose process has already ended without finishing (its heartbeat file is
        still there): killed before this rank failed, so the cause of its failure."""
        return [rank for rank, pid, _ in worker_heartbeats(self.directory, time.time())
                if rank != self.rank and pid > 0 and not _alive(pid)]

    def stop_peers(self, wait_s: float = 2.0) -> None:
        """SIGTERM every other running worker and wait (at most ``wait_s``) until they are gone.
        The job ends anyway (torchrun stops the others once this rank exits); stopping them first
        keeps a peer from meeting this rank's closed connections and logging them."""
        peers = [pid for rank, pid, _ in worker_heartbeats(self.directory, time.time()) if rank != self.rank and pid > 0]
        for pid in peers:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while any(_alive(pid) for pid in peers) and time.monotonic() < deadline:
            time.sleep(0.01)


# ----------------------------------------------------------------------------- launcher side


class Watchdog(threading.Thread):
    """Names and kills a worker whose heartbeat is older than the timeout; notes the first
    worker that dies without finishing (its heartbeat file is still there)."""

    def __init__(self, directory: Path, timeout_s: float):
        super().__init__(name="hybridpar-watchdog", daemon=True)
        self.directory, self.timeout_s = directory, timeout_s
        self.stall: str | None = None
        self.first_death: int | None = None
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(0.1):
            now = time.time()
            for rank, pid, age in worker_heartbeats(self.directory, now):
                alive = _alive(pid)
                if not alive and self.first_death is None:
                    self.first_death = rank
                if age > self.timeout_s and alive:
                    state = " is stopped (SIGSTOP) and" if _process_state(pid) in ("T", "t") else ""
                    self.stall = (f"rank {rank} (pid {pid}){state} has not responded for {age:.0f} s, longer than "
                                  f"train.collective_timeout_s={self.timeout_s:g}; the job was stopped. Look for what "
                                  "held it (a debugger, a full disk, a hung device), then resume from the last checkpoint.")
                    kill_workers(self.directory)
                    return

    def stop(self) -> None:
        self._stop.set()


def worker_heartbeats(directory: Path, now: float) -> list[tuple[int, int, float]]:
    """``(rank, pid, seconds since the last beat)`` of every worker that is running."""
    out = []
    for file in directory.glob("heartbeat.*"):
        try:
            out.append((int(file.suffix[1:]), int(file.read_text() or 0), now - file.stat().st_mtime))
        except (OSError, ValueError):
            continue
    return sorted(out)


def kill_workers(directory: Path) -> None:
    for _, pid, _ in worker_heartbeats(directory, time.time()):
        if pid > 0 and _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return _process_state(pid) not in ("Z", "X")


def _process_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _quiet_torchrun() -> None:
    """torchrun's agent logs every step of a shutdown; the launcher prints one line instead."""
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logger = logging.getLogger(name)
        logger.addHandler(logging.NullHandler())
        logger.propagate = False


class _Stopped(Exception):
    def __init__(self, sig: int):
        super().__init__(sig)
        self.sig = sig


def _raise_stopped(sig, frame) -> None:
    raise _Stopped(sig)


def launch(nproc: int, worker_args: list[str], timeout_s: float) -> int:
    """Run ``python -m hybridpar <worker_args>`` on ``nproc`` local ranks; returns the exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _quiet_torchrun()
    control = Path(tempfile.mkdtemp(prefix="hybridpar-run-"))
    os.environ.update({CONTROL_ENV: str(control), PARENT_ENV: str(os.getpid()), TIMEOUT_ENV: str(timeout_s),
                       "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))})
    torchrun = parse_args(["--standalone", f"--nproc-per-node={nproc}", f"--shutdown-timeout={SHUTDOWN_S}",
                           "-m", "hybridpar", *worker_args])
    watchdog = Watchdog(control, timeout_s)
    previous = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGINT, signal.SIGTERM)}
    failures, stopped_by = None, None
    watchdog.start()
    try:
        run(torchrun)
    except ChildFailedError as error:
        failures = error.failures
    except SignalException as error:
        stopped_by = int(error.sigval)
    except _Stopped as error:
        stopped_by = error.sig
    finally:
        watchdog.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        kill_workers(control)  # nothing outlives the launcher
        report = _read_report(control)
        shutil.rmtree(control, ignore_errors=True)
    return _outcome(nproc, failures, stopped_by, watchdog, report)


def _read_report(control: Path) -> dict | None:
    try:
        return json.loads((control / REPORT).read_text())
    except (OSError, ValueError):
        return None


def _outcome(nproc: int, failures: dict | None, stopped_by: int | None, watchdog: Watchdog, report: dict | None) -> int:
    """Print the one message that explains how the job ended; returns the exit status."""
    def say(text: str) -> None:
        print(f"hybridpar: {text}", file=sys.stderr, flush=True)

    if stopped_by is not None:
        say(f"stopped by {signal.Signals(stopped_by).name}; all {nproc} workers ended.")
        return 128 + stopped_by
    if watchdog.stall is not None:
        say(f"error: {watchdog.stall}")
        return 1
    if failures is None:
        return 0
    if report is not None and report.get("code") == 2:
        say(f"error: {report['message']}")
        return 2
    killed = {rank: failure for rank, failure in failures.items() if failure.exitcode < 0}
    exited = any(f.exitcode > 0 for f in failures.values())  # a rank ended itself (it reports first, then exits)
    # after a report the others were stopped (SIGTERM: by the reporter, or by the agent once a rank ended,
    # the reporter too if it had not yet exited) or, after a rank exited, aborted in gloo's teardown when
    # their peer vanished (SIGABRT, "terminate called without an active exception"): the report is the cause
    after_exit = (signal.SIGTERM, signal.SIGABRT) if exited else (signal.SIGTERM,)
    # ... unless a killed rank had ended before the report was written (a SIGTERM from outside): it is the cause
    ended_first = [rank for rank in (report or {}).get("ended_before") or () if rank in killed]
    stopped_after_report = report is not None and not ended_first and all(-f.exitcode in after_exit for f in killed.values())
    if killed and not stopped_after_report:  # the agent SIGTERMs the others after the first death: name the first
        # ``failures`` lists first the ranks the agent found ended before it stopped the others (then by rank)
        first = ended_first or [r for r, f in killed.items() if f.exitcode != -signal.SIGTERM] or list(killed)
        rank, failure = first[0], killed[first[0]]
        say(f"error: rank {rank} (pid {failure.pid}) was killed by {signal.Signals(-failure.exitcode).name}; "
            "the job was stopped. Resume from the last checkpoint with checkpoint.resume=auto.")
        return 1
    if report is not None:
        say(f"error: {report['message']}")
        return int(report.get("code") or 1)
    rank, failure = sorted(failures.items())[0]
    say(f"error: rank {rank} exited with status {failure.exitcode}; the job was stopped.")
    return 1
