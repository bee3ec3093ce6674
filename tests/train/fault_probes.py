"""What the fault-round tests share: a refusal is one bounded line, the CLI run in this process or
as a one-process run in a harness child (a fork with torch loaded, not a fresh interpreter), and a
full disk stood in for by a file-size limit."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess

from tests.distributed.harness import run_ranks

__all__ = ["SHORT", "cli", "cli_in_child", "cli_streams", "limited_file_size", "one_line", "one_process_cli",
           "refusal_line", "saved_checkpoints"]

SHORT = 2000  # no message of bad input is longer


def one_line(error) -> str:
    """The message of a ``pytest.raises`` result, asserted to be one line shorter than ``SHORT``."""
    message = str(error.value)
    assert "\n" not in message and len(message) < SHORT, message
    return message


def refusal_line(output: str) -> str:
    """The one ``hybridpar: error:`` line of a CLI's output, asserted single and shorter than ``SHORT``."""
    [line] = [line for line in output.splitlines() if line.startswith("hybridpar: error: ")]
    assert len(line) < SHORT, line
    return line


def saved_checkpoints(tmp_path_factory, make):
    """``save(name)``: the folder of ``make(name)``'s tiny checkpoint, written by ``save_pretrained`` on first use."""
    folder = tmp_path_factory.mktemp("families")

    def save(name: str):
        path = folder / name
        if not path.exists():
            make(name).save_pretrained(path)
        return path
    return save


def cli_streams(*argv) -> tuple[int, str, str]:
    """``hybridpar`` with ``argv`` in this process: its exit code, stdout and stderr."""
    from hybridpar.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def cli(*argv) -> tuple[int, str]:
    """``hybridpar`` with ``argv`` in this process: its exit code and everything it printed."""
    code, out, err = cli_streams(*argv)
    return code, out + err


def limited_file_size(limit_bytes: int):
    """A function that makes this process's writes past ``limit_bytes`` fail with EFBIG (OSError), as on
    a full disk (a ``preexec_fn``, or called in a harness child)."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel ends the process at the limit
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return limit


def one_process_cli(rank, world_size, runs, env=None, file_size_limit=None):
    """Each argv of ``runs`` through ``cli_streams`` as a user's one-process run (no torchrun, no caller's
    group: ``main`` checks, makes and ends its own), in a harness rank. Returns ``[(exit status, stdout,
    stderr), ...]``. ``env`` is set first; ``file_size_limit``: ``limited_file_size``. The harness's
    group is left first and a one-rank group stands in again at the end."""
    import torch.distributed as dist

    dist.destroy_process_group()
    os.environ.update(env or {})
    if file_size_limit is not None:
        limited_file_size(file_size_limit)()
    results = []
    try:
        for argv in runs:
            results.append(cli_streams(*argv))
            for key in ("MASTER_ADDR", "MASTER_PORT"):  # the next run picks its own, as a new process would
                os.environ.pop(key, None)
    finally:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return results


def cli_in_child(*argv: str, env: dict | None = None, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """``hybridpar argv`` as one process (``one_process_cli``), shaped as ``subprocess.run``'s result."""
    [[(code, out, err)]] = run_ranks(1, one_process_cli, [list(argv)], env, file_size_limit, timeout_s=240)
    return subprocess.CompletedProcess(["hybridpar", *argv], code, out, err)
