"""The elementwise steps around the fused Mamba op's scan, and their gradients written out.

Around FLA's ``chunk_simple_gla`` the op (``fused_op.py``) computes, per token ``t``, head ``h`` and
channel ``p``, with ``x`` the conv output (bf16 under mixed precision), ``dt`` the processed step and
``D`` the skip (both float32 or wider):

    v = x dt                 the scan's values
    y = o + D x              o: the scan's output

and, given the scan's ``dv`` and the op's ``dy``, their gradients:

    dx    = dy D + dv dt     (the two terms of x's gradient, summed before the one rounding)
    d dt  = sum_p  dv x
    dD    = sum_tp dy x

Every product runs in the wide dtype (float32, or float64 for float64 inputs) and is rounded to
x's dtype once, in the pass that computes it: TensorIterator computes in the inputs' common dtype
and casts on store, so a narrow ``out=`` tensor costs no wide copy, and a one-element wide zero
added by ``addcmul`` makes the product of two bf16 tensors a float32 one without widening either.
Eager autograd of the same math (``(x * dt).to(bf16)`` and its backward) made a wide copy of each
bf16 operand, a wide result and its rounding: at ``1b``'s widths (8,192 tokens, 64 heads of 64)
about 3.0 GB read and written per layer's backward, 1.4 GB here (``benchmarks/step_traffic.py``).
Values: ``v`` and ``y`` are bitwise those of the eager forms; ``dx`` is rounded once where autograd
rounded each term and their sum.

``scan_gradients`` gathers every gradient after the scan's into the conv output's ``[T, C]`` gradient
(``dx`` and the group sums of the repeated ``k = B``, ``q = C``), ``d dt`` and ``dD``: eager it is the
functions above, seven passes over ``[T, H, P]``-size tensors and two float32 intermediates; on CUDA it
runs compiled (``models/cuda_compile.py``), where inductor reads ``dv``, ``dy``, ``x``, ``dq``, ``dk``
once or twice and writes the gradients, the same products in float32, within its rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridpar.models.cuda_compile import eager_mode, run_compiled

__all__ = ["scan_values", "add_skip", "grad_x_into", "grad_dt", "grad_D", "scan_gradients"]


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def scan_values(x: Tensor, dt: Tensor) -> Tensor:
    """``v = x dt`` ``[1, T, H, P]`` in x's dtype: ``x [1, T, H, P]``, ``dt [T, H]`` wide."""
    return torch.mul(x, dt[None, :, :, None], out=torch.empty(x.shape, dtype=x.dtype, device=x.device))


def add_skip(o: Tensor, x: Tensor, D: Tensor) -> Tensor:
    """``y = o + D x`` ``[1, T, H, P]`` in o's dtype, computed wide: ``D [H]``."""
    wide_D = D.to(_wide(o.dtype))[:, None]  # [H, 1]: two dims, so it takes part in type promotion
    return torch.addcmul(o, x, wide_D, out=torch.empty(o.shape, dtype=o.dtype, device=o.device))


def grad_x_into(out: Tensor, dv: Tensor, dt: Tensor, dy: Tensor | None, D: Tensor) -> Tensor:
    """``out [1, T, H, P] <- dy D + dv dt`` (without ``dy``: ``dv dt``), computed wide, rounded once to
    out's dtype; ``out`` may be a strided view (a slice of the conv output's gradient)."""
    dt4 = dt[None, :, :, None]
    if dy is None:
        return torch.mul(dv, dt4, out=out)
    skip = torch.mul(dy, D.to(_wide(dy.dtype))[:, None])  # [1, T, H, P] wide
    return torch.addcmul(skip, dv, dt4, out=out)


def _wide_product(a: Tensor, b: Tensor) -> Tensor:
    """``a * b`` in the wide dtype without a wide copy of either (a wide zero sets the common dtype)."""
    zero = torch.zeros(1, dtype=_wide(a.dtype), device=a.device)
    return torch.addcmul(zero, a, b)


def grad_dt(dv: Tensor, x: Tensor) -> Tensor:
    """``d dt = sum_p dv x`` ``[T, H]`` wide, from ``dv``, ``x [1, T, H, P]``."""
    return _wide_product(dv, x).sum(dim=-1)[0]


def grad_D(dy: Tensor, x: Tensor, D: Tensor) -> Tensor:
    """``dD = sum_tp dy x`` ``[H]`` in D's dtype, summed wide."""
    return _wide_product(dy, x).sum(dim=(0, 1, 3)).to(D.dtype)


def _scan_gradients(dv: Tensor, dy: Tensor | None, x: Tensor, dt: Tensor, D: Tensor, dq: Tensor, dk: Tensor,
                    widths: list[int], groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(d_post [T, C] in x's dtype, d dt [T, H] wide, dD [H])``: ``d_post``'s columns ``[dx | dB | dC]``
    (``widths``), ``dB``/``dC`` the sums of ``dk``/``dq [1, T, H, N]`` over each group's heads."""
    total, heads, state_size = x.shape[1], x.shape[2], dq.shape[-1]
    per_group = heads // groups
    if eager_mode():  # written into d_post's columns
        d_post = torch.empty(total, sum(widths), dtype=x.dtype, device=x.device)
        dx, dB, dC = d_post.split(widths, dim=-1)
        grad_x_into(dx.view(x.shape), dv, dt, dy, D)
        for d_heads, out in ((dk, dB), (dq, dC)):  # the repeat's gradient: a sum over each group's heads
            by_group = d_heads.reshape(1, total, groups, per_group, state_size)  # a view where FLA gives it dense
            torch.sum(by_group, dim=3, out=out.view(1, total, groups, state_size))
    else:  # traced (dynamo takes no strided out=): the same values concatenated, which inductor writes in place
        dx = dv * dt[None, :, :, None]  # wide, as dt is
        if dy is not None:
            dx = dx + dy * D.to(_wide(x.dtype))[:, None]
        sums = [t.reshape(1, total, groups, per_group, state_size).sum(dim=3).reshape(total, -1) for t in (dk, dq)]
        d_post = torch.cat([dx.to(x.dtype).reshape(total, -1), *sums], dim=-1)
    return d_post, grad_dt(dv, x), (grad_D(dy, x, D) if dy is not None else torch.zeros_like(D))


def scan_gradients(dv: Tensor, dy: Tensor | None, x: Tensor, dt: Tensor, D: Tensor, dq: Tensor, dk: Tensor,
                   widths: list[int], groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients after the scan's (``_scan_gradients``), compiled on CUDA: ``dv``, ``dy``, ``x [1, T, H, P]``,
    ``dt [T, H]`` and ``D [H]`` wide, ``dq``, ``dk [1, T, H, N]``."""
    return run_compiled("Mamba scan gradients", _scan_gradients, x.device, dv, dy, x, dt, D, dq, dk, widths, groups)
