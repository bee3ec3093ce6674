"""The environment variables hybridpar reads, checked before anything starts (or imports torch).

- ``OMP_NUM_THREADS`` must be a thread count (an integer >= 1, or a comma-separated list of them):
  OpenMP printed ``libgomp: Invalid value ...`` and went on with its own default.
- ``LOCAL_RANK`` and ``WORLD_SIZE`` together make a process a torchrun worker; then ``RANK``,
  ``MASTER_ADDR`` and ``MASTER_PORT`` must be there too, and the ranks in range (torch's own error
  named one variable and no fix). Without both, a process is not a worker: a ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK`` or ``LOCAL_WORLD_SIZE`` set then is said to be unused (the run
  was one process without a word).

- Variables torch reads when it is imported (``TORCH_LOGS``, ``TORCH_DISTRIBUTED_DEBUG``,
  ``LOGLEVEL``, ...): a value torch refuses was a traceback from inside ``import torch``;
  ``import_torch`` makes it one line naming the variables of torch that are set.
- ``TRANSFORMERS_VERBOSITY`` must be one of transformers' levels (it printed "Unknown option" and
  went on at its default).
- ``HYBRIDPAR_TRACEBACK`` is a switch: 1/true/yes/on or 0/false/no/off (``=0`` showed the traceback:
  any non-empty value did).

``check_environment`` raises ConfigError (one line, exit 2) or returns the notices. Imported by
``cli`` only.
"""

from __future__ import annotations

import os
import re

from hybridpar.config import ConfigError
from hybridpar.config_rules import quoted, shorten

__all__ = ["check_environment", "import_torch", "traceback_wanted"]

WORKER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
SWITCH = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False, "": False}
THREADS = re.compile(r"\s*[1-9]\d*\s*(,\s*[1-9]\d*\s*)*")


def _integer(key: str, low: int) -> int:
    text = os.environ[key]
    if not (text.strip().isdigit() and int(text) >= low):
        raise ConfigError(f"{key}={quoted(text, 60)} is invalid: it must be an integer >= {low} (torchrun sets it for "
                          "each worker); start the job with torchrun or --nproc-per-node N, or unset it.")
    return int(text)


TORCH_READS = ("TORCH_LOGS", "TORCH_LOGS_OUT", "TORCH_LOGS_FORMAT", "TORCH_DISTRIBUTED_DEBUG", "LOGLEVEL",
               "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES", "TORCH_DEVICE_BACKEND_AUTOLOAD")


def import_torch() -> None:
    """Import torch and the distributed parts hybridpar uses; ConfigError (one line) if that fails,
    naming the variables torch reads at import that are set (the usual cause)."""
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
        import torch.distributed.checkpoint  # noqa: F401
    except Exception as error:  # torch raises ValueError, RuntimeError, ... from its own module code
        text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        why = f"{type(error).__name__}: {text}" if text else type(error).__name__
        given = [f"{key}={quoted(os.environ[key], 40)}" for key in TORCH_READS if key in os.environ]
        cause = (f"torch reads {', '.join(given)} as it loads: fix or unset {'it' if len(given) == 1 else 'them'}"
                 if given else "check the torch installation (pip install torch)")
        raise ConfigError(f"importing torch failed ({shorten(why, 200)}); {cause}.") from None


TRANSFORMERS_LEVELS = ("detail", "debug", "info", "warning", "error", "critical")  # transformers.utils.logging's


def traceback_wanted() -> bool:
    """``HYBRIDPAR_TRACEBACK`` is on: print the traceback behind a one-line message."""
    return SWITCH.get(os.environ.get("HYBRIDPAR_TRACEBACK", "").strip().lower(), False)


def check_environment() -> list[str]:
    """ConfigError for a variable that cannot be used; the notices of variables that are not used.
    Call it before torch is imported (OpenMP reads ``OMP_NUM_THREADS`` when torch loads)."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is not None and not THREADS.fullmatch(threads):
        raise ConfigError(f"OMP_NUM_THREADS={quoted(threads, 60)} is not a thread count: it must be an integer >= 1 "
                          "(e.g. OMP_NUM_THREADS=4); fix it, or unset it (hybridpar then shares this machine's cores "
                          "among its processes).")
    cores = os.cpu_count() or 1
    most = max(256, 8 * cores)  # oversubscribed past this, only slower; at ~30,000 libgomp failed and the run segfaulted
    if threads is not None and max(int(t) if len(t.strip()) < 10 else 10**10 for t in threads.split(",")) > most:
        raise ConfigError(f"OMP_NUM_THREADS={quoted(threads, 60)} asks for more threads than a process here can use: it "
                          f"must be at most {most} (this machine has {cores} cores; far more threads fail to start and "
                          f"the run crashes); use the core count, e.g. OMP_NUM_THREADS={cores}, or unset it.")
    switch = os.environ.get("HYBRIDPAR_TRACEBACK", "")
    if switch.strip().lower() not in SWITCH:
        raise ConfigError(f"HYBRIDPAR_TRACEBACK={quoted(switch, 60)} is invalid: it must be 1 (print the traceback behind "
                          "an error message) or 0 (true/false, yes/no, on/off also do); fix it, or unset it.")
    verbosity = os.environ.get("TRANSFORMERS_VERBOSITY")
    if verbosity is not None and verbosity not in TRANSFORMERS_LEVELS:  # transformers printed its own line (lower case only)
        raise ConfigError(f"TRANSFORMERS_VERBOSITY={quoted(verbosity, 60)} is not a transformers log level: it must be "
                          f"one of {', '.join(TRANSFORMERS_LEVELS)} (lower case); fix it, or unset it (hybridpar shows transformers' "
                          "errors only).")
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a torchrun worker: every variable it needs
        missing = [key for key in ("RANK", "MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
        if missing:
            raise ConfigError(f"LOCAL_RANK and WORLD_SIZE are set, so this process takes itself for a torchrun worker, "
                              f"but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not; start the job with "
                              "torchrun (or hybridpar --nproc-per-node N), or unset LOCAL_RANK and WORLD_SIZE to run "
                              "one process.")
        world, rank, local = _integer("WORLD_SIZE", 1), _integer("RANK", 0), _integer("LOCAL_RANK", 0)
        if rank >= world or local >= world:
            raise ConfigError(f"RANK={rank} and LOCAL_RANK={local} must be below WORLD_SIZE={world}; start the job "
                              "with torchrun (or hybridpar --nproc-per-node N), which sets them.")
        return []
    given = [f"{key}={quoted(os.environ[key], 40)}" for key in WORKER_KEYS if key in os.environ]
    if not given:
        return []
    return [f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} not used: without both LOCAL_RANK and WORLD_SIZE "
            "this is not a torchrun worker, so the run is one process (or --nproc-per-node N of them); start it with "
            f"torchrun to join a job, or unset {'it' if len(given) == 1 else 'them'}."]
