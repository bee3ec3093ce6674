"""Causal depthwise conv1d with document resets (the Mamba2 short convolution).

``y_t = bias + sum_j weight[:, j] * x_{t-(K-1)+j}``: tap ``j`` reads ``K-1-j`` tokens back, the
orientation of ``F.conv1d(..., padding=K-1)`` and of Hugging Face's ``causal_conv1d_fn``, so a
``[C, 1, K]`` conv1d weight loads squeezed as it is. A tap whose token lies in another packed
document than ``x_t`` (``seq_idx`` differs) contributes zero. ``initial_states`` ``[B, C, K-1]``
holds the ``K-1`` inputs before position 0 (oldest first); they belong to the row's first
document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    activation: str | None = None,
) -> Tensor:
    """Depthwise causal conv: x ``[B, L, C]``, weight ``[C, K]``, bias ``[C]``, seq_idx ``[B, L]``,
    initial_states ``[B, C, K-1]``, activation None, "silu" or "swish". Returns ``[B, L, C]``."""
    _check_inputs(x, weight, bias, seq_idx, initial_states, activation)
    batch, seqlen, channels = x.shape
    width = weight.shape[1]
    weight = weight.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    if initial_states is None:
        history = x.new_zeros(batch, width - 1, channels)
    else:
        history = initial_states.to(x.dtype).transpose(1, 2)  # [B, C, K-1] -> [B, K-1, C]
    x_padded = torch.cat([history, x], dim=1)  # [B, K-1+L, C]
    if seq_idx is None:
        out = F.conv1d(x_padded.transpose(1, 2), weight[:, None, :], bias, groups=channels)  # [B, C, L]
        out = out.transpose(1, 2)  # [B, L, C]
    else:
        # Document of each padded position; the history belongs to the first document.
        seq_padded = torch.cat([seq_idx[:, :1].expand(batch, width - 1), seq_idx], dim=1)  # [B, K-1+L]
        out = x.new_zeros(batch, seqlen, channels) if bias is None else bias.expand(batch, seqlen, channels)
        for tap in range(width):
            same_doc = (seq_padded[:, tap : tap + seqlen] == seq_idx)[..., None]  # [B, L, 1]
            out = out + (x_padded[:, tap : tap + seqlen] * same_doc) * weight[:, tap]  # [B, L, C]
    return F.silu(out) if activation in ("silu", "swish") else out


def causal_conv1d_reference(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    activation: str | None = None,
) -> Tensor:
    """Test oracle for ``causal_conv1d``: an explicit loop over tokens and taps."""
    _check_inputs(x, weight, bias, seq_idx, initial_states, activation)
    batch, seqlen, channels = x.shape
    width = weight.shape[1]
    if seq_idx is None:
        seq_idx = torch.zeros(batch, seqlen, dtype=torch.int64, device=x.device)
    rows = []
    for t in range(seqlen):
        y_t = x.new_zeros(batch, channels) if bias is None else bias.to(x.dtype).expand(batch, channels)
        for tap in range(width):
            source = t - (width - 1) + tap
            if source >= 0:
                value, doc = x[:, source], seq_idx[:, source]
            elif initial_states is not None:
                value, doc = initial_states[:, :, width - 1 + source].to(x.dtype), seq_idx[:, 0]
            else:
                continue
            keep = (doc == seq_idx[:, t]).to(x.dtype)[:, None]  # [B, 1]
            y_t = y_t + keep * value * weight[:, tap].to(x.dtype)
        rows.append(y_t)
    out = torch.stack(rows, dim=1)  # [B, L, C]
    return F.silu(out) if activation in ("silu", "swish") else out


def _check_inputs(x, weight, bias, seq_idx, initial_states, activation) -> None:
    """Raise ValueError, naming the value, the rule and the fix, for inputs that do not fit x."""
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x has shape {tuple(x.shape)} and dtype {x.dtype}; expected a floating [B, L, C] tensor")
    batch, seqlen, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)}; expected [C, K] = [{channels}, K] with K >= 1 "
            "(squeeze a [C, 1, K] nn.Conv1d weight with weight[:, 0])"
        )
    width = weight.shape[1]
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected [C] = [{channels}]")
    if seq_idx is not None:
        if tuple(seq_idx.shape) != (batch, seqlen) or seq_idx.is_floating_point() or seq_idx.is_complex():
            raise ValueError(f"seq_idx has shape {tuple(seq_idx.shape)} and dtype {seq_idx.dtype}; expected integer [B, L] = [{batch}, {seqlen}]")
    if initial_states is not None and tuple(initial_states.shape) != (batch, channels, width - 1):
        raise ValueError(
            f"initial_states has shape {tuple(initial_states.shape)}; expected [B, C, K-1] = [{batch}, {channels}, {width - 1}] "
            "holding the last K-1 inputs before the first token, oldest first"
        )
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation is {activation!r}; expected None, 'silu' or 'swish'")
