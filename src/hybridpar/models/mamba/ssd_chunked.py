"""The chunked SSD scan, forward and hand-written backward, on plain tensors (no autograd).

Per row and head ``h`` (group ``g = h // R`` of B and C), with ``a_t = dt_t A_h <= 0``::

    h_t = exp(a_t) h_{t-1} + dt_t x_t ⊗ B_t,      y_t = h_t · C_t + D x_t

``h_{t-1} := 0`` where a new document starts (``cu_docs``), except that ``init_states[i]`` is the
state before the document starting at token ``init_at[i]``; ``final_at[j]`` asks for ``h`` right
after token ``final_at[j]``. Over chunks of ``Q`` tokens (rows padded to whole chunks, padding
has ``dt = 0``), with ``cs`` the within-chunk inclusive cumsum of ``a``, every decay is
``exp(cs_l - cs_s)`` floored at ``log(tiny**0.75)`` and masked to an exact 0 across documents.
A difference of two cumsums cancels: after one token with a large ``|dt A|`` (``dt`` from a saturated
softplus: ``cs`` ~ -7e4 in a chunk whose other steps add -1e-3) float32's ``cs`` steps by its ulp
(8e-3) and ``y`` came out 0.2-26% off a float64 recurrence. So ``cs`` is kept in float64 (the
exponents are cast to the compute dtype before ``exp``), and the diagonal blocks' ``[Q, Q]``
exponents are segment sums ``sum_{s<k<=l} a_k`` (masked cumsums, no difference at all):

1. diagonal blocks ``y_l += sum_{s<=l, same doc} (C_l·B_s) exp(cs_l - cs_s) dt_s x_s``;
2. chunk states ``S_k = sum_{s in the chunk's last doc} exp(cs_last - cs_s) dt_s x_s ⊗ B_s``;
3. states entering chunks, ``start_{k+1} = exp(cs_last_k) start_k + S_k`` (reset where the
   chunk is not all one document): ``recurrence.linear_recurrence``, no Python loop;
4. ``y_l += exp(cs_l) C_l · start_k`` for tokens of the carried document;
5. initial states enter through ``exp(cs_l - cs_{o-1}) C_l · h0`` inside their chunk and
   through ``S``; final states are a partial chunk state plus the decayed start state.

``forward`` returns ``y`` and the requested states; ``backward`` recomputes 1-5 from the inputs
(nothing but the inputs is kept between the two) and returns every input gradient. The
diagonal blocks run a few chunks at a time, so no ``[L, Q]``-per-head tensor ever exists.
Requires ``dt * A <= 0`` (decays in (0, 1], as Mamba2's ``A = -exp(A_log)``, ``dt >= 0`` give).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridpar.models.precision import full_precision
from hybridpar.models.mamba.recurrence import (decay_floor, linear_recurrence, reverse_recurrence, segment_sums,
                                               step_decay, suffix_sums)

# Working set of step 1: the [k, G, R, Q, Q] decay matrices of k chunks at a time. Every op of a slice
# is one kernel launch on a GPU, where the host's dispatch (microseconds per op) then bounds the step:
# at 16 MiB the core of one `1b` Mamba layer at 8K tokens ran 4,672 aten ops forward and backward,
# `small` at 32K 17,494; at 256 MiB 648 and 1,474 (counted by TorchDispatchMode). On a CPU an op costs
# little to dispatch, and the larger slices only cost memory: transformers' Nemotron-H on our cores at
# 16K tokens peaked at 1,121 MiB with 256 MiB slices, 685 MiB with 16 (benchmarks/hf_hybrids.py, time
# unchanged within noise). Memory stays linear in the sequence either way: one budget per slice at most.
DIAGONAL_SLICE_BYTES = 256 << 20  # on an accelerator (what the planner plans for)
HOST_DIAGONAL_SLICE_BYTES = 16 << 20  # on a CPU


def slice_budget(device_type: str) -> int:
    """Bytes of ``[k, G, R, Q, Q]`` decay matrices one slice of chunks may hold on ``device_type``."""
    return HOST_DIAGONAL_SLICE_BYTES if device_type == "cpu" else DIAGONAL_SLICE_BYTES


@dataclass
class ChunkLayout:
    """Where every token sits in the padded chunk grid ``[Kc = B * chunks, Q]``; built per call."""

    batch: int
    seqlen: int
    chunk: int  # Q
    chunks_per_row: int
    doc: Tensor  # [Kc, Q] document of each padded token (padding joins its row's last document)
    carried: Tensor  # [Kc] document of the state entering the chunk (-1: none)
    points: dict  # "init"/"final": (chunk [m], offset [m], doc [m], valid [m]) of those tokens

    @property
    def num_chunks(self) -> int:
        return self.doc.shape[0]

    def pad(self, t: Tensor) -> Tensor:
        """``[B, L, ...] -> [Kc, Q, ...]`` with zeros after each row's end."""
        extra = self.chunks_per_row * self.chunk - self.seqlen
        if extra:
            t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, extra))
        return t.reshape(self.num_chunks, self.chunk, *t.shape[2:])

    def unpad(self, t: Tensor) -> Tensor:
        """``[Kc, Q, ...] -> [B, L, ...]``."""
        return t.reshape(self.batch, self.chunks_per_row * self.chunk, *t.shape[2:])[:, : self.seqlen]


def make_layout(batch: int, seqlen: int, chunk: int, cu_docs: Tensor, init_at: Tensor | None, final_at: Tensor | None) -> ChunkLayout:
    """Layout of ``batch`` rows of ``seqlen`` tokens; ``cu_docs`` ``[n+1]`` are document boundaries in
    the row-major token stream (every row start among them); points are stream positions (-1: none)."""
    chunks = -(-seqlen // chunk)
    device = cu_docs.device
    cu_docs = cu_docs.long()
    stream = torch.arange(batch * seqlen, device=device)
    token_doc = torch.searchsorted(cu_docs[1:], stream, right=True).view(batch, seqlen)  # [B, L]
    padded = torch.cat([token_doc, token_doc[:, -1:].expand(batch, chunks * chunk - seqlen)], dim=1)
    doc = padded.reshape(batch * chunks, chunk)  # [Kc, Q]
    carried = torch.cat([doc.new_full((1,), -1), doc[:-1, -1]])  # [Kc]: the token before each chunk
    points = {}
    for name, at in (("init", init_at), ("final", final_at)):
        if at is None:
            continue
        at = at.long()
        valid = at >= 0
        at = at.clamp(min=0)
        padded_pos = (at // seqlen) * (chunks * chunk) + at % seqlen
        points[name] = (padded_pos // chunk, padded_pos % chunk, token_doc.flatten()[at], valid)
    return ChunkLayout(batch, seqlen, chunk, chunks, doc, carried, points)


@dataclass
class _Prepared:
    """The per-chunk tensors both passes start from (compute dtype, padded)."""

    xdt: Tensor  # [Kc, G, R, Q, P] dt * x, head-major
    a: Tensor  # [Kc, G, R, Q] dt * A (compute dtype)
    cs: Tensor  # [Kc, G, R, Q] within-chunk inclusive cumsum of dt * A, in float64 (differences do not cancel)
    cs_excl: Tensor  # [Kc, G, R, Q + 1] exclusive cumsum (cs_excl[o] = cs[o-1], 0 at o = 0), float64
    Bg: Tensor  # [Kc, G, Q, N]
    Cg: Tensor  # [Kc, G, Q, N]
    init_states: Tensor | None  # [m, G, N, R, P]

    def exp(self, exponent: Tensor, keep: Tensor | None = None, upper: float | None = None) -> Tensor:
        """``exp`` of a (float64) exponent, floored, in the compute dtype; exactly 0 where not ``keep``."""
        out = exponent.to(self.xdt.dtype).clamp(min=decay_floor(self.xdt.dtype), max=upper).exp()
        return out if keep is None else out * keep


def _prepare(x, dt, A, B, C, layout: ChunkLayout, init_states) -> _Prepared:
    kc, q = layout.num_chunks, layout.chunk
    groups, heads, headdim = B.shape[2], x.shape[2], x.shape[3]
    r = heads // groups
    xdt = layout.pad(x * dt[..., None]).view(kc, q, groups, r, headdim).permute(0, 2, 3, 1, 4).contiguous()
    a = layout.pad(dt * A).view(kc, q, groups, r).permute(0, 2, 3, 1).contiguous()  # [Kc, G, R, Q]
    cs = a.to(torch.float64).cumsum(-1)
    cs_excl = F.pad(cs, (1, 0))
    Bg = layout.pad(B).transpose(1, 2).contiguous()
    Cg = layout.pad(C).transpose(1, 2).contiguous()
    if init_states is not None:  # [m, H, P, N] -> [m, G, N, R, P]
        init_states = init_states.view(-1, groups, r, headdim, B.shape[3]).permute(0, 1, 4, 2, 3)
    return _Prepared(xdt, a, cs, cs_excl, Bg, Cg, init_states)


def _group_rows(t: Tensor) -> Tensor:
    """``[..., G, R, Q, P] -> [..., G, Q, R*P]`` (a copy)."""
    return t.transpose(-3, -2).flatten(-2)


def _head_rows(t: Tensor, r: int) -> Tensor:
    """``[..., G, Q, R*P] -> [..., G, R, Q, P]`` (a view)."""
    return t.unflatten(-1, (r, -1)).transpose(-3, -2)


def _chunk_states(p: _Prepared, layout: ChunkLayout):
    """States each chunk leaves for its last document, with the initial states that enter it:
    ``S [Kc, G, N, R*P]``, the per-token weights ``u [Kc, G, R, Q]`` and the init weights."""
    in_last = (layout.doc == layout.doc[:, -1:])[:, None, None, :]  # [Kc, 1, 1, Q]
    u = p.exp(suffix_sums(p.a.double()), in_last)  # [Kc, G, R, Q]: exp(sum_{k>s} a_k)
    kc, groups, _, _, _ = p.xdt.shape
    S = p.xdt.new_empty(kc, groups, p.Bg.shape[-1], p.xdt.shape[2] * p.xdt.shape[-1])
    for part in _chunk_slices(p):
        torch.matmul(p.Bg[part].transpose(-1, -2), _group_rows(p.xdt[part] * u[part, ..., None]), out=S[part])
    f = None
    if p.init_states is not None:
        k, o, d, valid = layout.points["init"]
        to_last = (layout.doc[k, -1] == d) & valid  # [m]
        f = p.exp(p.cs[k, :, :, -1] - _at(p.cs_excl[k], o), to_last[:, None, None])  # [m, G, R]
        S = S.index_add(0, k, (p.init_states * f[:, :, None, :, None]).flatten(-2))
    return S, u, f


def _at(t: Tensor, offset: Tensor) -> Tensor:
    """``t[i, ..., offset[i]]`` for ``t [m, ..., Q]``."""
    index = offset.view(-1, *([1] * (t.dim() - 1))).expand(*t.shape[:-1], 1)
    return t.gather(-1, index)[..., 0]


def _start_states(S: Tensor, p: _Prepared, layout: ChunkLayout):
    """``start [Kc, G, N, R*P]`` (state entering each chunk) and ``carry [Kc]`` (the chunk is all
    the carried document, so its decay passes the state on)."""
    kc = S.shape[0]
    carry = layout.doc[:, -1] == layout.carried  # [Kc] the whole chunk continues the carried doc
    log_decay = p.a.sum(-1).reshape(kc, -1).t()  # [H, Kc]
    h = _from_heads(linear_recurrence(_to_heads(S, p.cs.shape[2]), log_decay, ~carry), S.shape)  # [Kc, G, N, R*P]
    start = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
    return start, carry


def _chunk_slices(p: _Prepared):
    """Slices of a few chunks: each pass over the chunks works on one at a time, so its
    temporaries (the ``[k, G, R, Q, Q]`` decay matrices and ``[k, Q, H, P]`` products) stay small."""
    kc, groups, r, q, headdim = p.xdt.shape
    budget = slice_budget(p.xdt.device.type)
    step = max(1, budget // (groups * r * q * max(q, headdim) * p.xdt.element_size()))
    return [slice(i, i + step) for i in range(0, kc, step)]


def _diagonal(p: _Prepared, layout: ChunkLayout, part: slice, with_factors: bool = False):
    """``scores [k, G, R, Q, Q]`` of the chunks in ``part`` (and, ``with_factors``, their decays,
    masked ``C·B`` and mask)."""
    q = layout.chunk
    doc = layout.doc[part]
    keep = (doc[:, :, None] == doc[:, None, :]) & torch.ones(q, q, dtype=torch.bool, device=doc.device).tril()
    CB = (p.Cg[part] @ p.Bg[part].transpose(-1, -2)) * keep[:, None]  # [k, G, Q(l), Q(s)]
    a = p.a[part]  # exponents sum_{s<k<=l} a_k
    decay = segment_sums(a).clamp_(decay_floor(a.dtype), 0.0).exp_()  # [k, G, R, Q, Q]
    if not with_factors:
        return decay.mul_(CB[:, :, None])
    return decay * CB[:, :, None], decay, CB, keep


@full_precision
def forward(x, dt, A, B, C, D, layout: ChunkLayout, init_states=None, want_y=True, want_final=False):
    """``(y [B, L, H, P] or None, final states [m, H, P, N] or None)``; inputs in compute dtype."""
    p = _prepare(x, dt, A, B, C, layout, init_states)
    kc, groups, r, q, headdim = p.xdt.shape
    start, _ = _start_states(_chunk_states(p, layout)[0], p, layout)
    y = final = None
    if want_y:
        in_carried = (layout.doc == layout.carried[:, None])[:, None, None, :]  # [Kc, 1, 1, Q]
        w = p.exp(p.cs, in_carried)  # [Kc, G, R, Q]
        y = torch.empty_like(p.xdt)  # [Kc, G, R, Q, P]
        for part in _chunk_slices(p):
            torch.mul(_head_rows(p.Cg[part] @ start[part], r), w[part, ..., None], out=y[part])  # step 4
            y[part] += _diagonal(p, layout, part) @ p.xdt[part]  # step 1
        if p.init_states is not None:
            k, weight, _ = _init_outputs(p, layout)
            y = y.index_add(0, k, _head_rows(p.Cg[k] @ p.init_states.flatten(-2), r) * weight[..., None])
        y = layout.unpad(y.permute(0, 3, 1, 2, 4).reshape(kc, q, groups * r, headdim))  # [B, L, H, P]
        if D is not None:
            y = torch.addcmul(y, x, D[:, None] if D.dim() == 1 else D)
    if want_final:
        final = _final_states(p, layout, start)[0]
        final = final.view(-1, groups, B.shape[3], r, headdim).permute(0, 1, 3, 4, 2).reshape(-1, groups * r, headdim, B.shape[3])
    return y, final


def _init_outputs(p: _Prepared, layout: ChunkLayout):
    """Chunk of each initial state and its weights ``exp(cs_l - cs_{o-1})`` on its document's tokens."""
    k, o, d, valid = layout.points["init"]
    q = layout.chunk
    mask = (layout.doc[k] == d[:, None]) & (torch.arange(q, device=k.device) >= o[:, None]) & valid[:, None]
    weight = p.exp(p.cs[k] - _at(p.cs_excl[k], o)[..., None], mask[:, None, None, :], upper=0.0)  # [m, G, R, Q]
    return k, weight, o


def _final_states(p: _Prepared, layout: ChunkLayout, start: Tensor):
    """States right after the final points ``[m, G, N, R*P]`` and the pieces their gradient needs."""
    k, o, d, valid = layout.points["final"]
    q = layout.chunk
    cs_o = _at(p.cs[k], o)  # [m, G, R]
    carry = (layout.carried[k] == d) & valid
    w_start = p.exp(cs_o, carry[:, None, None])  # [m, G, R]
    mask = (torch.arange(q, device=k.device) <= o[:, None]) & (layout.doc[k] == d[:, None]) & valid[:, None]
    v = p.exp(cs_o[..., None] - p.cs[k], mask[:, None, None, :], upper=0.0)  # [m, G, R, Q]; masked tokens after o
    # would have exponents > 0 (exp overflows to inf in float32 over a long chunk, and inf * 0 is NaN)
    r = p.cs.shape[2]
    state = (start[k].unflatten(-1, (r, -1)) * w_start[:, :, None, :, None]).flatten(-2)
    state = state + p.Bg[k].transpose(-1, -2) @ _group_rows(p.xdt[k] * v[..., None])
    coef = None
    if p.init_states is not None:
        ki, _, di, valid_i = layout.points["init"]
        _, _, oi = _init_outputs(p, layout)
        match = (k[:, None] == ki) & (d[:, None] == di) & (oi <= o[:, None]) & valid[:, None] & valid_i  # [m, m']
        cs_excl_i = _at(p.cs_excl[ki], oi)  # [m', G, R]
        coef = p.exp(cs_o[:, None] - cs_excl_i[None], match[..., None, None], upper=0.0)  # [m, m', G, R]
        state = state + torch.einsum("jigr,ignrp->jgnrp", coef, p.init_states).flatten(-2)
    return state, w_start, v, coef


@full_precision
def backward(x, dt, A, B, C, D, layout: ChunkLayout, init_states, grad_y, grad_final):
    """Gradients ``(dx, ddt, dA, dB, dC, dD, d_init_states)`` of ``forward``'s outputs against
    ``grad_y [B, L, H, P]`` and ``grad_final [m, H, P, N]`` (either may be None), recomputing the
    chunk tensors. ``dD``/``d_init_states`` are None when ``D``/``init_states`` are."""
    p = _prepare(x, dt, A, B, C, layout, init_states)
    kc, groups, r, q, headdim = p.xdt.shape
    S, u, f_init = _chunk_states(p, layout)
    start, carry = _start_states(S, p, layout)
    del S
    dxdt = torch.zeros_like(p.xdt)  # [Kc, G, R, Q, P]
    dcs_excl = torch.zeros_like(p.cs_excl, dtype=p.xdt.dtype)  # [Kc, G, R, Q + 1]: gradient of cs_excl; [..., 1:] is that of cs
    dcs = dcs_excl[..., 1:]
    da = torch.zeros_like(p.a)  # [Kc, G, R, Q]: gradient of a = dt A taken directly (no cumsum difference)
    lower = torch.ones(q, q, dtype=torch.bool, device=x.device).tril(-1)
    dBg, dCg, dstart = torch.zeros_like(p.Bg), torch.zeros_like(p.Cg), torch.zeros_like(start)
    d_init = None if p.init_states is None else torch.zeros_like(p.init_states)  # [m, G, N, R, P]

    def add_at(k: Tensor, offset: Tensor, values: Tensor) -> None:  # dcs_excl[k, :, :, offset] += values [m, G, R]
        dcs_excl.permute(0, 3, 1, 2).index_put_((k, offset), values, accumulate=True)

    dD = None
    if grad_y is not None:
        padded = layout.pad(grad_y).view(kc, q, groups, r, headdim)

        def head_major(index) -> Tensor:  # dy of some chunks as [k, G, R, Q, P]
            return padded[index].permute(0, 2, 3, 1, 4).contiguous()

        in_carried = (layout.doc == layout.carried[:, None])[:, None, None, :]
        w = p.exp(p.cs, in_carried)  # [Kc, G, R, Q]
        for part in _chunk_slices(p):
            gy = head_major(part)
            # 4. carried states: y_l = exp(cs_l) C_l · start
            gy_rows = _group_rows(gy * w[part, ..., None])  # [k, G, Q, R*P]
            dstart[part] += p.Cg[part].transpose(-1, -2) @ gy_rows
            dCg[part] += gy_rows @ start[part].transpose(-1, -2)
            dcs[part] += (_head_rows(p.Cg[part] @ start[part], r) * _head_rows(gy_rows, r)).sum(-1)
            # 1. diagonal blocks
            scores, decay, CB, keep = _diagonal(p, layout, part, with_factors=True)
            dxdt[part] += scores.transpose(-1, -2) @ gy
            d_scores = gy @ p.xdt[part].transpose(-1, -2)  # [k, G, R, Q, Q]
            d_scores *= decay
            del scores, decay
            dCB = d_scores.sum(2) * keep[:, None]  # [k, G, Q, Q]
            d_scores *= CB[:, :, None]
            # the segment sums' adjoint, d a_k = sum_{l>=k>s} d_scores[l, s] (reverse cumsum over l): a row sum
            # minus a column sum of dcs cancels as cs did (dA off 170% after a saturated dt)
            da[part] += d_scores.flip(-2).cumsum_(-2).mul_(lower.flip(-2)).sum(-1).flip(-1)
            dCg[part] += dCB @ p.Bg[part]
            dBg[part] += dCB.transpose(-1, -2) @ p.Cg[part]
        # 5. initial states inside their chunk
        if p.init_states is not None:
            k, weight, o = _init_outputs(p, layout)
            h0 = p.init_states.flatten(-2)  # [m, G, N, R*P]
            gi_rows = _group_rows(head_major(k) * weight[..., None])  # [m, G, Q, R*P]
            d_init += (p.Cg[k].transpose(-1, -2) @ gi_rows).unflatten(-1, (r, headdim))
            dCg.index_add_(0, k, gi_rows @ h0.transpose(-1, -2))
            t = (_head_rows(p.Cg[k] @ h0, r) * _head_rows(gi_rows, r)).sum(-1)  # [m, G, R, Q]
            dcs.index_add_(0, k, t)
            add_at(k, o, -t.sum(-1))
        if D is not None:
            dD = (grad_y * x).sum((0, 1))
            dD = dD.sum(-1) if D.dim() == 1 else dD
    if grad_final is not None:
        k, o, _, _ = layout.points["final"]
        gf = grad_final.view(-1, groups, r, headdim, grad_final.shape[-1]).permute(0, 1, 4, 2, 3)  # [m, G, N, R, P]
        gf_rows = gf.flatten(-2)
        state, w_start, v, coef = _final_states(p, layout, start)
        dstart.index_add_(0, k, (gf * w_start[:, :, None, :, None]).flatten(-2))
        add_at(k, o + 1, (state.unflatten(-1, (r, headdim)) * gf).sum((2, 4)))  # d cs_o = <h, dh>
        BdH = _head_rows(p.Bg[k] @ gf_rows, r)  # [m, G, R, Q, P]
        xdt_k = p.xdt[k]
        dxdt.index_add_(0, k, BdH * v[..., None])
        dBg.index_add_(0, k, _group_rows(xdt_k * v[..., None]) @ gf_rows.transpose(-1, -2))
        dcs.index_add_(0, k, -v * (xdt_k * BdH).sum(-1))
        if coef is not None:
            ki, _, _, _ = layout.points["init"]
            _, _, oi = _init_outputs(p, layout)
            d_init += torch.einsum("jigr,jgnrp->ignrp", coef, gf)
            add_at(ki, oi, -(coef * torch.einsum("ignrp,jgnrp->jigr", p.init_states, gf)).sum(0))
    # 3. state passing: h_k = a_k h_{k-1} + S_k with h_k = start_{k+1}
    grad_h = _to_heads(torch.cat([dstart[1:], torch.zeros_like(dstart[:1])]), r)  # [H, Kc, N*P]
    del dstart
    log_decay = p.a.sum(-1).reshape(kc, -1).t()  # [H, Kc]
    dS = _from_heads(reverse_recurrence(grad_h, log_decay, ~carry), start.shape)
    del grad_h
    inner = (dS.unflatten(-1, (r, headdim)) * start.unflatten(-1, (r, headdim))).sum((2, 4))  # [Kc, G, R] <dh_k, h_{k-1}>
    dcs[..., -1] += step_decay(log_decay, ~carry).t().view(kc, groups, r) * inner
    del start
    # 2. chunk states (and the initial states entering them)
    if f_init is not None:
        k, o, _, _ = layout.points["init"]
        dS_k = dS[k].unflatten(-1, (r, headdim))  # [m, G, N, R, P]
        d_init += dS_k * f_init[:, :, None, :, None]
        t = f_init * (p.init_states * dS_k).sum((2, 4))  # [m, G, R]
        dcs[..., -1].index_add_(0, k, t)
        add_at(k, o, -t)
    for part in _chunk_slices(p):
        BdS = _head_rows(p.Bg[part] @ dS[part], r)  # [k, G, R, Q, P]
        dxdt[part] += BdS * u[part, ..., None]
        dBg[part] += _group_rows(p.xdt[part] * u[part, ..., None]) @ dS[part].transpose(-1, -2)
        uZ = u[part] * (p.xdt[part] * BdS).sum(-1)  # [k, G, R, Q]
        da[part] += F.pad(uZ.cumsum(-1)[..., :-1], (1, 0))  # u_s = exp(sum_{s<k<=last} a_k): d a_k = sum_{s<k} uZ_s
    # back to the token layout: cs = cumsum(dt A), xdt = dt x
    da = layout.unpad((dcs.flip(-1).cumsum(-1).flip(-1) + da).permute(0, 3, 1, 2).reshape(kc, q, groups * r))  # [B, L, H]
    dxdt = layout.unpad(dxdt.permute(0, 3, 1, 2, 4).reshape(kc, q, groups * r, headdim))  # [B, L, H, P] (a copy)
    ddt = torch.linalg.vecdot(dxdt, x).addcmul_(da, A)
    dA = (da * dt).sum((0, 1))
    dx = dxdt.mul_(dt[..., None])
    if D is not None and grad_y is not None:
        dx.addcmul_(grad_y, D[:, None] if D.dim() == 1 else D)
    dB, dC = (layout.unpad(t.transpose(1, 2)) for t in (dBg, dCg))
    if d_init is not None:
        d_init = d_init.permute(0, 1, 3, 4, 2).reshape(-1, groups * r, headdim, B.shape[3])  # [m, H, P, N]
    return dx, ddt, dA, dB, dC, dD, d_init


def _to_heads(t: Tensor, r: int) -> Tensor:
    """``[Kc, G, N, R*P] -> [H, Kc, N*P]`` (a copy)."""
    kc, groups, dstate, _ = t.shape
    return t.view(kc, groups, dstate, r, -1).permute(1, 3, 0, 2, 4).reshape(groups * r, kc, -1)


def _from_heads(t: Tensor, shape) -> Tensor:
    """``[H, Kc, N*P] -> [Kc, G, N, R*P]``."""
    kc, groups, dstate, width = shape
    r = t.shape[0] // groups
    return t.view(groups, r, kc, dstate, -1).permute(2, 0, 3, 1, 4).reshape(kc, groups, dstate, width)
