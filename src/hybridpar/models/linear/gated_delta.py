"""The chunked gated delta rule with document resets (pure PyTorch, autograd through plain ops).

Per value head, with state ``S [dk, dv]``, queries scaled by ``s = dk**-0.5`` and, token by token::

    S <- exp(g_t) S                         (decay, g_t <= 0)
    u_t = beta_t (v_t - S^T k_t)            (the delta rule's correction)
    S <- S + k_t u_t^T
    o_t = S^T (s q_t)

and ``S = 0`` (or the row's ``initial_state`` for its first document) before the first token of
every document. Chunks of ``C`` tokens: with ``G_i`` the cumulative sum of ``g`` from the chunk start,
``S_0`` the state carried into the chunk, ``c_i = 1`` when token ``i``'s document began before the
chunk (the row's first document continues ``initial_state``) and ``M_ij = [doc_i = doc_j][j <= i]``::

    A_ij  = beta_i (k_i . k_j) exp(G_i - G_j) M_ij [j < i]               (strictly lower)
    U     = (I + A)^-1 (beta v)                                          (UT transform)
    W     = (I + A)^-1 (beta c exp(G) k)
    u     = U - W S_0
    o_i   = c_i exp(G_i) (s q_i)^T S_0 + sum_j (s q_i . k_j) exp(G_i - G_j) M_ij u_j
    S_end = c_L exp(G_L) S_0 + sum_j exp(G_L - G_j) [doc_j = doc_L] k_j u_j^T   (L: last token)

Masking by document makes ``A`` block diagonal per document, so the solve never mixes documents,
and ``c`` keeps ``S_0`` away from a document that starts inside the chunk: each document sees the
recurrence of its own tokens only, whatever chunk it starts in. A row is padded to a multiple of
``C`` with ``k = v = beta = g = 0`` (no effect on the state). Memory is linear in the sequence:
the largest tensors are ``[B, H, T/C, C, C]``; no ``[T, T]`` tensor exists. With ``doc_ids=None``
every row is one document: this is transformers' ``torch_chunk_gated_delta_rule`` (without its
in-kernel l2 norm), which the tests hold it to, document by document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridpar.models.mamba.recurrence import segment_sums, suffix_sums

__all__ = ["chunk_gated_delta_rule", "document_ids", "chunk_documents", "carry_chunks"]


def document_ids(cu_docs: Tensor, batch: int, seqlen: int) -> Tensor:
    """``[B, L]`` document index of every token from ``cu_docs`` on the row-major stream
    (``models.mamba.core.row_documents``): increasing along each row, distinct between rows."""
    stream = torch.arange(batch * seqlen, device=cu_docs.device, dtype=cu_docs.dtype)
    return torch.searchsorted(cu_docs[1:], stream, right=True).view(batch, seqlen)


def chunk_documents(doc_ids: Tensor | None, batch: int, seqlen: int, chunk_size: int, states_at: list[int] | None,
                    device, dtype: torch.dtype) -> tuple[Tensor, Tensor, int]:
    """The chunk masks both delta rules share (module docstring), for ``doc_ids [B, T]`` (None: one
    document per row) padded to whole chunks of ``C``: ``(carried [B, 1, N, C]`` (``c_i``, in ``dtype``),
    ``visible [B, 1, N, C, C]`` (``M_ij``), ``pad)``. A document fed a state at the start of a chunk in
    ``states_at`` continues it; padding joins the last document."""
    if doc_ids is None:
        doc_ids = torch.zeros(batch, seqlen, dtype=torch.long, device=device)
    C = chunk_size
    pad = (-seqlen) % C
    doc = F.pad(doc_ids, (0, pad), mode="replicate") if pad else doc_ids
    chunks = (seqlen + pad) // C
    doc = doc.view(batch, 1, chunks, C)
    first = doc[..., :1]  # [B, 1, N, 1]
    before = torch.cat([first[:, :, :1], doc[:, :, :-1, -1:]], dim=2)  # doc of the token before each chunk
    carried = (doc == first) & (before == first)  # the chunk's first document began before it (chunk 0: the row's)
    if states_at is not None:
        fed = torch.zeros(chunks, dtype=torch.bool, device=device)
        fed[states_at] = True
        carried = carried | (fed[:, None] & (doc == first))
    same = doc.unsqueeze(-1) == doc.unsqueeze(-2)  # [B, 1, N, C, C]
    visible = same & torch.ones(C, C, dtype=torch.bool, device=device).tril()
    return carried.to(dtype), visible, pad


def carry_chunks(q_read: Tensor, intra: Tensor, U: Tensor, W: Tensor, k_write: Tensor, state_decay: Tensor,
                 state: Tensor, seqlen: int, states_at: list[int] | None = None,
                 states_in: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
    """The sequential part both delta rules share: the state ``S [B, H, dk, dv]`` carried chunk by chunk
    (``u = U - W S_0``, ``S <- decay S + k_write^T u``; ``states_in`` replace it at chunks ``states_at``),
    then the outputs batched: ``o = q_read S_0 + intra u``. Returns ``(o [B, H, T, dv]``, the state after
    every chunk``)``. Chunk tensors are ``[B, H, N, C, .]``; ``state_decay`` ``[B, H, N, dk or 1, 1]``."""
    # unbind, not [:, :, i]: the backward of one unbind stacks the chunk gradients, where N selects would
    # each fill a full-size zero
    entering, corrections, finals = [], [], []
    fed = {} if states_at is None else dict(zip(states_at, states_in.to(state.dtype).unbind(0)))
    for i, (U_i, W_i, write_i, decay_i) in enumerate(zip(U.unbind(2), W.unbind(2), k_write.transpose(-1, -2).unbind(2),
                                                         state_decay.unbind(2))):
        if i in fed:
            state = fed[i].expand_as(state)
        entering.append(state)
        u = U_i - W_i @ state  # [B, H, C, dv]
        corrections.append(u)
        state = state * decay_i + write_i @ u
        finals.append(state)
    o = q_read @ torch.stack(entering, dim=2) + intra @ torch.stack(corrections, dim=2)  # [B, H, N, C, dv]
    return o.flatten(2, 3)[:, :, :seqlen], finals


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, doc_ids: Tensor | None = None, chunk_size: int = 64,
    scale: float | None = None, initial_state: Tensor | None = None, output_final_state: bool = False,
    states_at: list[int] | None = None, states_in: Tensor | None = None, finals_at: list[int] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``q, k [B, T, Hk, dk]``, ``v [B, T, Hv, dv]``, ``g, beta [B, T, Hv]`` (``Hv`` a multiple of
    ``Hk``: value head ``h`` reads key head ``h // (Hv/Hk)``), ``doc_ids [B, T]`` (non-decreasing per
    row; None: one document per row) -> ``(o [B, T, Hv, dv], S [B, Hv, dk, dv] or None)``.

    ``initial_state [B, Hv, dk, dv]`` enters the first document of each row; the final state is the
    state after each row's last token (its last document). Computed in float32 or wider.

    Chunk-aligned documents (one row; context-parallel state passing): ``states_in [m, Hv, dk, dv']``
    enter the documents that start exactly at the first token of chunks ``states_at`` (m chunk indices),
    and the states after chunks ``finals_at`` are returned instead, ``[f, Hv, dk, dv']``."""
    batch, seqlen, k_heads, dk = k.shape
    v_heads, dv = v.shape[-2:]
    if v_heads % k_heads or q.shape != k.shape or g.shape != (batch, seqlen, v_heads) or beta.shape != g.shape:
        raise ValueError(f"gated delta rule expects q, k [B, T, Hk, dk], v [B, T, Hv, dv] with Hv % Hk == 0 and g, beta "
                         f"[B, T, Hv]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
                         f"beta {tuple(beta.shape)}.")
    out_dtype = q.dtype
    dtype = torch.promote_types(torch.float32, torch.promote_types(q.dtype, v.dtype))
    if k_heads != v_heads:
        q, k = (x.repeat_interleave(v_heads // k_heads, dim=2) for x in (q, k))
    q, k, v, g, beta = (x.transpose(1, 2).to(dtype) for x in (q, k, v, g, beta))  # [B, H, T, ...]
    q = q * (dk ** -0.5 if scale is None else scale)
    C = chunk_size
    carried, visible, pad = chunk_documents(doc_ids, batch, seqlen, C, states_at, q.device, dtype)  # c_i, M_ij
    chunks = (seqlen + pad) // C
    q, k, v = (F.pad(x, (0, 0, 0, pad)).unflatten(2, (chunks, C)) for x in (q, k, v))  # [B, H, N, C, d]
    g, beta = (F.pad(x, (0, pad)).unflatten(2, (chunks, C)) for x in (g, beta))  # [B, H, N, C]

    G = g.cumsum(-1)  # [B, H, N, C]
    # G_i - G_j as the segment sum sum_{j<m<=i} g_m (a masked cumsum; G_L - G_j as a suffix sum), never a difference
    # of two cumsums: after one saturated step (G ~ -7e6) float32's G steps by its ulp, and o was 12% off
    decay = segment_sums(g).masked_fill(~visible, float("-inf")).exp()  # M_ij exp(G_i - G_j) [B, H, N, C, C]
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # A (+ a diagonal the unitriangular solve ignores)
    read_decay = (G.exp() * carried).unsqueeze(-1)  # c_i exp(G_i)
    U = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(system, k_beta * read_decay, upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C]
    q_read = q * read_decay
    last_same = visible[..., -1, :].to(dtype)  # [B, 1, N, C]: [doc_j = doc_L] (row L of M: every j <= L)
    k_write = k * (suffix_sums(g).exp() * last_same).unsqueeze(-1)
    state_decay = (G[..., -1].exp() * carried[..., -1])[..., None, None]  # c_L exp(G_L): [B, H, N, 1, 1]

    state = (torch.zeros(batch, v_heads, dk, dv, dtype=dtype, device=q.device) if initial_state is None
             else initial_state.to(dtype))
    o, finals = carry_chunks(q_read, intra, U, W, k_write, state_decay, state, seqlen, states_at, states_in)
    if finals_at is not None:
        return o.transpose(1, 2).to(out_dtype), torch.stack([finals[i][0] for i in finals_at])
    return o.transpose(1, 2).to(out_dtype), (finals[-1] if output_final_state else None)
