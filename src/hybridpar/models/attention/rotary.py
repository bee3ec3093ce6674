"""Rotary position embeddings (RoPE, half-split layout), with the gradient written out.

The first ``r`` channels of every head rotate by their position's angles; with halves ``x1``, ``x2``
(``r/2`` channels each), ``c = cos``, ``s = sin`` (``[.., r]``, halves ``c1, c2`` and ``s1, s2``;
``rotary_cos_sin`` repeats the angles, so the halves are equal) and the rest passed through::

    y1 = x1 c1 - x2 s1        y2 = x2 c2 + x1 s2        y_pass = x_pass

Its gradient is the transpose (the inverse rotation: the halves of cos and sin are equal)::

    dx1 = dy1 c1 + dy2 s2     dx2 = dy2 c2 - dy1 s1     dx_pass = dy_pass

Eager, each half is one ``mul`` into its columns of the output, one ``mul`` of half its size and an
in-place sum (under ``torch.compile`` the plain form, which inductor fuses): about 7 reads and writes
of ``x``'s size each way, nothing kept but ``cos`` and ``sin``. Eager autograd of
``x * cos + rotate_half(x) * sin`` (a negation, two concatenations, one of them with the empty
pass-through, two products and a sum) made about 12 forward and 18 backward
(``benchmarks/step_traffic.py``, ``small`` at 128K tokens). Values: bit for bit eager autograd's,
forward and backward (each product rounded, then the sum; no fused multiply-add, which would move a
training run's trajectory: ``make demo``'s did).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rotary_cos_sin", "apply_rotary"]


def rotary_cos_sin(position_ids: Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``cos, sin [B, S, rotary_dim]`` for integer positions ``[B, S]`` (half-split layout)."""
    compute_dtype = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=compute_dtype, device=position_ids.device) / rotary_dim))
    angles = position_ids.to(compute_dtype)[..., None] * inv_freq  # [B, S, rotary_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, S, rotary_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """``x [B, S, H, Dh]`` rotated (or rotated back) by ``cos, sin [B, S, r]`` into a new tensor."""
    r, half = cos.shape[-1], cos.shape[-1] // 2
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2, c1, c2 = x[..., :half], x[..., half:r], c[..., :half], c[..., half:]
    s1, s2 = (s[..., half:], s[..., :half]) if inverse else (s[..., :half], s[..., half:])
    if torch.compiler.is_compiling():  # dynamo takes no strided out=; inductor fuses the plain form into one kernel
        sign = 1.0 if inverse else -1.0
        return torch.cat([x1 * c1 + sign * x2 * s1, x2 * c2 - sign * x1 * s2, x[..., r:]], dim=-1)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    o1, o2 = out[..., :half], out[..., half:r]
    torch.mul(x1, c1, out=o1)
    torch.mul(x2, c2, out=o2)
    if inverse:  # each product rounded, then the sum: eager autograd's values, bit for bit
        o1.add_(x2 * s1)
        o2.sub_(x1 * s2)
    else:
        o1.sub_(x2 * s1)
        o2.add_(x1 * s2)
    if r < x.shape[-1]:
        out[..., r:].copy_(x[..., r:])
    return out


class _Rotary(torch.autograd.Function):
    """RoPE with its inverse rotation as the gradient (the module docstring); cos and sin are constants."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _rotate(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, inverse=True).to(ctx.x_dtype), None, None


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of every head of ``x [B, S, H, Dh]``."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("apply_rotary takes cos and sin as constants (rotary_cos_sin of positions); pass them "
                         "detached: their gradient is not computed.")
    return _Rotary.apply(x, cos, sin)
