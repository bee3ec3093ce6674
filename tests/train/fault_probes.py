"""What the fault-round tests share: a refusal is one bounded line, and the CLI run in this process."""

from __future__ import annotations

import contextlib
import io

from tests.train.test_faults_round3 import SHORT

__all__ = ["cli", "one_line"]


def one_line(error) -> str:
    """The message of a ``pytest.raises`` result, asserted to be one line shorter than ``SHORT``."""
    message = str(error.value)
    assert "\n" not in message and len(message) < SHORT, message
    return message


def cli(*argv) -> tuple[int, str]:
    """``hybridpar`` with ``argv`` in this process: its exit code and everything it printed."""
    from hybridpar.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue() + err.getvalue()
