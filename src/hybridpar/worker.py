"""One rank of a job: join the world, run the verb, and report a failure once.

``hybridpar.cli`` parses and checks the command line before any process starts; each rank
(torchrun's, or the one process of a run without ``--nproc-per-node``) comes here. A failure
becomes one line: exit 2 for bad input, 1 for a run that failed (a non-finite loss, a refused
write, a peer that died or stalled), reported to the launcher once (``hybridpar.launch``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import errno
import logging
import os
import signal
import sys
import traceback
import warnings

from hybridpar.config import ConfigError, RepeatedOverride, RunConfig, load_config
from hybridpar.environment import traceback_wanted

# Bad input: exit 2 with the message alone (HYBRIDPAR_TRACEBACK=1 adds the traceback).
INPUT_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError)


def launched_by_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(timeout_s: float = 600.0) -> tuple:
    """Join the torchrun world, or make a one-process world; collectives time out after ``timeout_s``.

    Returns ``(device, owns_group)``; a caller that already set up a group keeps it.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    cuda = torch.cuda.is_available()
    owns_group = not dist.is_initialized()
    if owns_group:
        timeout = datetime.timedelta(seconds=timeout_s)
        # The device mesh creates its groups with torch's default timeout (30 min on gloo); make it ours.
        distributed_c10d.default_pg_timeout = timeout
        if launched_by_torchrun():
            if cuda:
                local, gpus = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
                if local >= gpus:  # set_device raised CUDA's "invalid device ordinal" traceback
                    raise ConfigError(f"LOCAL_RANK={local} names a GPU this machine does not have (it has {gpus}, "
                                      f"cuda:0 to cuda:{gpus - 1}); start at most {gpus} processes per machine "
                                      f"(torchrun --nproc-per-node {gpus}), or hide the GPUs (CUDA_VISIBLE_DEVICES=) "
                                      "to run every process on the CPU with gloo.")
                torch.cuda.set_device(local)
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            from hybridpar.launch import free_port

            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, timeout=timeout)
    if dist.get_rank() != 0:
        warnings.simplefilter("ignore")  # every rank runs the same code: rank 0 warns once for the job
    if not cuda:
        # The cores shared among this machine's ranks, unless OMP_NUM_THREADS says otherwise: two
        # processes that each spin two OpenMP threads on two cores run many times slower.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched_by_torchrun() else 1
        threads = os.environ.get("OMP_NUM_THREADS", "")
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0
                              else max(1, (os.cpu_count() or 1) // local_world))
    return torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"), owns_group


def check_world(config: RunConfig, nproc: int | None) -> None:
    """The layout needs ``nproc`` processes (None: no ``--nproc-per-node``, one process)."""
    from hybridpar.train.preflight import parallel_dims

    p, needed = config.parallel, parallel_dims(config).world_size
    if needed != (nproc or 1):
        torchrun = launched_by_torchrun()  # WORLD_SIZE is the job's: torchrun's --nnodes * --nproc-per-node
        given = f"WORLD_SIZE={nproc} (set by torchrun)" if torchrun else \
            f"--nproc-per-node {nproc}" if nproc else "one process (no --nproc-per-node)"
        fix = f"start torchrun with --nnodes x --nproc-per-node = {needed}" if torchrun else f"pass --nproc-per-node {needed}"
        raise ConfigError(f"{given} does not fit the layout dp_replicate*dp_shard*cp*tp = "
                          f"{p.dp_replicate}*{p.dp_shard}*{p.cp}*{p.tp} = {needed}; {fix} or change parallel.*.")


def checked_layout(config: RunConfig, args: argparse.Namespace, nproc: int | None) -> RunConfig:
    """The config whose layout the checks hold to the process count. ``check --packing`` runs one process's
    comparison on each process, so ``parallel.*`` plays no part there (its header says so): its processes are
    checked as replicas, and a layout such as ``parallel.cp=2`` no longer demands ``--nproc-per-node 2``."""
    if not getattr(args, "packing", False):
        return config
    from hybridpar.config import ParallelConfig

    return dataclasses.replace(config, parallel=ParallelConfig(dp_replicate=nproc or 1))


class Terminated(KeyboardInterrupt):
    """SIGTERM to a one-process run, unwound as SIGINT is: the output_dir lock released, one line, exit 143."""


@contextlib.contextmanager
def sigterm_unwinds():
    """While the block runs, SIGTERM raises ``Terminated`` (the main thread only; an ignored SIGTERM stays ignored).
    A one-process run ended at once without a word and left its output_dir locked by a process that was gone."""
    def stop(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: the default stays
        previous = None
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, previous)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# What a run sets in its process's environment: the one-process rendezvous (``init_distributed``, preflight's port),
# the launcher's control variables and OpenMP's thread count (``launch``), and torchrun's agent's signal list.
RUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE", "HYBRIDPAR_CONTROL_DIR",
           "HYBRIDPAR_LAUNCHER_PID", "HYBRIDPAR_HEARTBEAT_TIMEOUT_S")
QUIETED_LOGGERS = ("torch.distributed.tensor._redistribute", "torch.distributed.elastic", "torch.distributed.run",
                   "torch.distributed.launcher", "torch._higher_order_ops.wrap")  # the last: compiled_blocks


@contextlib.contextmanager
def process_state_kept():
    """A run called from Python (``cli.main`` in a notebook or a sweep) leaves its process as it found it, so a
    second run behaves as in a fresh process: the variables of ``RUN_ENV`` (a second run said "MASTER_PORT=... is
    in use" of the first run's port; a launched run left ``OMP_NUM_THREADS=1`` and its control folder's path for
    every later process), torch's thread count, TF32 precision (after a run, ``torch.get_float32_matmul_precision()``
    raised torch's "mix of the legacy and new APIs"), ``sys.excepthook`` (``init_process_group`` wraps it: each run
    added a ``[rank0]:`` prefix to every later traceback), torch's default process-group timeout, the warning
    filters, the loggers hybridpar quiets, the packer's once-per-run notice, the dynamo settings ``parallel.compile``
    changes, and torch's random generators (a run seeds them with ``train.seed``: the caller's later draws repeated
    from run to run). The run itself sees torch's default dtype of a fresh process, float32, whatever the caller
    set."""
    import torch
    from torch.distributed import distributed_c10d

    env = {key: os.environ.get(key) for key in RUN_ENV}
    hook, pg_timeout, threads = sys.excepthook, distributed_c10d.default_pg_timeout, torch.get_num_threads()
    precision = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    loggers = {name: (log.level, list(log.handlers), log.propagate)
               for name, log in ((name, logging.getLogger(name)) for name in QUIETED_LOGGERS)}
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    dtype = torch.get_default_dtype()
    if (compiled := sys.modules.get("hybridpar.parallel.compiled_blocks")) is not None:
        compiled.DYNAMO_BEFORE.clear()  # what the caller set before stays set
    torch.set_default_dtype(torch.float32)  # as in a fresh process: a caller's float64 default changed the losses
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=cuda):  # train.seed seeds torch's generators
            yield
    finally:
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        sys.excepthook, distributed_c10d.default_pg_timeout = hook, pg_timeout
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = precision
        for name, (level, handlers, propagate) in loggers.items():
            log = logging.getLogger(name)
            log.setLevel(level)
            log.handlers[:], log.propagate = handlers, propagate
        if (batches := sys.modules.get("hybridpar.train.batches")) is not None:
            batches.PackStream._warned = False  # "shown once per process" meant once per run: said by the next run too
        if (compiled := sys.modules.get("hybridpar.parallel.compiled_blocks")) is not None:
            compiled.restore_dynamo_settings()  # the recompile limit, the checkpoint's side effects


def quiet_known_warnings() -> None:
    """Silence two torch notices that do not apply: the trainer never edits the logits in
    place (FSDP's view warning), and the 2-D gradient-norm reduction is deliberate."""
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def run(args: argparse.Namespace, config: RunConfig) -> int:
    quiet_known_warnings()
    if args.command == "plan":
        from hybridpar.plan.command import run_plan

        return run_plan(args, config)
    if launched_by_torchrun():  # a WORLD_SIZE the layout does not take: refused before the rendezvous waits for it
        world = int(os.environ["WORLD_SIZE"])
        check_world(checked_layout(config, args, world), world)
    device, owns_group = init_distributed(config.train.collective_timeout_s)
    import torch.distributed as dist

    finished = False
    try:
        if args.command == "train":
            from hybridpar.train.trainer import Trainer

            Trainer(config, device).fit()
            code = 0
        elif getattr(args, "packing", False):
            from hybridpar.train.proof.packing import run_packing_check

            code = run_packing_check(config, device, args.tolerance)
        else:
            from hybridpar.train.proof.layout import run_check

            code = run_check(config, device, args.tolerance)
        if owns_group:
            dist.barrier()  # no rank tears its connections down while another still works (rank 0's sample)
        finished = True
        return code
    finally:
        # A torchrun rank that failed keeps its connections: it reports (on bad input stopping the
        # others first, ``launch.WorkerChannel.report``) and exits. Closing them here, before that,
        # let a peer still joining a group meet them closed and log gloo's "connectFullMesh failed ...
        # Connection closed by peer" from C++ above the job's one line.
        if owns_group and (finished or not launched_by_torchrun()):
            dist.destroy_process_group()


def error_message(error: BaseException) -> str:
    if traceback_wanted():
        traceback.print_exception(error)
    return str(error) if not isinstance(error, (FileNotFoundError, PermissionError)) or not error.filename else \
        f"{error.strerror}: {error.filename}"


def write_failure(error: BaseException) -> str | None:
    """The one line for a write the system refused (disk full, quota, file too large, read-only, a closed output
    pipe), or None."""
    if isinstance(error, BrokenPipeError) and error.filename is None:  # print() into a pipe whose reader ended
        return ("the output was closed (the program reading it, e.g. '| head', ended), so a line could not be printed; "
                "hybridpar stopped. Send the output to a file (> train.log 2>&1) or keep its reader open (a training run "
                "resumes with checkpoint.resume=auto).")
    if not isinstance(error, OSError) or error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
        return None
    where = f": {error.filename}" if error.filename else ""
    return f"writing failed ({error.strerror}{where}); the run stopped. Free space, then resume with checkpoint.resume=auto."


def collective_failure(error: BaseException) -> bool:
    """A collective that failed because a peer died, stalled or timed out."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Timed out waiting",
                                      "timed out", "Broken pipe", "gloo"))


def worker_main(args: argparse.Namespace) -> int:
    """One rank of a torchrun job: run, and report a failure once (see ``hybridpar.launch``)."""
    from hybridpar.launch import WorkerChannel
    from hybridpar.train.nonfinite import NonFiniteError
    from hybridpar.train.run.checkpoint import OutputWriteError

    channel = WorkerChannel.from_env()
    rank = int(os.environ.get("RANK", "0"))
    if channel is not None:
        channel.start()
        import hybridpar.train.trainer  # noqa: F401  (the heavy imports, before the heartbeat starts)

        channel.start_heartbeat()

    def fail(message: str, code: int) -> int:
        if channel is None:  # a torchrun the user started: each rank says what it saw
            print(f"hybridpar: error (rank {rank}): {message}", file=sys.stderr, flush=True)
        else:
            channel.report(message, code)  # the launcher prints the first report, once
        return code

    try:
        with warnings.catch_warnings():
            if channel is not None:  # hybridpar's launcher read the same command line and said it
                warnings.simplefilter("ignore", RepeatedOverride)
            config = load_config(args.config, args.overrides)
        code = run(args, config)
        if code:  # check out of tolerance: its table says which quantities
            return fail(f"{args.command} failed (see its output above).", code)
        return 0
    except INPUT_ERRORS as error:
        return fail(error_message(error), 2)
    except (NonFiniteError, OutputWriteError) as error:  # the run stopped for the reason it names
        return fail(str(error), 1)
    except Exception as error:  # noqa: BLE001 - a peer's death, a full disk or a bug
        refused_write = write_failure(error)
        if refused_write:
            return fail(f"rank {rank}: {refused_write}", 1)
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        if collective_failure(error):
            return fail(f"rank {rank}: a collective failed ({first_line}); a peer rank died, stalled or timed out "
                        f"(train.collective_timeout_s).", 1)
        traceback.print_exc()
        return fail(f"rank {rank} failed with {type(error).__name__}: {first_line} (traceback above).", 1)
    finally:
        if channel is not None:
            channel.stop()
