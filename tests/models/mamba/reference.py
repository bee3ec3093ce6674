"""The Mamba2 core as it was before ``mamba_core``: the test reference for the new core.

``ssd_scan_chunked`` (chunked SSD with a Python loop over chunks and autograd through every
step), ``causal_conv1d`` (one masked product per tap), their composition ``conv_scan`` and the
single-process mixer core ``local_conv_scan`` built from them; plus ``causal_conv1d_reference``,
the token-by-token conv oracle. Kept verbatim so parity tests compare against what ran before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tests.models.mamba.ssd_reference import DEFAULT_DT_LIMIT, _add_skip, _check_inputs, _compute_dtype, _process_dt, _resolve_seq_idx
from hybridpar.models.mamba.recurrence import decay_floor as _decay_floor

DIAGONAL_SLICE_BYTES = 8 << 20


def ssd_scan_chunked(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    return_final_states: bool = False,
    dt_limit: tuple[float, float] = DEFAULT_DT_LIMIT,
    cu_seqlens: Tensor | None = None,
    return_varlen_states: bool = False,
):
    """Chunked SSD scan with the signature and shapes of mamba_ssm's ``mamba_chunk_scan_combined``.

    x ``[B, L, H, P]``, dt ``[B, L, H]``, A ``[H]``, B/C ``[B, L, G, N]``, D ``[H]`` or ``[H, P]``,
    dt_bias ``[H]``, seq_idx ``[B, L]`` (non-decreasing ints), initial_states ``[B, H, P, N]``,
    cu_seqlens int ``[n + 1]`` (batch 1). If ``seq_idx`` is None and ``cu_seqlens`` is given,
    documents are taken from ``cu_seqlens``. Returns y ``[B, L, H, P]`` (dtype of x), then
    final states ``[B, H, P, N]`` if ``return_final_states``, then the state after the last
    token of each of the n sequences ``[n, H, P, N]`` if ``return_varlen_states`` (zeros for
    an empty sequence). Math runs in the promoted dtype of the inputs, at least float32.
    """
    _check_inputs(x, dt, A, B, C, chunk_size, D, dt_bias, seq_idx, initial_states, dt_limit, cu_seqlens, return_varlen_states)
    seq_idx = _resolve_seq_idx(seq_idx, cu_seqlens, x)
    dtype = _compute_dtype(x, dt, A, B, C)
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    heads_per_group = nheads // ngroups
    dt = _process_dt(dt.to(dtype), dt_bias, dt_softplus, dt_limit)  # [B, L, H]
    A, B, C = A.to(dtype), B.to(dtype), C.to(dtype)

    # [B, L, ...] -> [B, c, Q, ...], zero padded to c·Q tokens. Padding has dt = 0: it neither
    # decays nor feeds the state, and it joins the last document, so outputs and final states
    # are unchanged. (Results do not depend on Q, so a short input uses one chunk of L tokens.)
    chunk_size = min(chunk_size, seqlen)
    pad = (-seqlen) % chunk_size
    nchunks = (seqlen + pad) // chunk_size

    def to_chunks(t: Tensor) -> Tensor:
        if pad:
            t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.unflatten(1, (nchunks, chunk_size))

    x_dt = to_chunks((x.to(dtype) * dt[..., None]).unflatten(2, (ngroups, heads_per_group)))  # [B, c, Q, G, R, P]
    B_chunks = to_chunks(B).transpose(2, 3).contiguous()  # [B, c, G, Q, N]
    C_chunks = to_chunks(C).transpose(2, 3).contiguous()  # [B, c, G, Q, N]
    dA = to_chunks((dt * A).unflatten(2, (ngroups, heads_per_group)))  # [B, c, Q, G, R]
    dA_cumsum = dA.cumsum(dim=2).permute(0, 1, 3, 4, 2).contiguous()  # [B, c, G, R, Q]
    seq_padded = torch.cat([seq_idx, seq_idx[:, -1:].expand(batch, pad)], dim=1)  # [B, c·Q]
    seq_chunks = seq_padded.unflatten(1, (nchunks, chunk_size))  # [B, c, Q]
    # Document of the state carried into each chunk: that of the token before it; for chunk 0,
    # the first token's document (initial_states belong to it).
    carried_doc = torch.cat([seq_chunks[:, :1, 0], seq_chunks[:, :-1, -1]], dim=1)  # [B, c]

    # 1. Diagonal blocks: the masked quadratic form inside each chunk.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    same_doc = seq_chunks[:, :, :, None] == seq_chunks[:, :, None, :]  # [B, c, Q(l), Q(s)]
    y_diag = _DiagonalBlocks.apply(
        C_chunks.flatten(0, 1),  # [B·c, G, Q, N]
        B_chunks.flatten(0, 1),  # [B·c, G, Q, N]
        dA_cumsum.flatten(0, 1),  # [B·c, G, R, Q]
        x_dt.permute(0, 1, 3, 4, 2, 5).flatten(0, 1),  # [B·c, G, R, Q, P]
        (same_doc & causal).flatten(0, 1)[:, None, None],  # [B·c, 1, 1, Q, Q]
    )
    y_diag = y_diag.unflatten(0, (batch, nchunks)).permute(0, 1, 4, 2, 3, 5)  # [B, c, Q, G, R, P]

    # 2. Chunk states: what each chunk's own tokens (of its last token's document) leave behind.
    # States are kept as [..., G, N, R·P]: one matmul per group covers all its heads.
    in_last_doc = seq_chunks == seq_chunks[:, :, -1:]  # [B, c, Q]
    decay_to_end = _masked_exp(dA_cumsum[..., -1:] - dA_cumsum, in_last_doc[:, :, None, None])  # [B, c, G, R, Q]
    x_to_end = x_dt * decay_to_end.permute(0, 1, 4, 2, 3)[..., None]  # [B, c, Q, G, R, P]
    chunk_states = B_chunks.transpose(-1, -2) @ x_to_end.transpose(2, 3).flatten(-2)  # [B, c, G, N, R·P]

    # 3. State passing over chunk edges: start_{c+1} = exp(cs_last) start_c + chunk_state_c,
    # with start_c dropped when the chunk's last token is in another document.
    carries_through = (seq_chunks[:, :, -1] == carried_doc)[:, :, None, None]  # [B, c, 1, 1]
    chunk_decay = _masked_exp(dA_cumsum[..., -1], carries_through).repeat_interleave(headdim, dim=-1)  # [B, c, G, R·P]
    if initial_states is None:
        state = x_dt.new_zeros(batch, ngroups, dstate, heads_per_group * headdim)
    else:
        state = _heads_to_groups(initial_states.to(dtype), ngroups)  # [B, G, N, R·P]
    start_states = []  # unbind, not indexing: its backward stacks the grads once, in O(c)
    for decay, chunk_state in zip(chunk_decay.unbind(1), chunk_states.unbind(1)):
        start_states.append(state)
        state = state * decay[:, :, None, :] + chunk_state
    start_states = torch.stack(start_states, dim=1)  # [B, c, G, N, R·P]
    final_states = _groups_to_heads(state, headdim)  # [B, H, P, N]

    # 4. State to output: tokens of the carried state's document read it through C.
    in_carried_doc = seq_chunks == carried_doc[:, :, None]  # [B, c, Q]
    decay_from_start = _masked_exp(dA_cumsum, in_carried_doc[:, :, None, None])  # [B, c, G, R, Q]
    y_off = (C_chunks @ start_states).unflatten(-1, (heads_per_group, headdim))  # [B, c, G, Q, R, P]
    y_off = y_off * decay_from_start.transpose(-1, -2)[..., None]

    y = y_diag + y_off.transpose(2, 3)  # [B, c, Q, G, R, P]
    y = y.flatten(1, 2)[:, :seqlen].flatten(2, 3)  # [B, L, H, P]
    y = _add_skip(y, x.to(dtype), D)
    outputs = [y.to(x.dtype)]
    if return_final_states:
        outputs.append(final_states)
    if return_varlen_states:
        outputs.append(
            _varlen_states(cu_seqlens, chunk_size, dA_cumsum[0], x_dt[0], B_chunks[0], seq_chunks[0], carried_doc[0], start_states[0])
        )
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _varlen_states(cu_seqlens, chunk_size, dA_cumsum, x_dt, B_chunks, seq_chunks, carried_doc, start_states) -> Tensor:
    """State right after each sequence's last token ``t``: its chunk's start state plus the chunk's
    tokens up to ``t``, both kept only within the document of ``t``. Inputs are one row (batch 1):
    dA_cumsum ``[c, G, R, Q]``, x_dt ``[c, Q, G, R, P]``, B_chunks ``[c, G, Q, N]``, seq_chunks
    ``[c, Q]``, carried_doc ``[c]``, start_states ``[c, G, N, R·P]``. Returns ``[n, H, P, N]``."""
    cu_seqlens = cu_seqlens.long()
    nonempty = cu_seqlens[1:] > cu_seqlens[:-1]  # [n]
    last_token = (cu_seqlens[1:] - 1).clamp(min=0)  # [n]
    chunk, pos = last_token // chunk_size, last_token % chunk_size  # [n]
    cumsum = dA_cumsum[chunk]  # [n, G, R, Q]
    cumsum_at_last = cumsum.gather(-1, pos[:, None, None, None].expand(*cumsum.shape[:-1], 1))  # [n, G, R, 1]
    seq = seq_chunks[chunk]  # [n, Q]
    doc = seq.gather(1, pos[:, None])  # [n, 1]
    up_to_last = torch.arange(chunk_size, device=seq.device) <= pos[:, None]  # [n, Q]
    partial_mask = (up_to_last & (seq == doc))[:, None, None]  # [n, 1, 1, Q]
    decay_to_last = _masked_exp(cumsum_at_last - cumsum, partial_mask)  # [n, G, R, Q]
    x_to_last = x_dt[chunk] * decay_to_last.permute(0, 3, 1, 2)[..., None]  # [n, Q, G, R, P]
    partial = B_chunks[chunk].transpose(-1, -2) @ x_to_last.transpose(1, 2).flatten(-2)  # [n, G, N, R·P]
    carry_mask = (doc[:, 0] == carried_doc[chunk])[:, None, None, None]  # [n, 1, 1, 1]
    carry_decay = _masked_exp(cumsum_at_last, carry_mask)[..., 0].repeat_interleave(x_dt.shape[-1], dim=-1)  # [n, G, R·P]
    carried = start_states[chunk] * carry_decay[:, :, None, :]  # [n, G, N, R·P]
    states = (partial + carried) * nonempty[:, None, None, None]
    return _groups_to_heads(states, x_dt.shape[-1])  # [n, H, P, N]


def _heads_to_groups(state: Tensor, ngroups: int) -> Tensor:
    """``[B, H, P, N] -> [B, G, N, R·P]`` (head h = g·R + r)."""
    batch, nheads, headdim, dstate = state.shape
    state = state.reshape(batch, ngroups, nheads // ngroups, headdim, dstate)  # [B, G, R, P, N]
    return state.permute(0, 1, 4, 2, 3).flatten(-2)  # [B, G, N, R·P]


def _groups_to_heads(state: Tensor, headdim: int) -> Tensor:
    """``[B, G, N, R·P] -> [B, H, P, N]``."""
    batch, ngroups, dstate, _ = state.shape
    state = state.unflatten(-1, (-1, headdim)).permute(0, 1, 3, 4, 2)  # [B, G, R, P, N]
    return state.reshape(batch, -1, headdim, dstate)  # [B, H, P, N]


class _DiagonalBlocks(torch.autograd.Function):
    """Step 1, ``y_l = sum_s (C_l·B_s) exp(cs_l - cs_s) [keep_ls] x_dt_s``, without keeping any
    ``[Q, Q]`` tensor for backward: forward and backward rebuild the masked decay matrix a few
    chunks at a time, so the working set is ``[chunks, G, R, Q, Q]`` for a few chunks only.

    C, B ``[c, G, Q, N]``, dA_cumsum ``[c, G, R, Q]``, x_dt ``[c, G, R, Q, P]``, keep bool
    ``[c, 1, 1, Q, Q]`` (``c`` = batch·chunks). Returns ``[c, G, R, Q, P]``. The backward is
    written out (no double backward); it treats floored decays as exact.
    """

    @staticmethod
    def forward(ctx, C, B, dA_cumsum, x_dt, keep):
        C, B, dA_cumsum, x_dt = (t.contiguous() for t in (C, B, dA_cumsum, x_dt))
        ctx.save_for_backward(C, B, dA_cumsum, x_dt, keep)
        y = torch.empty_like(x_dt)
        for part in _chunk_slices(x_dt):
            scores = _masked_decay_matrix(dA_cumsum[part], keep[part])  # [k, G, R, Q, Q]
            scores *= (C[part] @ B[part].transpose(-1, -2))[:, :, None]  # · C_l·B_s
            torch.matmul(scores, x_dt[part], out=y[part])  # [k, G, R, Q, P]
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        C, B, dA_cumsum, x_dt, keep = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grads = [torch.empty_like(t) for t in (C, B, dA_cumsum, x_dt)]
        grad_C, grad_B, grad_cumsum, grad_x_dt = grads
        for part in _chunk_slices(x_dt):
            decay = _masked_decay_matrix(dA_cumsum[part], keep[part])  # [k, G, R, Q, Q]
            CB = (C[part] @ B[part].transpose(-1, -2))[:, :, None]  # [k, G, 1, Q, Q]
            torch.matmul((decay * CB).transpose(-1, -2), grad_y[part], out=grad_x_dt[part])
            grad_scores = grad_y[part] @ x_dt[part].transpose(-1, -2)  # [k, G, R, Q, Q]
            grad_scores *= decay  # d/dCB before the head sum
            grad_CB = grad_scores.sum(2)  # [k, G, Q, Q]
            grad_scores *= CB  # d/d(cs_l - cs_s)
            torch.sub(grad_scores.sum(-1), grad_scores.sum(-2), out=grad_cumsum[part])
            torch.matmul(grad_CB, B[part], out=grad_C[part])
            torch.matmul(grad_CB.transpose(-1, -2), C[part], out=grad_B[part])
        return grad_C, grad_B, grad_cumsum, grad_x_dt, None


def _chunk_slices(x_dt: Tensor):
    """Slices of the chunk dim whose ``[k, G, R, Q, Q]`` decay matrices fit ``DIAGONAL_SLICE_BYTES``."""
    nchunks, ngroups, heads_per_group, chunk_size = x_dt.shape[:4]
    per_chunk = ngroups * heads_per_group * chunk_size * chunk_size * x_dt.element_size()
    step = max(1, DIAGONAL_SLICE_BYTES // per_chunk)
    return [slice(start, start + step) for start in range(0, nchunks, step)]


def _masked_exp(exponent: Tensor, keep: Tensor) -> Tensor:
    """``exp(exponent)`` where ``keep``, exactly 0 elsewhere (masked to -inf first: no inf·0)."""
    return exponent.clamp(min=_decay_floor(exponent.dtype)).masked_fill(~keep, float("-inf")).exp()


def _masked_decay_matrix(dA_cumsum: Tensor, keep: Tensor) -> Tensor:
    """Segment-sum decay ``exp(cs_l - cs_s)`` as ``[..., Q(l), Q(s)]``, zero where not ``keep``.

    Built in place on one buffer, so it costs one ``[..., Q, Q]`` tensor. Dropped entries are set
    to 0 before ``exp`` (never overflow) and to 0 after it.
    """
    drop = ~keep
    exponent = dA_cumsum[..., :, None] - dA_cumsum[..., None, :]  # [..., Q(l), Q(s)]
    exponent.masked_fill_(drop, 0.0).clamp_(min=_decay_floor(exponent.dtype))
    return exponent.exp_().masked_fill_(drop, 0.0)



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
    _check_conv_inputs(x, weight, bias, seq_idx, initial_states, activation)
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
    _check_conv_inputs(x, weight, bias, seq_idx, initial_states, activation)
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


def _check_conv_inputs(x, weight, bias, seq_idx, initial_states, activation) -> None:
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


def conv_scan(
    xBC: Tensor,
    dt: Tensor,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    dt_bias: Tensor,
    A_log: Tensor,
    D: Tensor,
    *,
    head_dim: int,
    state_size: int,
    chunk_size: int,
    seq_idx: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """Causal conv (SiLU) then the SSD scan for the heads present in the inputs.

    ``xBC [B, L, H*P + 2*G*N]``, ``dt [B, L, H]``, ``conv_weight [H*P + 2*G*N, K]``,
    ``dt_bias / A_log / D [H]``; returns ``y [B, L, H*P]`` (D skip included, no gate).
    """
    batch, seq_len, _ = xBC.shape
    num_heads = dt.shape[-1]
    d_inner = num_heads * head_dim
    n_groups = (xBC.shape[-1] - d_inner) // (2 * state_size)
    xBC = causal_conv1d(xBC, conv_weight, conv_bias, seq_idx=seq_idx, activation="silu")
    x, B, C = torch.split(xBC, [d_inner, n_groups * state_size, n_groups * state_size], dim=-1)
    y = ssd_scan_chunked(
        x.reshape(batch, seq_len, num_heads, head_dim),
        dt,
        -torch.exp(A_log),
        B.reshape(batch, seq_len, n_groups, state_size),
        C.reshape(batch, seq_len, n_groups, state_size),
        chunk_size,
        D=D,
        dt_bias=dt_bias,
        dt_softplus=True,
        seq_idx=seq_idx,
        dt_limit=dt_limit,
    )  # [B, L, H, P]
    return y.reshape(batch, seq_len, d_inner)


def local_conv_scan(mixer, xBC: Tensor, dt: Tensor, packed=None) -> Tensor:
    """The single-process core: conv + scan over this process's tokens, in sequence order."""
    seq_idx = None if packed is None else packed.seq_idx.expand(xBC.shape[0], -1).contiguous()
    return conv_scan(
        xBC,
        dt,
        mixer.conv1d.weight.squeeze(1),
        mixer.conv1d.bias,
        mixer.dt_bias,
        mixer.A_log,
        mixer.D,
        head_dim=mixer.head_dim,
        state_size=mixer.ssm_state_size,
        chunk_size=mixer.chunk_size,
        seq_idx=seq_idx,
        dt_limit=mixer.time_step_limit,
    )


