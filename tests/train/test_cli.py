"""The command line as a user runs it: torchrun started by hybridpar itself, and plan; bad
input, signals, a stopped or killed rank. Every process has a timeout; none can hang.

What is about the process (torchrun launched, exit status and stderr of ``python -m hybridpar``,
signals, a stopped or killed rank) runs as a subprocess; what is about a verb's checks or output
(plan, a layout refused before launch, which config errors are caught) calls ``cli.main`` here."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = str(ROOT / "configs" / "tiny-hybrid.yaml")


def hybridpar(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridpar", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_check_through_torchrun_started_by_hybridpar(tmp_path):
    result = hybridpar("check", "--config", DEFAULT, "--nproc-per-node", "2", "parallel.tp=1", "parallel.cp=2",
                       "parallel.sequence_parallel=false", "parallel.cp_mamba=state", "model.dtype=float64",
                       "model.preset=tiny", "data.pack_size=256", f"output_dir={tmp_path}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check exact" in result.stdout and "cp_mamba=state" in result.stdout


def test_nproc_that_does_not_fit_the_layout_is_refused_before_launch(capsys):
    from hybridpar.cli import main

    assert main(["train", "--config", DEFAULT, "--nproc-per-node", "2", "parallel.tp=2"]) == 2
    err = capsys.readouterr().err
    assert "--nproc-per-node 2 does not fit" in err and "pass --nproc-per-node 4" in err and err.count("\n") == 1


def test_a_layout_for_more_processes_without_nproc_says_how_many(capsys):
    from hybridpar.cli import main

    assert main(["train", "--config", DEFAULT, "parallel.tp=2"]) == 2  # cp=2 x tp=2 needs 4 processes
    assert capsys.readouterr().err == ("hybridpar: error: one process (no --nproc-per-node) does not fit the layout "
                                       "dp_replicate*dp_shard*cp*tp = 1*1*2*2 = 4; pass --nproc-per-node 4 or change "
                                       "parallel.*.\n")


def test_plan_prints_memory_traffic_and_an_estimate(capsys):
    from hybridpar.cli import main

    code = main(["plan", "--config", DEFAULT, "model.preset=nemotronh-8b", "parallel.cp=8", "parallel.tp=1",
                 "data.pack_size=131072"])
    out = capsys.readouterr()
    assert code == 0, out.err
    for part in ("parameters", "peak:", "all_to_all/cp", "ESTIMATE"):
        assert part in out.out, part


# -- the launcher under faults: one message, exit 2 for bad input, nothing left running ----------

FAST = ["model.preset=tiny", "parallel.cp=2", "parallel.tp=1", "parallel.sequence_parallel=false", "train.steps=100000",
        "train.eval_every=0", "plot=false", "data.pack_size=64", "data.packs_per_step=2",
        "data.task_options={min_len: 16, max_len: 96, num_kv_pairs: 2, vocab_size: 32}"]
NOISE = ("Traceback", "torch.distributed", "ChildFailedError", "Sending process", "elastic")


def _descendants(pid: int) -> list[int]:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Launched:
    """``hybridpar train --nproc-per-node 2`` in the background, read until its first step."""

    def __init__(self, tmp_path, *overrides, startup_s: float = 300):
        import queue
        import threading

        self.process = subprocess.Popen(
            [sys.executable, "-m", "hybridpar", "train", "--nproc-per-node", "2", "--config", DEFAULT, *FAST,
             f"output_dir={tmp_path}", *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.stdout: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.process.stdout], daemon=True).start()
        deadline = time.monotonic() + startup_s
        while not any(line.startswith("step") for line in self.stdout):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError((self.stdout, self.process.wait(), self.process.stderr.read()))
            try:
                self.stdout.append(self.lines.get(timeout=1))
            except queue.Empty:
                pass
        self.workers = [pid for pid in _descendants(self.process.pid) if _running(pid)]
        ranks = {Path(f"/proc/{pid}/environ").read_bytes().split(b"\0").count(b"RANK=1"): pid for pid in self.workers}
        self.rank1 = ranks.get(1)

    def finish(self, within_s: float) -> tuple[int, float, str]:
        started = time.monotonic()
        code = self.process.wait(timeout=within_s)
        return code, time.monotonic() - started, self.process.stderr.read()

    def __enter__(self) -> "Launched":
        return self

    def __exit__(self, *exc) -> None:  # whatever happened, nothing outlives the test
        if self.process.poll() is None:
            self.process.kill()  # its workers die with it (PR_SET_PDEATHSIG)
            self.process.wait(timeout=30)


def test_a_config_error_at_any_process_count_exits_2_with_one_line_before_launch(tmp_path, capsys):
    """A broken YAML file as a real ``python -m hybridpar`` (its exit status and everything it printed);
    the other kinds of config error take the same way out of ``cli.main``, checked here in-process."""
    from hybridpar.cli import main

    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  steps: [3\n")
    result = hybridpar("train", "--nproc-per-node", "4", "--config", str(broken), f"output_dir={tmp_path}")
    assert result.returncode == 2 and result.stdout == "", result
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("hybridpar: error: "), result.stderr
    for args in (["--config", DEFAULT, "train.log_every=0"], ["--config", DEFAULT, "train.betas=[0.9,"],
                 ["--config", DEFAULT, "train.lr=1e-3", "checkpoint.keep=0"]):
        for nproc in (["--nproc-per-node", "4"], []):  # a launch, and one process
            assert main(["train", *nproc, *args, f"output_dir={tmp_path}"]) == 2, args
            out = capsys.readouterr()
            assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("hybridpar: error: "), out


def test_an_error_found_on_the_ranks_is_printed_once_and_exits_2(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "one"}\n{"text": "two"}\n{"text": three}\n')
    result = hybridpar("train", "--nproc-per-node", "2", "--config", DEFAULT, *FAST[:3], "data.task=jsonl",
                       f"data.path={data}", "data.task_options={}", f"output_dir={tmp_path / 'run'}")
    assert result.returncode == 2, result
    assert result.stderr.strip().splitlines() == [
        f"hybridpar: error: {data}:3: not valid JSON (Expecting value at column 10); every line must be one JSON "
        "object: fix or remove that line."]


def test_the_rank_that_reports_bad_input_stops_the_others_before_it_exits(tmp_path):
    """Else a peer can meet the reporter's closed connections first and log them from C++ (gloo's
    "connectFullMesh failed ... Connection closed by peer") above the job's one line. A run that
    failed (exit 1) leaves its peers to fail in turn and clean up (a checkpoint's staging folder)."""
    from hybridpar.launch import WorkerChannel

    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for code, directory in ((1, tmp_path / "run_failed"), (2, tmp_path / "bad_input")):
            directory.mkdir()
            (directory / "heartbeat.0").write_text(str(os.getpid()))  # the reporter: this process, not stopped
            (directory / "heartbeat.1").write_text(str(peer.pid))
            assert WorkerChannel(directory, 0, 600).report("its message", code)
            if code == 1:
                assert peer.poll() is None
        assert peer.wait(timeout=5) == -signal.SIGTERM
        assert not WorkerChannel(directory, 1, 600).report("a collective failed", 1)  # the first report stands
    finally:
        peer.kill()


def test_a_failed_torchrun_rank_keeps_its_connections_until_it_has_reported(tmp_path):
    """On bad input its peers are stopped by the report (above); a rank that closed its process group
    first let a peer still joining a group log gloo's "connectFullMesh failed ... Connection closed by peer"."""
    from hybridpar.launch import free_port

    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "one"}\n{"text": two}\n')
    script = ("import sys, torch.distributed as dist\n"
              "from hybridpar.cli import parse_args\nfrom hybridpar.config import load_config\nfrom hybridpar.worker import run\n"
              "args = parse_args(sys.argv[1:])\n"
              "try:\n    run(args, load_config(args.config, args.overrides))\n"
              "except ValueError:\n    print('failed; group kept:', dist.is_initialized())\n")
    env = {**os.environ, "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-c", script, "train", "--config", DEFAULT, *FAST[:2], "parallel.cp=1",
                           "data.task=jsonl", f"data.path={data}", "data.task_options={}", f"output_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.stdout.strip().splitlines()[-1:] == ["failed; group kept: True"], done.stdout + done.stderr[-2000:]


def test_sigterm_to_the_launcher_ends_every_worker_and_feedback_comes_once(tmp_path):
    with Launched(tmp_path, "checkpoint.every=1", "checkpoint.keep=1", "train.log_every=1") as job:
        while not any(line.startswith("saved checkpoint") for line in job.stdout):
            job.stdout.append(job.lines.get(timeout=120))
        assert len(job.workers) == 2, job.workers
        job.process.send_signal(signal.SIGTERM)
        code, seconds, stderr = job.finish(within_s=30)
    time.sleep(0.2)
    assert code == 128 + signal.SIGTERM and seconds < 10 and not [p for p in job.workers if _running(p)]
    assert "hybridpar: stopped by SIGTERM; all 2 workers ended." in stderr
    assert job.stdout[0].startswith("building the model") and job.stdout[1].startswith("packing: several documents")
    assert job.stdout[2].startswith("first step")
    import importlib.util

    tensorboard_warnings = stderr.count("tensorboard=true but the tensorboard package is not installed")
    assert tensorboard_warnings == (0 if importlib.util.find_spec("tensorboard") else 1), stderr
    assert stderr.count("split") == 1, stderr  # documents longer than a pack: warned by one rank, once
    assert not any(noise in stderr for noise in NOISE), stderr


def test_a_stopped_rank_ends_the_job_within_the_collective_timeout(tmp_path):
    # 15 s, not less: on the suite's two loaded cores a rank's heartbeat thread once waited 8 s for the interpreter
    # while the model was built, and the job stopped before its first step; and 20 s for the watchdog to see the
    # stall and the launcher to end the job (11 s once beside other 4-rank tests) (session 32)
    with Launched(tmp_path, "checkpoint.every=-1", "train.collective_timeout_s=15") as job:
        os.kill(job.rank1, signal.SIGSTOP)
        code, seconds, stderr = job.finish(within_s=60)
    assert code == 1 and seconds < 15 + 20, (code, seconds, stderr, job.workers, job.rank1)
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"hybridpar: error: rank 1 (pid {job.rank1}) is stopped (SIGSTOP) and has not responded"), stderr
    assert stderr.count("error") == 1 and not [p for p in job.workers if _running(p)]


def test_a_killed_rank_ends_the_job_naming_it(tmp_path):
    with Launched(tmp_path, "checkpoint.every=-1") as job:
        os.kill(job.rank1, signal.SIGKILL)
        code, seconds, stderr = job.finish(within_s=60)
    assert code == 1 and seconds < 10, (code, seconds, stderr)
    assert stderr.strip().splitlines()[-1] == (f"hybridpar: error: rank 1 (pid {job.rank1}) was killed by SIGKILL; the "
                                               "job was stopped. Resume from the last checkpoint with checkpoint.resume=auto.")
    assert stderr.count("error") == 1, stderr
    assert not [p for p in job.workers if _running(p)]


# -- verbs with their own flags, and --dry-run ------------------------------------------------------


def test_each_verb_has_its_own_flags_and_help(capsys):
    import pytest

    from hybridpar.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    listing = capsys.readouterr().out
    assert exit_.value.code == 0 and all(verb in listing for verb in ("train", "check", "plan", "generate"))
    own = {"train": ("--nproc-per-node", "--dry-run"), "check": ("--tolerance", "--nproc-per-node", "--dry-run"), "plan": ("--fit", "--world-size"),
           "generate": ("--prompt", "--hf-path", "--dry-run")}
    for verb, flags in own.items():
        with pytest.raises(SystemExit) as exit_:
            main([verb, "--help"])
        text = capsys.readouterr().out
        others = {flag for other, names in own.items() if other != verb for flag in names} - set(flags)
        assert exit_.value.code == 0 and all(f in text for f in flags) and not [f for f in others if f in text], (verb, text)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", DEFAULT, "--prompt", "x"])
    assert exit_.value.code == 2 and "unrecognized arguments: --prompt" in capsys.readouterr().err


def test_dry_run_checks_what_train_checks_and_writes_nothing(tmp_path, capsys):
    from hybridpar.cli import main

    out = tmp_path / "run"
    assert main(["train", "--config", DEFAULT, "--nproc-per-node", "2", f"output_dir={out}", "--dry-run"]) == 0
    assert capsys.readouterr().out == "dry run: config and layout valid for 2 processes\n"
    stdlib = str(ROOT / "configs" / "text-stdlib.yaml")  # data.tokenizer=bpe: not trained by a dry run
    assert main(["train", "--config", stdlib, "--nproc-per-node", "2", f"output_dir={out}", "--dry-run"]) == 0
    assert main(["check", "--config", DEFAULT, "--nproc-per-node", "4", "parallel.tp=2", f"output_dir={out}",
                 "--dry-run"]) == 0
    assert not out.exists()
    capsys.readouterr()
    assert main(["train", "--config", DEFAULT, f"output_dir={out}", "--dry-run"]) == 2  # cp=2 on one process
    assert "pass --nproc-per-node 2" in capsys.readouterr().err
    assert main(["train", "--config", DEFAULT, "--nproc-per-node", "2", "data.task=jsonl", f"data.path={tmp_path}/none",
                 "data.task_options={}", f"output_dir={out}", "--dry-run"]) == 2
    assert "is not a file" in capsys.readouterr().err and not out.exists()
    assert main(["generate", "--checkpoint", str(out), "--prompt", "k", "--max-new-tokens", "2", "--top-p", "0",
                 "--dry-run"]) == 2
    assert "--top-p 0.0 must be in (0, 1]" in capsys.readouterr().err


def test_a_rank_that_reported_and_was_then_stopped_is_not_blamed_on_the_stop(capsys):
    """Every rank of a failed `check` reports and exits 1. When rank 0 wrote the report first but rank 1
    exited first, the agent SIGTERMs rank 0 while it ends: the launcher said "rank 0 was killed by
    SIGTERM ... resume from the last checkpoint" instead of the report."""
    from types import SimpleNamespace

    from hybridpar.launch import Watchdog, _outcome

    failures = {0: SimpleNamespace(exitcode=-signal.SIGTERM, pid=11), 1: SimpleNamespace(exitcode=1, pid=12)}
    report = {"rank": 0, "code": 1, "message": "check failed (see its output above)."}
    watchdog = Watchdog(Path("."), 60)
    assert _outcome(2, failures, None, watchdog, report) == 1
    assert capsys.readouterr().err == "hybridpar: error: check failed (see its output above).\n"
    # a rank that aborted in teardown after its peer exited (SIGABRT): the report is still the cause
    failures[0] = SimpleNamespace(exitcode=-signal.SIGABRT, pid=11)
    assert _outcome(2, failures, None, watchdog, report) == 1
    assert capsys.readouterr().err == "hybridpar: error: check failed (see its output above).\n"
    # the reporter stopped its peer, and the agent stopped the reporter before it exited: the report again
    failures = {0: SimpleNamespace(exitcode=-signal.SIGTERM, pid=11), 1: SimpleNamespace(exitcode=-signal.SIGTERM, pid=12)}
    assert _outcome(2, failures, None, watchdog, {**report, "rank": 1}) == 1
    assert capsys.readouterr().err == "hybridpar: error: check failed (see its output above).\n"
    # a rank killed from outside (SIGKILL) is still named, whatever the others reported
    failures = {0: SimpleNamespace(exitcode=-signal.SIGTERM, pid=11), 1: SimpleNamespace(exitcode=-signal.SIGKILL, pid=12)}
    assert _outcome(2, failures, None, watchdog, report) == 1
    assert "rank 1 (pid 12) was killed by SIGKILL" in capsys.readouterr().err
