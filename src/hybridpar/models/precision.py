"""Mixed precision inside the model: where autocast must not reach.

Under ``parallel.mixed_precision=bf16`` without FSDP the model's forward runs in
``torch.autocast(bfloat16)`` (``parallel/precision.py``): weights and the optimizer stay
float32, the projections' matmuls run in bf16 and the residual stream stays float32. The
statistics where precision decides are computed in float32 or wider by the pure-PyTorch
cores, which upcast their inputs; ``full_precision`` keeps autocast from turning their
matmuls back into bf16:

- norms (``blocks._RMSNormFunction``: elementwise, autocast leaves it alone),
- attention scores, softmax and logsumexp (``attention/blockwise.py``),
- SSD decays, chunk states and the scan (``mamba/ssd_chunked.py``),
- the LM head's logsumexp and the loss (``lm_head_loss.local_statistics`` / ``local_gradients``).

A custom op's implementation still sees the caller's autocast state (checked on torch 2.13:
``a.float() @ b.float()`` inside a ``torch.library.custom_op`` returns bf16 under CPU autocast),
hence the decorator on the plain functions those ops call.
"""

from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["full_precision", "autocast_off", "autocast_narrowing"]


@functools.cache
def _device_types() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


@contextlib.contextmanager
def autocast_off():
    """Autocast disabled on every device type present (float32 ops stay float32)."""
    with contextlib.ExitStack() as stack:
        for device_type in _device_types():
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def full_precision(fn):
    """Run ``fn`` with autocast off (its own dtype rules decide, e.g. ``promote(dtype, float32)``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with autocast_off():
            return fn(*args, **kwargs)

    return wrapper


def autocast_narrowing(device_type: str, dtype: torch.dtype) -> torch.dtype | None:
    """Autocast's dtype where autocast is on for ``device_type`` and casts ``dtype`` weights to it in a
    matmul (float32 masters under bf16; autocast leaves float64 and its own dtype alone), else None."""
    if not torch.is_autocast_enabled(device_type):
        return None
    target = torch.get_autocast_dtype(device_type)
    return target if dtype.is_floating_point and dtype not in (torch.float64, target) else None
