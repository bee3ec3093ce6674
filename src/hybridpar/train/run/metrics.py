"""Observability: one line per step on rank 0, JSONL metrics, TensorBoard, a loss-curve PNG.

A file task's eval records also carry ``unigram_loss``, the held-out loss of a model that
ignores context (``train/baseline.py``), printed next to ``eval_loss`` and drawn as a line.

``metrics.jsonl`` is strict JSON, one object per step: a non-finite value is ``null``. A
resumed run first drops the records after its checkpoint's step, so every step appears once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path


def notice(text: str) -> None:
    """A one-line warning for the user (callers print it from rank 0 only)."""
    print(f"hybridpar: warning: {text}", file=sys.stderr, flush=True)


def _json_value(value):
    value = float(value)
    return value if math.isfinite(value) else None


class MetricsLogger:
    """Writes metrics from rank 0 only; every other rank gets a silent logger."""

    def __init__(self, output_dir: str | Path, rank: int, tensorboard: bool = True, plot: bool = True, resume_step: int = 0):
        self.enabled = rank == 0
        self.output_dir = Path(output_dir)
        self.plot = plot
        self.curve: Path | None = None  # loss_curve.png once drawn
        self.history: list[dict] = []  # the steps of this process
        self._earlier: list[dict] = []  # records up to the resumed step, for the curve
        self._writer = None
        self._jsonl = None
        self._last_time = time.perf_counter()
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / "metrics.jsonl"
        if resume_step and path.is_file():
            self._earlier = [r for r in _read_records(path) if r.get("step", 0) <= resume_step]
        self._jsonl = open(path, "w")
        where = os.stat(self.output_dir)
        self._dir_id = (where.st_dev, where.st_ino)  # renamed or replaced: another folder now has its name
        for record in self._earlier:
            self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(str(self.output_dir / "tensorboard"))
            except ImportError:
                notice("tensorboard=true but the tensorboard package is not installed, so no TensorBoard logs are "
                       "written; pip install 'hybridpar[tensorboard]' or set tensorboard=false.")

    def log(self, step: int, metrics: dict, tokens: int | None = None, echo: bool = True) -> None:
        """Record one step; adds tokens/s (from ``tokens`` since the previous call)."""
        now = time.perf_counter()
        if tokens is not None:
            metrics = {**metrics, "tokens_per_s": tokens / max(now - self._last_time, 1e-9)}
        self._last_time = now
        if not self.enabled:
            return
        record = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
        self.history.append(record)
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self._jsonl.flush()
        self._check_still_there(step)
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and value is not None:
                    self._writer.add_scalar(key, value, step)
        if echo:
            print(format_line(record), flush=True)

    def _check_still_there(self, step: int) -> None:
        """``OutputWriteError`` where metrics.jsonl or output_dir is no longer what this run opened: removed (writes to
        the deleted file go nowhere, without error), or output_dir renamed or replaced (the metrics would go on into
        the renamed folder and the checkpoints into a new one of the old name)."""
        try:
            now = os.stat(self.output_dir)
            moved = (now.st_dev, now.st_ino) != self._dir_id
        except FileNotFoundError:
            moved = True
        if os.fstat(self._jsonl.fileno()).st_nlink and not moved:
            return
        from hybridpar.train.run.checkpoint import OutputWriteError

        raise OutputWriteError(f"output_dir {str(self.output_dir)!r} was removed, emptied or renamed during the run (its "
                               f"metrics.jsonl is gone from it); the run stopped at step {step} rather than train on "
                               "with its files split or lost. Restore the directory (or choose another output_dir) and "
                               "resume from a checkpoint you still have, or start again.")

    def close(self) -> Path | None:
        """Flush files and draw ``loss_curve.png``; returns its path (rank 0; also as ``curve``). Once."""
        if not self.enabled or self._jsonl.closed:
            return None
        self._jsonl.close()
        if self._writer is not None:
            self._writer.close()
        path = self.output_dir / "loss_curve.png"
        self.curve = plot_loss_curve(self._earlier + self.history, path) if self.plot else None
        return self.curve

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, kind, error, trace) -> None:
        """Closed on every way out. While the run's own error propagates, a failure here (the output_dir removed,
        the disk full) is not raised: it would replace that error, which names the cause."""
        if kind is None:
            self.close()
        else:
            with contextlib.suppress(Exception):
                self.close()


def _read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (an unreadable line is skipped)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append({k: _json_value(v) if isinstance(v, float) else v for k, v in record.items()})
    return records


def format_line(record: dict) -> str:
    """``step 12 | loss 2.3104 | grad_norm 0.812 | lr 2.9e-03 | 10,240 tok/s | peak 1.2 GiB``."""
    parts = [f"step {record['step']:>5d}"]
    formats = {"loss": "loss {:.4f}", "grad_norm": "grad_norm {:.3f}", "lr": "lr {:.2e}",
               "tokens_per_s": "{:,.0f} tok/s", "peak_memory_gib": "peak {:.2f} GiB",
               "tensor_peak_gib": "tensors {:.3f} GiB",
               "eval_loss": "eval_loss {:.4f}", "unigram_loss": "(unigram {:.4f})", "eval_accuracy": "eval_acc {:.3f}",
               "skipped_steps": "skipped {:.0f} non-finite steps", "empty_steps": "skipped {:.0f} steps without a label"}
    for key, fmt in formats.items():
        if key in record:
            text = fmt.format(record[key]) if record[key] is not None else f"{key} non-finite"
            if key == "unigram_loss" and "eval_loss" in record:  # beside the eval_loss it is the baseline of
                parts[-1] += " " + text
            else:
                parts.append(text)
    return " | ".join(parts)


def plot_loss_curve(history: list[dict], path: Path) -> Path | None:
    """Training (and eval) loss against step, saved as a PNG; None without matplotlib.

    A ``Figure`` of its own, not pyplot's: ``matplotlib.use("Agg")`` switched the backend of the process, so a
    notebook's plots stopped showing after a run, and pyplot kept the figure in its registry."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    train = [(r["step"], r["loss"]) for r in history if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in history if r.get("eval_loss") is not None]
    unigram = [r["unigram_loss"] for r in history if r.get("unigram_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    if unigram:
        ax.axhline(unigram[-1], linestyle="--", color="gray", label="unigram baseline (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if train or evals or unigram:  # a run stopped before its first step: no line, and matplotlib's raw warning
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def peak_memory_gib() -> float:
    """Peak resident memory of this process (CUDA allocator peak on GPU)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
