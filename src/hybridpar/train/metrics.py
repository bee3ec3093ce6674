"""Observability: one line per step on rank 0, JSONL metrics, TensorBoard, a loss-curve PNG."""

from __future__ import annotations

import json
import time
from pathlib import Path


class MetricsLogger:
    """Writes metrics from rank 0 only; every other rank gets a silent logger."""

    def __init__(self, output_dir: str | Path, rank: int, tensorboard: bool = True, plot: bool = True, append: bool = False):
        self.enabled = rank == 0
        self.output_dir = Path(output_dir)
        self.plot = plot
        self.history: list[dict] = []
        self._writer = None
        self._jsonl = None
        self._last_time = time.perf_counter()
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.output_dir / "metrics.jsonl", "a" if append else "w")  # append when resuming
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(str(self.output_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self._writer = None

    def log(self, step: int, metrics: dict, tokens: int | None = None, echo: bool = True) -> None:
        """Record one step; adds tokens/s (from ``tokens`` since the previous call)."""
        now = time.perf_counter()
        if tokens is not None:
            metrics = {**metrics, "tokens_per_s": tokens / max(now - self._last_time, 1e-9)}
        self._last_time = now
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.history.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._writer is not None:
            for key, value in record.items():
                if key != "step":
                    self._writer.add_scalar(key, value, step)
        if echo:
            print(format_line(record), flush=True)

    def close(self) -> Path | None:
        """Flush files and draw ``loss_curve.png``; returns its path (rank 0)."""
        if not self.enabled:
            return None
        self._jsonl.close()
        if self._writer is not None:
            self._writer.close()
        return plot_loss_curve(self.history, self.output_dir / "loss_curve.png") if self.plot else None


def format_line(record: dict) -> str:
    """``step 12 | loss 2.3104 | grad_norm 0.812 | lr 2.9e-03 | 10,240 tok/s | peak 1.2 GiB``."""
    parts = [f"step {record['step']:>5d}"]
    formats = {"loss": "loss {:.4f}", "grad_norm": "grad_norm {:.3f}", "lr": "lr {:.2e}",
               "tokens_per_s": "{:,.0f} tok/s", "peak_memory_gib": "peak {:.2f} GiB",
               "eval_loss": "eval_loss {:.4f}", "eval_accuracy": "eval_acc {:.3f}"}
    for key, fmt in formats.items():
        if key in record:
            parts.append(fmt.format(record[key]))
    return " | ".join(parts)


def plot_loss_curve(history: list[dict], path: Path) -> Path | None:
    """Training (and eval) loss against step, saved as a PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def peak_memory_gib() -> float:
    """Peak resident memory of this process (CUDA allocator peak on GPU)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
