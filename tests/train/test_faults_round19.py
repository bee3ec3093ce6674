"""Round 19 of fault hunting (docs/reliability.md, "Round 19"): a long run meeting trouble with its processes,
signals and numerics; every case in this process but the one that signals a real two-process run."""

from __future__ import annotations

import json

from tests.train.fault_probes import cli


def _prompt_file(tmp_path):
    """Prompt/completion records whose prompts are far longer than a 32-token pack: most pieces of a split
    document are prompt only, with no labelled token."""
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}: " + "blah " * 60, "completion": f"ok {i}"}) + "\n"
                            for i in range(40)))
    return path


def _train(tmp_path, *overrides, every=-1):
    out = tmp_path / "run"
    code, output = cli("train", "model.preset=tiny", "data.task=prompt_completion", f"data.path={_prompt_file(tmp_path)}",
                       "data.pack_size=32", "train.warmup_steps=0", f"output_dir={out}", "plot=false",
                       "tensorboard=false", f"checkpoint.every={every}", *overrides)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").is_file() else []
    return code, output, records


def test_a_step_without_a_labelled_token_is_skipped_not_fatal(tmp_path, recwarn):
    """Before: a step whose packs held no labelled token (pieces of documents split at ``data.pack_size``: a prompt
    alone, or a synthetic MQAR document cut before its answers, as at step 116 of the tiny model at pack_size=64)
    ended the run with exit 2, "step 0 has no labelled token" (numbered from 0, unlike every other line), hours into
    a run. Now it is skipped (no loss over zero tokens, no update), said once and counted in metrics.jsonl; torch's
    raw UserWarning of a scheduler step without an optimizer step before it (a skipped first step) is held back."""
    code, output, records = _train(tmp_path, "data.packs_per_step=1", "train.steps=2", "train.eval_every=0", every=1)
    assert code == 0, output
    assert output.count("step 1 holds no labelled token") == 1 and "Traceback" not in output, output
    assert records[0]["empty_steps"] == 1 and "loss" not in records[0] and "grad_norm" not in records[0], records
    assert "skipped 1 steps without a label" in output, output
    code, output, records = _train(tmp_path, "data.packs_per_step=1", "train.steps=3", "train.eval_every=0", every=1)
    assert code == 0 and records[-1]["empty_steps"] == 3, (output, records)  # the count resumes with the checkpoint
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


def test_held_out_packs_without_a_labelled_token_are_refused_before_step_1(tmp_path):
    """Before: ``eval_loss 0.0000 | eval_acc 0.000``, a mean over zero tokens printed as a perfect loss (the count was
    clamped to 1). Every evaluation reads the same held-out packs, so it is refused before step 1."""
    code, output, records = _train(tmp_path, "data.packs_per_step=16", "train.steps=1", "train.eval_every=1",
                                   "train.eval_packs=1")
    assert code == 2 and "held-out packs of an evaluation (train.eval_packs=1) hold no labelled token" in output, output
    assert "eval_loss" not in output and not records, output


def test_a_worker_killed_from_outside_is_named_not_its_peers_failed_collective(tmp_path, capsys):
    """Before: ``kill PID`` (SIGTERM, as a scheduler's preemption sends) of one worker of a two-process run was
    reported as the other rank's "a collective failed (... Connection reset by peer ... GLHF!)" when that rank
    reported first (a SIGTERM after a report reads as the agent's stop), and as "rank 0 was killed by SIGTERM"
    whichever rank was killed when neither reported (the lowest rank was named). The reporter now records the peers
    already ended (heartbeat left, process gone), and the agent's failures keep the order it found them in."""
    import signal
    import subprocess
    from types import SimpleNamespace

    from hybridpar.launch import REPORT, Watchdog, WorkerChannel, _outcome

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has: rank 0, killed
    (tmp_path / "heartbeat.0").write_text(str(gone.pid))
    (tmp_path / "heartbeat.1").write_text(str(__import__("os").getpid()))
    WorkerChannel(tmp_path, 1, 60).report("rank 1: a collective failed (Connection reset by peer); a peer rank died", 1)
    report = json.loads((tmp_path / REPORT).read_text())
    assert report["ended_before"] == [0], report
    failures = {1: SimpleNamespace(exitcode=1, pid=12), 0: SimpleNamespace(exitcode=-signal.SIGTERM, pid=11)}
    assert _outcome(2, failures, None, Watchdog(tmp_path, 60), report) == 1
    said = capsys.readouterr().err
    assert "rank 0 (pid 11) was killed by SIGTERM" in said and "collective" not in said, said
    # no report (the agent stopped the survivor first): the rank it found ended first, not the lowest rank
    failures = {1: SimpleNamespace(exitcode=-signal.SIGTERM, pid=12), 0: SimpleNamespace(exitcode=-signal.SIGTERM, pid=11)}
    assert _outcome(2, failures, None, Watchdog(tmp_path, 60), None) == 1
    assert "rank 1 (pid 12) was killed by SIGTERM" in capsys.readouterr().err


def test_resuming_with_another_train_steps_says_the_learning_rate_moves():
    """Before: a run of 3 steps (cosine decay to min_lr_ratio=0.1) resumed with ``train.steps=6`` trained step 4 at
    lr 1.65e-3 where its schedule had ended at 3e-4, without a word, while a changed ``train.lr`` or
    ``warmup_steps`` was said. A constant rate (``min_lr_ratio=1``) or an unchanged decay says nothing."""
    from hybridpar.config import load_config
    from hybridpar.train.run.numerics import numeric_changes

    info = {"step": 3, "config": {"train": {"steps": 3}}}
    keys = ["train.lr=0.003", "train.warmup_steps=0", "train.min_lr_ratio=0.1"]
    [note] = numeric_changes("ck", info, load_config(None, [*keys, "train.steps=6"]))
    assert "train.steps=3; resuming with 6" in note and "step 4 trains at lr 0.00165" in note and "0.0003" in note, note
    assert not numeric_changes("ck", info, load_config(None, [*keys[:2], "train.min_lr_ratio=1", "train.steps=6"]))
    assert not numeric_changes("ck", info, load_config(None, [*keys, "train.steps=3"]))
    assert not numeric_changes("ck", {**info, "step": 1}, load_config(None, [*keys[:1], "train.warmup_steps=5",
                                                                            "train.steps=6"]))  # still warming up


def test_an_interrupt_during_a_checkpoint_save_is_not_told_as_a_failed_write(tmp_path, monkeypatch):
    """Before: Ctrl-C (or a one-process run's SIGTERM, below) while DCP wrote a checkpoint was wrapped by DCP and
    reported as "saving the checkpoint of step 25 ... failed (KeyboardInterrupt: ...; 40,107 MiB free there) ... free
    space or fix the directory", exit 1. Now the interrupt goes on as itself, as one raised outside DCP did (the CLI's
    one "interrupted" line); the ``.tmp`` folder is never loaded and the next run removes it."""
    import pytest
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from hybridpar.train.run import checkpoint

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

        def wrapped(*args, **kwargs):
            raise CheckpointException("save", {0: (KeyboardInterrupt(), None)})

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        for where, stand_in in (("dcp.save", wrapped), ("_hash_own_shards", interrupted)):
            with monkeypatch.context() as patch:
                patch.setattr(checkpoint.dcp if where == "dcp.save" else checkpoint, where.split(".")[-1], stand_in)
                with pytest.raises(KeyboardInterrupt):
                    checkpoint.save_checkpoint(tmp_path, 3, model, optimizer, scheduler)
            assert [p.name for p in tmp_path.iterdir()] == ["step_00000003.tmp"], where
    finally:
        if own:
            dist.destroy_process_group()


def test_sigterm_to_a_one_process_run_releases_its_output_dir_in_one_line(tmp_path):
    """Before: ``kill PID`` (or ``timeout``, a scheduler's stop) of a run without ``--nproc-per-node`` ended it at once
    without a word, its output_dir still locked by a process that was gone (the next run: "did not finish cleanly"),
    while SIGINT and a launched job said one line. Now SIGTERM unwinds as SIGINT does: exit 143, one line, the lock
    released, every ``step_*`` folder complete (one real process, about 10 s)."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "hybridpar", "train", "model.preset=tiny", "data.pack_size=64",
                            "train.steps=100000", "checkpoint.every=1", "train.eval_every=0", f"output_dir={out}",
                            "plot=false", "tensorboard=false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "checkpoints/step_00000002").is_dir() and time.monotonic() < deadline:  # past the profiled step
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=30)
    finally:
        job.kill()
    assert job.returncode == 128 + signal.SIGTERM and err.strip().splitlines()[-1] == "hybridpar: interrupted (SIGTERM).", err
    # a save the signal cut leaves its .tmp folder (never loaded; the next run removes it), never a partial step_*
    complete = [step for step in out.glob("checkpoints/step_*") if not step.name.endswith(".tmp")]
    assert (out / ".hybridpar.lock").read_text() == "" and complete
    assert all((step / "manifest.json").is_file() for step in complete), complete


def test_a_closed_output_pipe_is_named_not_a_peer_or_bad_input(tmp_path):
    """Before: ``hybridpar train ... | head`` (or a ``tee`` that died) stopped the run at its next progress line with
    "hybridpar: error: [Errno 32] Broken pipe", exit 2 (bad input), and at ``--nproc-per-node 2`` with "rank 0: a
    collective failed ([Errno 32] Broken pipe); a peer rank died, stalled or timed out". Now it is one line naming the
    closed output and the fix, exit 1, from both paths (``worker.write_failure``)."""
    import contextlib
    import io

    from hybridpar.cli import main
    from hybridpar.worker import write_failure

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    err = io.StringIO()
    with contextlib.redirect_stdout(Closed()), contextlib.redirect_stderr(err):
        code = main(["train", "model.preset=tiny", "data.pack_size=64", "train.steps=2", f"output_dir={tmp_path / 'run'}",
                     "plot=false", "tensorboard=false"])
    said = err.getvalue().strip().splitlines()[-1]
    assert code == 1 and "the output was closed" in said and "> train.log 2>&1" in said, err.getvalue()
    assert "output was closed" in write_failure(BrokenPipeError(32, "Broken pipe"))
    assert write_failure(BrokenPipeError(32, "Broken pipe", "/x/file")) is None  # a file: not the output stream


def test_an_empty_master_addr_is_replaced_like_any_address_not_of_this_machine(monkeypatch):
    """Before: ``MASTER_ADDR=`` (set, but empty: a script's unset variable) passed the one-process check (binding ""
    works) and torch then said "environment variable MASTER_ADDR expected, but not set", exit 2."""
    import os

    from hybridpar.train.preflight import one_process_rendezvous

    for key in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded, so the teardown also removes the port the call sets
        monkeypatch.delenv(key)
    monkeypatch.setenv("MASTER_ADDR", "")
    note = one_process_rendezvous()
    assert note and note.startswith("MASTER_ADDR='' is not an address of this machine") and "127.0.0.1:" in note, note
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["MASTER_PORT"].isdigit()


def test_an_interrupt_while_hybridpar_starts_is_one_line(monkeypatch, capsys):
    """Before: Ctrl-C in a run's first seconds (importing torch, reading the config, the checks before any process)
    printed Python's KeyboardInterrupt traceback (15-36 lines), and SIGTERM there ended it without a word (exit -15):
    the one-line handling began only once the run itself started."""
    import os
    import signal
    import time

    import hybridpar.cli as cli_module

    def interrupted():
        raise KeyboardInterrupt

    def terminated():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here

    before = signal.getsignal(signal.SIGTERM)
    for stand_in, code, name in ((interrupted, 130, "SIGINT"), (terminated, 143, "SIGTERM")):
        monkeypatch.setattr(cli_module, "import_torch", stand_in)
        assert cli_module.main(["train", "model.preset=tiny"]) == code
        err = capsys.readouterr().err
        assert err == f"hybridpar: interrupted ({name}).\n", err
    assert signal.getsignal(signal.SIGTERM) is before  # put back
