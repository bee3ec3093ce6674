"""Causal depthwise conv1d with document resets (the Mamba2 short convolution), forward and
backward on plain tensors (no autograd; ``mamba_core`` owns the autograd).

On the row-major token stream ``x [T, C]`` with documents ``[cu_docs[d], cu_docs[d+1])``::

    pre_t = bias + sum_{lag=0}^{K-1} weight[:, K-1-lag] * x_{t-lag}       (x_{t-lag} of t's document)

Tap ``j = K-1-lag`` reads ``lag`` tokens back: the orientation of ``F.conv1d(..., padding=K-1)``,
so a ``[C, 1, K]`` conv1d weight loads squeezed. A document whose start is listed in
``init_at`` reads its ``K-1`` earlier inputs from ``history [m, K-1, C]`` (oldest first); the others
read zeros.

The conv runs unmasked over the whole stream (``K`` shifted multiply-adds, no per-tap copies),
then only the first ``K-1`` tokens of every document are corrected: the taps that reached into
the previous document are subtracted and the history taps added, from a small
``[documents, K-1, K-1, C]`` gather. No ``[T, C]`` tensor is made per tap.
"""

from __future__ import annotations

import torch
from torch import Tensor


def conv_forward(x: Tensor, weight: Tensor, bias: Tensor | None, cu_docs: Tensor,
                 init_at: Tensor | None = None, history: Tensor | None = None) -> Tensor:
    """Pre-activation output ``[T, C]`` of the conv above (``x [T, C]``, ``weight [C, K]``)."""
    width = weight.shape[1]
    pre = x * weight[:, -1]
    if bias is not None:
        pre += bias
    for lag in range(1, width):
        pre[lag:].addcmul_(x[:-lag], weight[:, width - 1 - lag])
    for target, rows, lag_weight in _boundary_terms(x, weight, cu_docs, init_at, history):
        pre.index_add_(0, target, (rows * lag_weight).sum(2).flatten(0, 1))  # [n*(K-1), C]
    return pre


def conv_backward(x: Tensor, weight: Tensor, has_bias: bool, cu_docs: Tensor, init_at: Tensor | None,
                  history: Tensor | None, grad_pre: Tensor):
    """``(dx [T, C], dweight [C, K], dbias [C] or None, dhistory or None)`` for ``grad_pre [T, C]``."""
    width = weight.shape[1]
    dx = grad_pre * weight[:, -1]
    dweight = torch.empty_like(weight)
    dweight[:, -1] = (grad_pre * x).sum(0)
    for lag in range(1, width):
        dx[:-lag].addcmul_(grad_pre[lag:], weight[:, width - 1 - lag])
        dweight[:, width - 1 - lag] = (grad_pre[lag:] * x[:-lag]).sum(0)
    dbias = grad_pre.sum(0) if has_bias else None
    dhistory = None if history is None else torch.zeros_like(history)
    terms = _boundary_terms(x, weight, cu_docs, init_at, history, with_sources=True)
    for (target, rows, lag_weight, source, sign), into in zip(terms, ("x", "history")):
        grad = grad_pre.index_select(0, target).view(*rows.shape[:2], 1, -1)  # [n, K-1, 1, C]
        dweight[:, : width - 1] += (grad * rows).sum((0, 1)).flip(0).t()  # lag l -> tap K-1-l
        d_rows = (grad * lag_weight * sign[..., None]).flatten(0, 2)  # [n*(K-1)*(K-1), C]
        if into == "x":
            dx.index_add_(0, source, d_rows)
        else:
            dhistory.view(-1, dhistory.shape[-1]).index_add_(0, source, d_rows)
    return dx, dweight, dbias, dhistory


def _boundary_terms(x, weight, cu_docs, init_at, history, with_sources=False):
    """Corrections at document starts, as ``(target [n*(K-1)], rows [n, K-1(i), K-1(lag), C],
    lag_weight [K-1(lag), C])``: output ``start + i`` gets ``sum_lag rows * lag_weight``.

    First the taps that crossed into the previous document (rows ``-x``), then the history taps
    of the ``init_at`` documents (rows from ``history``). With ``with_sources`` each also carries
    the flat index its rows were read from (into ``x`` or ``history.view(-1, C)``) and the factor
    ``[n, K-1, K-1]`` (-1, 1 or 0) applied to what was read."""
    width = weight.shape[1]
    if width == 1:
        return []
    k1, total = width - 1, x.shape[0]
    device = x.device
    i = torch.arange(k1, device=device)[:, None]  # output offset in the document
    lag = torch.arange(1, width, device=device)[None, :]
    crosses = lag > i  # [K-1, K-1]: tap reaches before the document start
    lag_weight = weight[:, k1 - lag[0]].t()  # [K-1(lag), C]
    cu_docs = cu_docs.long()
    starts, lengths = cu_docs[:-1], cu_docs[1:] - cu_docs[:-1]
    terms = []
    keep = crosses & (i < lengths[:, None, None])  # [n, K-1, K-1]
    source = starts[:, None, None] + i - lag
    sign = -(keep & (source >= 0)).to(x.dtype)
    source = source.clamp(0, total - 1).flatten()
    rows = x.index_select(0, source).view(*sign.shape, -1) * sign[..., None]
    terms.append((_targets(starts, k1, total), rows, lag_weight, source, sign))
    if history is not None:
        valid = init_at >= 0
        at = init_at.long().clamp(min=0)
        doc = torch.searchsorted(cu_docs[1:], at, right=True)
        keep = crosses & (i < (cu_docs[doc + 1] - at)[:, None, None]) & valid[:, None, None]  # [m, K-1, K-1]
        slot = (k1 + i - lag).clamp(0, k1 - 1)  # [K-1, K-1] history slot read by (i, lag)
        source = (torch.arange(at.shape[0], device=device)[:, None, None] * k1 + slot).flatten()
        sign = keep.to(x.dtype)
        rows = history.reshape(-1, history.shape[-1]).index_select(0, source).view(*keep.shape, -1) * sign[..., None]
        terms.append((_targets(at, k1, total), rows, lag_weight, source, sign))
    return terms if with_sources else [t[:3] for t in terms]


def _targets(starts: Tensor, k1: int, total: int) -> Tensor:
    """Flat output index of offsets ``0..K-2`` of every start, clamped into the stream (rows that
    fall outside their document are zero)."""
    return (starts[:, None] + torch.arange(k1, device=starts.device)).clamp(max=total - 1).flatten()
