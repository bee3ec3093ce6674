"""Non-finite values stop a run (or skip a step), and never reach a checkpoint.

The loss and the gradient norm of a step are global (all-reduced), so every rank sees
the same values and takes the same decision without another collective:

    finite(loss) and finite(grad_norm)  -> optimizer step
    otherwise, on_nonfinite = "stop"     -> NonFiniteError naming the step (nothing applied)
               on_nonfinite = "skip"     -> gradients dropped, no optimizer step; the run
                                            stops at the skip after max_nonfinite_skips

Before a checkpoint is written every rank checks its shards of the weights and optimizer
state; one all-reduce (MIN of a 0/1 flag) makes the verdict global.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """Training produced a non-finite value; the message names the step and what to change."""


class NonFiniteGuard:
    """Counts skipped steps and decides what a non-finite step does."""

    def __init__(self, policy: str = "stop", max_skips: int = 10, skipped: int = 0):
        self.policy, self.max_skips, self.skipped = policy, max_skips, skipped
        self.empty_steps = 0  # steps without a labelled token (``empty``)

    def empty(self, step: int, scheduler, pack_size: int, say: Callable[[str], None] | None) -> dict:
        """A step whose packs hold no labelled token (pieces of documents split at ``data.pack_size`` may hold
        none): no loss (a mean over zero tokens), no update; the schedule moves on. Said once through ``say`` (the
        run's notice, on rank 0; None elsewhere); the metrics count it."""
        lr = scheduler.get_last_lr()[0]
        step_schedule(scheduler)
        self.empty_steps += 1
        if say is not None and self.empty_steps == 1:
            say(f"step {step} holds no labelled token (documents longer than data.pack_size={pack_size} are split, "
                "and a piece may hold none), so it has no loss and was skipped without an update; such steps are "
                "counted as empty_steps in metrics.jsonl. Raise data.pack_size to keep whole documents in a pack.")
        return {"lr": lr, "empty_steps": self.empty_steps}

    def check(self, step: int, loss: float, grad_norm: float, lr: float) -> bool:
        """True to apply the step; False to skip it; raises ``NonFiniteError`` to stop."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return True
        what = f"step {step}: the loss is {loss} and the gradient norm {grad_norm}"
        advice = (f"lower train.lr (now {lr:g} at this step), raise train.warmup_steps, check the data, or "
                  "resume from the last checkpoint")
        if self.policy == "skip":
            self.skipped += 1
            if self.skipped <= self.max_skips:
                return False
            raise NonFiniteError(f"{what}: that is {self.skipped} non-finite steps, more than "
                                 f"train.max_nonfinite_skips={self.max_skips}; the run stopped. Fix: {advice}.")
        raise NonFiniteError(f"{what}; the run stopped before applying it (train.on_nonfinite=stop). Fix: {advice}, "
                             "or set train.on_nonfinite=skip to skip such steps.")


def step_schedule(scheduler) -> None:
    """``scheduler.step()`` without torch's UserWarning that no optimizer step came before it (a skipped step,
    non-finite or empty, is one on purpose; it was printed as a raw warning when the run's first steps were)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def first_nonfinite(state: dict, prefix: str = "") -> str | None:
    """Name of the first floating tensor in a (nested) state dict with a non-finite entry on this rank."""
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found = first_nonfinite(value, name + ".")
            if found:
                return found
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            if not bool(torch.isfinite(_local(value).detach()).all()):
                return name
    return None


def assert_finite_state(state: dict, step: int, keep_hint: str) -> None:
    """Raise ``NonFiniteError`` on every rank if any rank holds a non-finite tensor in ``state``."""
    bad = first_nonfinite(state)
    flag = torch.tensor([0 if bad else 1], dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag) == 0:
        where = f"{bad} is" if bad else "a weight or optimizer state on another rank is"
        raise NonFiniteError(f"step {step}: {where} not finite; no checkpoint was written for it "
                             f"({keep_hint}). Lower train.lr or check the data, then resume.")
