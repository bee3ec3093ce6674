"""Mamba-2 SSD scan: chunked pure-PyTorch kernel with document resets, and its sequential oracle.

Per batch row and head ``h`` (which reads group ``g = h // (H/G)`` of B and C)::

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t ⊗ B_t        # h_t: [P, N]
    y_t = h_t · C_t + D * x_t

with ``h_{t-1} := 0`` wherever ``seq_idx`` changes between ``t-1`` and ``t`` (a new packed
document). ``initial_states`` is ``h_{-1}``, so it reaches only the row's first document
(tokens whose ``seq_idx`` equals that of position 0).

``ssd_scan`` follows the block decomposition of mamba_ssm's ``ssd_minimal.py`` over chunks of
``Q = chunk_size`` tokens, with ``cs`` the within-chunk cumsum of ``dt * A``:

1. diagonal blocks: inside a chunk, ``y_l = sum_{s<=l} (C_l·B_s) exp(cs_l - cs_s) dt_s x_s``;
2. chunk states: the state each chunk builds from its own tokens, ``exp(cs_last - cs_s)``;
3. state passing: one step per chunk carries the state over chunk edges (O(L/Q) steps);
4. state to output: each token reads the carried state through ``C_l exp(cs_l)``.

Every decay factor is ``exp`` of a cumsum difference, masked to an exact zero (with a zero
gradient) where a document boundary or causality forbids the flow. Exponents are floored at
``log(tiny**0.75)`` (decays below ~1e-29 in float32, ~1e-231 in float64, are raised to that
value): exact up to that size, and no denormal number, which slows CPU math about 5x, ever
reaches a matmul. Extra memory is O(B·L·Q·H) for step 1 and O(B·(L/Q)·H·P·N) for the states;
no per-token state is ever built.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_DT_LIMIT = (0.0, float("inf"))
DIAGONAL_SLICE_BYTES = 8 << 20  # working set of step 1: a few chunks' [G, R, Q, Q] decay matrices


def ssd_scan(
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


def _decay_floor(dtype: torch.dtype) -> float:
    """Smallest exponent used, ``log(tiny**0.75)`` (about -65 in float32, -531 in float64)."""
    return 0.75 * math.log(torch.finfo(dtype).tiny)


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


def _add_skip(y: Tensor, x: Tensor, D: Tensor | None) -> Tensor:
    if D is None:
        return y
    D = D.to(y.dtype)
    return torch.addcmul(y, x, D[:, None] if D.dim() == 1 else D)  # D: [H] or [H, P]


def _process_dt(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool, dt_limit) -> Tensor:
    """dt (+ dt_bias) (-> softplus) (-> clamp to dt_limit, only when it is not the default)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != DEFAULT_DT_LIMIT:
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _resolve_seq_idx(seq_idx: Tensor | None, cu_seqlens: Tensor | None, x: Tensor) -> Tensor:
    """Document of each token ``[B, L]``; all zeros when neither seq_idx nor cu_seqlens is given."""
    if seq_idx is not None:
        return seq_idx
    batch, seqlen = x.shape[:2]
    if cu_seqlens is None:
        return torch.zeros(batch, seqlen, dtype=torch.int64, device=x.device)
    positions = torch.arange(seqlen, device=x.device)
    return torch.searchsorted(cu_seqlens[1:].long(), positions, right=True)[None]  # [1, L]


def _check_inputs(x, dt, A, B, C, chunk_size, D, dt_bias, seq_idx, initial_states, dt_limit, cu_seqlens, return_varlen_states):
    """Raise ValueError, naming the value, the rule and the fix, for any input that does not fit x."""
    if x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"x has shape {tuple(x.shape)} and dtype {x.dtype}; expected a floating [B, L, H, P] tensor")
    batch, seqlen, nheads, headdim = x.shape
    if seqlen < 1:
        raise ValueError(f"x has sequence length {seqlen}; expected at least 1 token (skip the call for empty input)")
    if B.dim() != 4 or B.shape[:2] != x.shape[:2]:
        raise ValueError(f"B has shape {tuple(B.shape)}; expected [B, L, G, N] = [{batch}, {seqlen}, G, N] to match x {tuple(x.shape)}")
    ngroups, dstate = B.shape[2], B.shape[3]
    if C.shape != B.shape:
        raise ValueError(f"C has shape {tuple(C.shape)}; expected the shape of B {tuple(B.shape)}")
    if ngroups < 1 or nheads % ngroups != 0:
        raise ValueError(f"{nheads} heads are not divisible by {ngroups} groups (B/C dim 2); use a group count dividing the head count")
    expected = {
        "dt": (dt, [(batch, seqlen, nheads)], "[B, L, H]"),
        "A": (A, [(nheads,)], "[H]"),
        "D": (D, [(nheads,), (nheads, headdim)], "[H] or [H, P]"),
        "dt_bias": (dt_bias, [(nheads,)], "[H]"),
        "initial_states": (initial_states, [(batch, nheads, headdim, dstate)], "[B, H, P, N]"),
    }
    for name, (tensor, shapes, layout) in expected.items():
        if tensor is not None and tuple(tensor.shape) not in shapes:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {layout} = {' or '.join(map(str, shapes))} to match x {tuple(x.shape)} and B {tuple(B.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size is {chunk_size!r}; expected a positive int (e.g. 256)")
    if len(tuple(dt_limit)) != 2 or not dt_limit[0] <= dt_limit[1]:
        raise ValueError(f"dt_limit is {dt_limit!r}; expected (low, high) with low <= high, e.g. (0.0, float('inf'))")
    if seq_idx is not None:
        if tuple(seq_idx.shape) != (batch, seqlen) or seq_idx.is_floating_point() or seq_idx.is_complex():
            raise ValueError(f"seq_idx has shape {tuple(seq_idx.shape)} and dtype {seq_idx.dtype}; expected integer [B, L] = [{batch}, {seqlen}]")
        # A host sync: skipped under torch.compile, where seq_idx comes from PackedSeqParams,
        # which is non-decreasing by construction (its cu_seqlens are checked when it is built).
        if seqlen > 1 and not torch.compiler.is_compiling() and bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
            raise ValueError("seq_idx decreases along L; documents must be contiguous with non-decreasing ids (build it with searchsorted over cu_seqlens)")
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states=True needs cu_seqlens; pass the [n + 1] sequence boundaries of the packed row")
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"cu_seqlens given with batch size {batch}; cu_seqlens describes one packed row, so use batch 1 ([1, T, ...])")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens has shape {tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}; expected integer [n + 1] with n >= 1")
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != seqlen or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"cu_seqlens {cu_seqlens.tolist()} must start at 0, be non-decreasing and end at L = {seqlen}; rebuild it for this row")


def ssd_scan_reference(
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
    """Sequential oracle for ``ssd_scan``: the recurrence, one token at a time (chunk_size unused)."""
    _check_inputs(x, dt, A, B, C, chunk_size, D, dt_bias, seq_idx, initial_states, dt_limit, cu_seqlens, return_varlen_states)
    seq_idx = _resolve_seq_idx(seq_idx, cu_seqlens, x)
    dtype = _compute_dtype(x, dt, A, B, C)
    batch, seqlen, nheads, headdim = x.shape
    heads_per_group = nheads // B.shape[2]
    dt = _process_dt(dt.to(dtype), dt_bias, dt_softplus, dt_limit)  # [B, L, H]
    out_dtype = x.dtype
    x, A = x.to(dtype), A.to(dtype)
    B_heads = B.to(dtype).repeat_interleave(heads_per_group, dim=2)  # [B, L, H, N]
    C_heads = C.to(dtype).repeat_interleave(heads_per_group, dim=2)  # [B, L, H, N]
    if initial_states is None:
        state = x.new_zeros(batch, nheads, headdim, B.shape[3])
    else:
        state = initial_states.to(dtype)  # [B, H, P, N]
    ys, states = [], []
    for t in range(seqlen):
        if t > 0:  # a new document starts from zero
            same_doc = (seq_idx[:, t] == seq_idx[:, t - 1]).to(dtype)  # [B]
            state = state * same_doc[:, None, None, None]
        decay = torch.exp(dt[:, t] * A)  # [B, H]
        update = (dt[:, t, :, None] * x[:, t])[..., None] * B_heads[:, t, :, None, :]  # [B, H, P, N]
        state = decay[..., None, None] * state + update
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C_heads[:, t]))
        states.append(state)
    y = _add_skip(torch.stack(ys, dim=1), x, D)  # [B, L, H, P]
    outputs = [y.to(out_dtype)]
    if return_final_states:
        outputs.append(state)
    if return_varlen_states:
        varlen = []
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            varlen.append(states[end - 1][0] if end > start else torch.zeros_like(state[0]))
        outputs.append(torch.stack(varlen))  # [n, H, P, N]
    return outputs[0] if len(outputs) == 1 else tuple(outputs)
