"""The RG-LRU of Griffin / RecurrentGemma with document resets, on Mamba1's selective scan.

Per channel ``c`` of the lru width, token by token (``x [R, T, Cd]`` the conv output, gates
block-diagonal over ``H`` heads of ``w = Cd / H`` channels: ``gate(x)_h = x_h W_h + b_h``)::

    i_t = sigmoid(gate_in(x_t)),  r_t = sigmoid(gate_rec(x_t))
    log a_t = -8 r_t softplus(recurrent_param)          (a_t in (0, 1], computed in log space)
    m_t = 1 at a document's first token, else sqrt(1 - a_t^2)   (sqrt's gradient bounded by 1000)
    h_t = a_t h_{t-1} + m_t (i_t x_t),   h = 0 before a document's first token,  y_t = h_t

exactly transformers' ``RecurrentGemmaRglru`` (which resets at ``position_ids == 0``). The
recurrence is ``selective_scan`` (``models/linear/selective_scan.py``) with state size ``N = 1``:
``dt = r``, ``A = -8 softplus(recurrent_param)`` (so ``exp(dt A) = a``), ``x = m i x``,
``B = C = 1`` and no ``dt`` on the input (``scale_by_dt=False``): the same chunked, checkpointed
associative scan with the same document resets and entering/final states (context parallelism:
``parallel/context/recurrent/rglru.py``). Two resets are kept apart: ``first`` (the normaliser,
a document's first token only) and ``reset`` (the scan's zero state, also at a context-parallel
segment's first token, whose state enters through ``init_states``).

Single-device code (no process group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridpar.models.linear.selective_scan import CHUNK, selective_scan

__all__ = ["LOG_DECAY_SCALE", "MAX_SQRT_GRADIENT", "block_diagonal", "rglru_inputs", "rglru"]

LOG_DECAY_SCALE = -8.0  # Griffin's c: log a_t = c r_t softplus(recurrent_param)
MAX_SQRT_GRADIENT = 1000.0  # transformers' bound on d sqrt(u) / du in the normaliser


class _BoundedSqrt(torch.autograd.Function):
    """``sqrt(u)`` whose gradient ``1 / (2 sqrt(u))`` is bounded by ``MAX_SQRT_GRADIENT`` (as transformers')."""

    @staticmethod
    def forward(ctx, u: Tensor) -> Tensor:
        ctx.save_for_backward(u)
        return torch.sqrt(u)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (u,) = ctx.saved_tensors
        return grad / torch.sqrt(torch.clip(4.0 * u, min=1 / MAX_SQRT_GRADIENT**2))


def block_diagonal(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``x [..., H*w]`` through one ``[w, w]`` matrix per head: ``x_h W_h + b_h`` (``weight [H, w, w]``,
    ``bias [H, w]``)."""
    heads, width = bias.shape
    out = torch.einsum("...hi,hij->...hj", x.unflatten(-1, (heads, width)), weight) + bias
    return out.flatten(-2)


def rglru_inputs(x: Tensor, input_gate_weight: Tensor, input_gate_bias: Tensor, recurrent_gate_weight: Tensor,
                 recurrent_gate_bias: Tensor, recurrent_param: Tensor, first: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(u [R, T, Cd], r [R, T, Cd], A [Cd, 1])`` of ``x [R, T, Cd]``: the scan's input ``m i x``, its
    ``dt`` (the recurrence gate) and its ``A``; ``first [T]`` True at a document's first token (module docstring)."""
    input_gate = torch.sigmoid(block_diagonal(x, input_gate_weight, input_gate_bias))
    recurrent_gate = torch.sigmoid(block_diagonal(x, recurrent_gate_weight, recurrent_gate_bias))
    A = LOG_DECAY_SCALE * F.softplus(recurrent_param)  # [Cd]
    a_square = torch.exp(2 * recurrent_gate * A)
    normaliser = torch.where(first[:, None], 1.0, _BoundedSqrt.apply(1 - a_square))  # [R, T, Cd]
    return x * input_gate * normaliser.to(x.dtype), recurrent_gate, A[:, None]


def rglru(x: Tensor, input_gate_weight: Tensor, input_gate_bias: Tensor, recurrent_gate_weight: Tensor,
          recurrent_gate_bias: Tensor, recurrent_param: Tensor, first: Tensor, reset: Tensor, chunk: int = CHUNK,
          init_states: Tensor | None = None, init_at: Tensor | None = None, final_at: Tensor | None = None):
    """``y [R, T, Cd]`` of the RG-LRU on ``x [R, T, Cd]`` (``first``, ``reset [T]``: module docstring), in
    ``x``'s dtype. ``init_states [m, Cd]`` enter at tokens ``init_at``; with ``final_at``: ``(y, states
    [e, Cd])`` (one row; ``selective_scan``'s contract with ``N = 1``)."""
    u, r, A = rglru_inputs(x, input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias,
                           recurrent_param, first)
    ones = u.new_ones(*u.shape[:2], 1)  # B = C = 1: [R, T, 1]
    out = selective_scan(u, r, A, ones, ones, reset, chunk=chunk, scale_by_dt=False, init_at=init_at,
                         init_states=None if init_states is None else init_states[..., None], final_at=final_at)
    if final_at is None:
        return out.to(x.dtype)
    return out[0].to(x.dtype), out[1][..., 0]
