"""Mamba-2 SSD scan: the chunked kernel's public entry point and its sequential oracle.

Per batch row and head ``h`` (which reads group ``g = h // (H/G)`` of B and C)::

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t ⊗ B_t        # h_t: [P, N]
    y_t = h_t · C_t + D * x_t

with ``h_{t-1} := 0`` wherever ``seq_idx`` changes between ``t-1`` and ``t`` (a new packed
document). ``initial_states`` is ``h_{-1}``, so it reaches only the row's first document
(tokens whose ``seq_idx`` equals that of position 0).

``ssd_scan`` has the signature of mamba_ssm's ``mamba_chunk_scan_combined`` and runs the chunked
block decomposition of ``ssd_chunked.py`` (diagonal blocks, chunk states, loop-free state
passing over chunks, state to output) through the ``hybridpar::ssd_chunk_scan`` op of
``models/mamba/core.py``: its autograd keeps the inputs only and the backward recomputes the rest.
Exponents are floored at ``log(tiny**0.75)`` (decays below ~1e-29 in float32, ~1e-231 in
float64, are raised to that value): exact up to that size, and no denormal number, which slows
CPU math about 5x, ever reaches a matmul. Requires ``dt * A <= 0`` (decays at most 1).
``ssd_scan_reference`` is the recurrence itself, one token at a time: the test oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridpar.models.mamba import core as mamba_core  # noqa: F401  (registers the hybridpar::ssd_chunk_scan op)

DEFAULT_DT_LIMIT = (0.0, float("inf"))


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
    Document boundaries are read from ``seq_idx`` here (one host sync): the model path passes
    them precomputed to ``mamba_core``.
    """
    _check_inputs(x, dt, A, B, C, chunk_size, D, dt_bias, seq_idx, initial_states, dt_limit, cu_seqlens, return_varlen_states)
    if bool((A > 0).any()) or (not dt_softplus and dt_limit[0] < 0 and bool((_process_dt(dt, dt_bias, False, DEFAULT_DT_LIMIT) < 0).any())):
        raise ValueError("ssd_scan needs decays exp(dt * A) <= 1: A <= 0 (Mamba2: A = -exp(A_log)) and dt >= 0 "
                         "(use dt_softplus=True or a dt_limit with a low bound >= 0); ssd_scan_reference takes any A")
    seq_idx = _resolve_seq_idx(seq_idx, cu_seqlens, x)
    batch, seqlen = x.shape[:2]
    new_doc = torch.ones_like(seq_idx, dtype=torch.bool)
    new_doc[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]  # every row start is a document start
    starts = new_doc.flatten().nonzero()[:, 0]
    cu_docs = torch.cat([starts, starts.new_full((1,), batch * seqlen)])
    rows = torch.arange(batch, device=x.device) * seqlen
    ends = [rows + seqlen - 1] if return_final_states else []
    if return_varlen_states:
        cu = cu_seqlens.long().to(x.device)
        ends.append(torch.where(cu[1:] > cu[:-1], cu[1:] - 1, -1))  # -1: an empty sequence, zero state
    final_at = torch.cat(ends) if ends else None
    y, final = torch.ops.hybridpar.ssd_chunk_scan(
        x, dt, A, B, C, D, dt_bias, None, None, cu_docs, rows if initial_states is not None else None, initial_states,
        None, final_at, chunk_size, dt_softplus, float(dt_limit[0]), float(dt_limit[1]), True,
    )
    outputs = [y]
    if return_final_states:
        outputs.append(final[:batch])
    if return_varlen_states:
        outputs.append(final[batch if return_final_states else 0:])
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


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
