"""Mamba1's selective scan with document resets (pure PyTorch, autograd through plain ops).

Per channel ``c`` and state ``n``, token by token (``x, dt [T, Cd]``, ``B, C [T, N]``, ``A [Cd, N] < 0``)::

    h_t = exp(dt_t A) * h_{t-1} + (dt_t x_t) B_t          [Cd, N]
    y_t = h_t C_t                                         [Cd]

with ``h = 0`` before every document's first token. Within a chunk of ``L`` tokens the recurrence
``h_t = a_t h_{t-1} + b_t`` (``a = exp(dt A)``, set to 0 at a document's first token, so nothing
crosses it; ``b = dt x B``) is an associative scan, ``(a1, b1) then (a2, b2) = (a1 a2, a2 b1 + b2)``,
run as ``log2 L`` doubling steps on ``[rows, L, Cd, N]``: only products of decays ``<= 1`` and
sums, stable in any dtype (no exponent of a cumulative sum). The state carried into the chunk
enters through its first token (``b_0 += a_0 h``). Each chunk runs under activation
checkpointing, so autograd keeps the chunk inputs and the ``[rows, Cd, N]`` state between chunks:
memory linear in ``T`` with one ``[rows, L, Cd, N]`` block alive at a time (transformers' own
sequential path keeps ``exp(dt A)`` and ``dt x B`` for the whole row). Computed in float32 at least.

For context parallelism (``parallel/context/recurrent/mamba_state.StatePassingMamba1``) the scan also takes
states entering given documents, ``init_states [m, Cd, N]`` at tokens ``init_at [m]`` (first tokens
of documents: ``b_t += exp(dt_t A) h0``, the decay a reset masks), and returns the states at tokens
``final_at [e]`` (each ``h_t`` of that token), one row only.

With ``scale_by_dt=False`` the input term is ``b = x B`` (no ``dt``): the RG-LRU of RecurrentGemma
(``models/linear/rglru.py``) runs as this scan with ``N = 1``, ``dt`` its recurrence gate and ``x`` its
normalised, gated input.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["selective_scan", "document_resets", "CHUNK"]

CHUNK = 64  # tokens per scan chunk: log2(CHUNK) doubling steps on [rows, CHUNK, Cd, N]


def document_resets(cu_seqlens: Tensor | None, seqlen: int, device) -> Tensor:
    """``[T]`` bool, True at each document's first token (documents ``cu_seqlens``, shared by the rows;
    None: one document per row)."""
    reset = torch.zeros(seqlen, dtype=torch.bool, device=device)
    starts = torch.zeros(1, dtype=torch.long, device=device) if cu_seqlens is None else cu_seqlens[:-1].to(device).long()
    reset[starts[starts < seqlen]] = True
    return reset


def _scan_chunk(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, reset: Tensor, h: Tensor,
                enter_at: Tensor | None = None, entering: Tensor | None = None, final_at: Tensor | None = None,
                scale_by_dt: bool = True):
    """``(y [R, L, Cd], h_last [R, Cd, N], h at final_at [e, Cd, N] or None)`` of one chunk, ``h [R, Cd, N]``
    carried in; ``entering [m, Cd, N]`` enter row 0 at chunk tokens ``enter_at [m]``."""
    decay = torch.exp(dt[..., None] * A)  # [R, L, Cd, N]
    a = decay.masked_fill(reset[None, :, None, None], 0.0)
    b = (dt * x if scale_by_dt else x)[..., None] * B[:, :, None, :]  # [R, L, Cd, N]
    if entering is not None and entering.shape[0]:
        b = b.index_put((torch.zeros_like(enter_at), enter_at), decay[0, enter_at] * entering, accumulate=True)
    b = torch.cat([b[:, :1] + a[:, :1] * h[:, None], b[:, 1:]], dim=1)
    step, length = 1, x.shape[1]
    while step < length:  # inclusive prefix of (a, b) under the composition above
        b = torch.cat([b[:, :step], a[:, step:] * b[:, :-step] + b[:, step:]], dim=1)
        a = torch.cat([a[:, :step], a[:, step:] * a[:, :-step]], dim=1)
        step *= 2
    finals = None if final_at is None else b[0, final_at]
    return torch.einsum("rlcn,rln->rlc", b, C), b[:, -1], finals


def selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, reset: Tensor,
                   chunk: int = CHUNK, init_states: Tensor | None = None, init_at: Tensor | None = None,
                   final_at: Tensor | None = None, scale_by_dt: bool = True):
    """``y [R, T, Cd]`` (before the ``D`` skip and the gate) for ``x, dt [R, T, Cd]`` (``dt`` after
    its softplus), ``A [Cd, N]``, ``B, C [R, T, N]`` and ``reset [T]`` (``document_resets``),
    in ``x``'s dtype (``scale_by_dt=False``: input term ``x B``). With ``final_at``: ``(y, states [e, Cd, N])`` (module docstring; one row)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    x, dt, A, B, C = (t.to(dtype) for t in (x, dt, A, B, C))
    rows, length, channels = x.shape
    if (init_states is not None or final_at is not None) and rows != 1:
        raise ValueError(f"selective_scan takes entering or final states on one row (rows back to back), got {rows} "
                         "rows; reshape x, dt, B, C to [1, T, ...].")
    h = x.new_zeros(rows, channels, A.shape[1])
    outputs, finals = [], []
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        piece = slice(start, stop)
        enter_at = entering = local_final = None
        if init_states is not None:
            inside = (init_at >= start) & (init_at < stop)
            enter_at, entering = init_at[inside] - start, init_states[inside].to(dtype)
        if final_at is not None:
            local_final = final_at[(final_at >= start) & (final_at < stop)] - start
        args = (x[:, piece], dt[:, piece], A, B[:, piece], C[:, piece], reset[piece], h, enter_at, entering,
                local_final, scale_by_dt)
        y, h, ends = (checkpoint(_scan_chunk, *args, use_reentrant=False) if torch.is_grad_enabled()
                      else _scan_chunk(*args))
        outputs.append(y)
        finals.append(ends)
    y = torch.cat(outputs, dim=1)
    return y if final_at is None else (y, torch.cat(finals))
