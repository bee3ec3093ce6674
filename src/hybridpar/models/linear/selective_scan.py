"""The Mamba1 selective scan (S6) with document resets, pure PyTorch, memory linear in tokens.

On the row-major token stream of documents ``[cu_docs[d], cu_docs[d+1])``, per channel ``c`` and
state ``n`` (``x, dt [T, d_inner]`` with ``dt`` after softplus, ``A [d_inner, d_state]``,
``B, C [T, d_state]``, ``D [d_inner]``)::

    h_t[c, n] = exp(dt_t[c] * A[c, n]) * h_{t-1}[c, n] + dt_t[c] * B_t[n] * x_t[c]
    y_t[c]    = sum_n C_t[n] * h_t[c, n] + D[c] * x_t[c]

``h_{t-1}`` is zero at each document's first token, or ``initial_states[j]`` for the document
starting at ``init_at[j]`` (a context-parallel strategy passes the state of the previous shard).
``final_states`` (with ``return_final_states``) are ``h`` at each document's last token ``[docs, d_inner, d_state]``.

The stream is cut into chunks of ``chunk_size`` tokens; each chunk runs a sequential recurrence
under ``torch.utils.checkpoint``, so autograd keeps only the chunk inputs and one
``[d_inner, d_state]`` state per chunk (never ``[T, d_inner, d_state]``); a chunk's states are
recomputed in backward. ``reset_conv`` is the causal depthwise conv1d with the same resets (the
Mamba2 conv of ``models/mamba/conv.py`` inside an autograd Function).

Single-device code (no process group).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from hybridpar.models.mamba.conv import conv_backward, conv_forward

__all__ = ["selective_scan", "reset_conv"]


class _ResetConv(torch.autograd.Function):
    """``conv_forward`` with ``conv_backward``: saves its inputs only."""

    @staticmethod
    def forward(ctx, x, weight, bias, cu_docs, init_at, history):
        ctx.save_for_backward(x, weight, cu_docs, init_at, history)
        ctx.has_bias = bias is not None
        return conv_forward(x, weight, bias, cu_docs, init_at, history)

    @staticmethod
    def backward(ctx, grad):
        x, weight, cu_docs, init_at, history = ctx.saved_tensors
        dx, dweight, dbias, dhistory = conv_backward(x, weight, ctx.has_bias, cu_docs, init_at, history,
                                                     grad.contiguous())
        return dx, dweight, dbias, None, None, dhistory


def reset_conv(x: Tensor, weight: Tensor, bias: Tensor | None, cu_docs: Tensor, init_at: Tensor | None = None,
               history: Tensor | None = None) -> Tensor:
    """Pre-activation causal depthwise conv ``[T, C]`` of ``x [T, C]`` with ``weight [C, K]``, reset at
    every document start (``history [m, K-1, C]`` enters the documents starting at ``init_at``)."""
    return _ResetConv.apply(x, weight, bias, cu_docs, init_at, history)


def _scan_chunk(h0: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, keep: Tensor,
                inject: list[tuple[int, int]], states: Tensor | None, ends: list[int]):
    """One chunk of the recurrence: ``(y [Q, d], h_last [d, n], h at the chunk-local ``ends`` [e, d, n])``."""
    h, ys, kept = h0, [], []
    inject = dict(inject)
    for t in range(x.shape[0]):
        h = h * keep[t]
        if t in inject:
            h = h + states[inject[t]]
        h = torch.exp(dt[t, :, None] * A) * h + (dt[t] * x[t])[:, None] * B[t]
        ys.append(h @ C[t])
        if t in ends:
            kept.append(h)
    ends_h = torch.stack(kept) if kept else h.new_zeros((0, *h.shape))
    return torch.stack(ys), h, ends_h


def selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, cu_docs: Tensor,
                   initial_states: Tensor | None = None, init_at: Tensor | None = None,
                   return_final_states: bool = False, chunk_size: int = 64):
    """``y [T, d]`` of the scan above (module docstring), and ``final_states [docs, d, n]`` if asked.
    ``cu_docs [docs+1]`` covers ``[0, T]``; ``initial_states [m, d, n]`` enter the documents starting at
    ``init_at [m]`` (token indices)."""
    total, width = x.shape
    if dt.shape != x.shape or B.shape != C.shape or B.shape[0] != total or A.shape != (width, B.shape[1]):
        raise ValueError(f"selective_scan takes x, dt [T, d], A [d, n], B, C [T, n]; got x {tuple(x.shape)}, dt "
                         f"{tuple(dt.shape)}, A {tuple(A.shape)}, B {tuple(B.shape)}, C {tuple(C.shape)}; pass the "
                         "mixer's tensors flattened over tokens.")
    if (initial_states is None) != (init_at is None):
        raise ValueError("selective_scan takes initial_states and init_at together (the documents they enter); "
                         "pass both or neither.")
    starts = cu_docs[:-1].long()
    keep = torch.ones(total, dtype=x.dtype, device=x.device)
    keep[starts[starts < total]] = 0
    bounds = cu_docs.tolist()  # one host sync per call: chunk-local document ends and injections
    ends_at = [e - 1 for s, e in zip(bounds[:-1], bounds[1:]) if e > s] if return_final_states else []
    injections = [] if init_at is None else list(enumerate(init_at.tolist()))
    h = x.new_zeros(width, A.shape[1])
    ys, finals = [], []
    for lo in range(0, total, chunk_size):
        hi = min(lo + chunk_size, total)
        ends = [e - lo for e in ends_at if lo <= e < hi]
        inject = [(t - lo, j) for j, t in injections if lo <= t < hi]
        parts = (x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], keep[lo:hi], inject, initial_states, ends)
        if torch.is_grad_enabled():
            y, h, ends_h = checkpoint(_scan_chunk, h, *parts, use_reentrant=False)
        else:
            y, h, ends_h = _scan_chunk(h, *parts)
        ys.append(y)
        finals.append(ends_h)
    y = torch.cat(ys) if ys else x.new_zeros(0, width)
    if D is not None:
        y = y + x * D
    if not return_final_states:
        return y
    # documents of zero tokens keep their initial (zero) state
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    stacked = torch.cat(finals) if finals else x.new_zeros(0, width, A.shape[1])
    if all(n > 0 for n in lengths):
        return y, stacked
    out, i = [], 0
    for n in lengths:
        out.append(stacked[i] if n > 0 else x.new_zeros(width, A.shape[1]))
        i += n > 0
    return y, torch.stack(out)
