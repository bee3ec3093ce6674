"""The chunked Kimi Delta Attention (KDA) rule with document resets (pure PyTorch).

KDA is the gated delta rule with a decay per *key channel*: ``g_t [dk]`` (log space, ``<= 0``) per
head instead of one scalar. Per head, with state ``S [dk, dv]`` and ``s = dk**-0.5``, token by token
(transformers' ``recurrent_kimi_delta_attention``)::

    S <- diag(exp(g_t)) S                   (row c of S decays by exp(g_t[c]))
    u_t = beta_t (v_t - S^T k_t)
    S <- S + k_t u_t^T
    o_t = S^T (s q_t)

i.e. ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``, and ``S = 0`` (or the
row's ``initial_state`` for its first document) before every document. Chunks of ``C`` tokens: with
``G_i = sum_{t <= i} g_t`` (cumulative from the chunk start, a vector), ``S_0`` the state entering the
chunk, ``c_i = 1`` when token ``i``'s document began before the chunk, ``M_ij = [doc_i = doc_j][j <= i]``
and the *decayed product* ``<a_i, b_j>_G = sum_c a_i[c] b_j[c] exp(G_i[c] - G_j[c])``::

    A_ij  = beta_i <k_i, k_j>_G M_ij [j < i]                             (strictly lower)
    U     = (I + A)^-1 (beta v)
    W     = (I + A)^-1 (beta c exp(G) * k)                               (* per channel)
    u     = U - W S_0
    o_i   = c_i (exp(G_i) * s q_i)^T S_0 + sum_j <s q_i, k_j>_G M_ij u_j
    S_end = c_L diag(exp(G_L)) S_0 + sum_j (exp(G_L - G_j) * k_j) u_j^T [doc_j = doc_L]

Every exponent is ``<= 0`` where it is used (``G`` does not increase along a chunk), never
``exp(G_i) exp(-G_j)``, whose second factor overflows once a chunk's decay passes ~88 (float32) in
one channel. ``<., .>_G`` is computed in sub-chunks of ``SUB_CHUNK`` tokens (FLA's layout): within a
sub-chunk from the pairwise differences ``G_i - G_j`` (``j <= i``), masked to ``-inf`` *before* the exp
(``[.., C/S, S, S, dk]``); from a row of sub-chunk ``s`` to the columns before it through the end of
sub-chunk ``s-1``, ``R_s``: ``exp(G_i - G_j) = exp(G_i - R_s) exp(R_s - G_j)``, two factors ``<= 1``,
one matmul. Those products are recomputed in the backward (``torch.utils.checkpoint``), never saved,
so the memory kept for backward is ``[B, H, T/C, C, C]`` plus the inputs, linear in the sequence.
Documents mask ``A`` block diagonal and ``c`` keeps
``S_0`` from a document that starts inside the chunk, as in ``gated_delta.py`` (the same chunk
algebra with a scalar ``G``), whose padding, ``states_at`` / ``finals_at`` (context-parallel state
passing) and outputs this function shares.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from hybridpar.models.linear.gated_delta import carry_chunks, chunk_documents

__all__ = ["chunk_kda_rule", "decayed_products"]

SUB_CHUNK = 16  # tokens per sub-chunk of the decayed products


def _decayed_products(a: Tensor, b: Tensor, G: Tensor, visible: Tensor) -> Tensor:
    C, dk = G.shape[-2:]
    S = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    n = C // S
    a_s, b_s, G_s = (x.unflatten(-2, (n, S)) for x in (a, b, G))  # [.., n, S, dk]
    # within a sub-chunk: pairwise G_i - G_j, masked (j > i) to -inf before the exp
    below = torch.ones(S, S, dtype=torch.bool, device=G.device).tril()
    pairwise = (G_s[..., :, None, :] - G_s[..., None, :, :]).to(a.dtype)
    pairwise = pairwise.masked_fill(~below[..., None], float("-inf")).exp()
    inner = ((a_s[..., :, None, :] * pairwise) * b_s[..., None, :, :]).sum(-1)  # [.., n, S, S]
    out = (inner.unsqueeze(-2) * torch.eye(n, dtype=a.dtype, device=G.device)[:, None, :, None]).flatten(-2)
    if n > 1:  # rows of sub-chunk s >= 1, columns before it: two factors <= 1 around R_s, one matmul
        R = G_s[..., :-1, -1:, :]  # [.., n-1, 1, dk]: G at the end of sub-chunk s-1
        rows = a_s[..., 1:, :, :] * (G_s[..., 1:, :, :] - R).to(a.dtype).exp()  # [.., n-1, S, dk]
        earlier = torch.arange(C, device=G.device)[None, :] < torch.arange(1, n, device=G.device)[:, None] * S
        cols = (R - G.unsqueeze(-3)).to(a.dtype).masked_fill(~earlier[..., None], float("-inf"))
        cols = b.unsqueeze(-3) * cols.exp()
        cross = rows @ cols.transpose(-1, -2)  # [.., n-1, S, C]
        out = out + torch.cat([torch.zeros_like(cross[..., :1, :, :]), cross], dim=-3)
    return out.flatten(-3, -2).masked_fill(~visible, 0.0)  # [.., C, C]


def decayed_products(a: Tensor, b: Tensor, G: Tensor, visible: Tensor) -> Tensor:
    """``[.., C, C]`` of ``<a_i, b_j>_G [visible_ij]`` (zero above the diagonal) for ``a, b, G [.., C, dk]``
    (``G`` non-increasing along ``C``) and ``visible [.., C, C]`` (broadcast); recomputed in backward,
    not saved (module docstring)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (a, b, G)):
        return checkpoint(_decayed_products, a, b, G, visible, use_reentrant=False)
    return _decayed_products(a, b, G, visible)


def chunk_kda_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, doc_ids: Tensor | None = None, chunk_size: int = 64,
    scale: float | None = None, initial_state: Tensor | None = None, output_final_state: bool = False,
    states_at: list[int] | None = None, states_in: Tensor | None = None, finals_at: list[int] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``q, k [B, T, H, dk]``, ``v [B, T, H, dv]``, ``g [B, T, H, dk]`` (log decays, ``<= 0``),
    ``beta [B, T, H]``, ``doc_ids [B, T]`` (non-decreasing per row; None: one document per row) ->
    ``(o [B, T, H, dv], S [B, H, dk, dv] or None)``; q, k as given (normalise them before).

    ``initial_state [B, H, dk, dv]`` enters the first document of each row; the final state is the
    state after each row's last token. Computed in float32 or wider. Chunk-aligned documents (one
    row; context-parallel state passing): ``states_in [m, H, dk, dv]`` enter the documents that start
    at chunks ``states_at``, and the states after chunks ``finals_at`` are returned, ``[f, H, dk, dv]``."""
    batch, seqlen, heads, dk = k.shape
    dv = v.shape[-1]
    if q.shape != k.shape or g.shape != k.shape or v.shape[:3] != k.shape[:3] or beta.shape != k.shape[:3]:
        raise ValueError(f"KDA rule expects q, k, g [B, T, H, dk], v [B, T, H, dv] and beta [B, T, H]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta "
                         f"{tuple(beta.shape)}.")
    out_dtype = q.dtype
    dtype = torch.promote_types(torch.float32, torch.promote_types(q.dtype, v.dtype))
    q, k, v, g, beta = (x.transpose(1, 2).to(dtype) for x in (q, k, v, g, beta))  # [B, H, T, ...]
    q = q * (dk ** -0.5 if scale is None else scale)
    C = chunk_size
    carried, visible, pad = chunk_documents(doc_ids, batch, seqlen, C, states_at, q.device, dtype)  # c_i, M_ij
    carried = carried.unsqueeze(-1)  # [B, 1, N, C, 1]
    chunks = (seqlen + pad) // C
    q, k, v, g = (F.pad(x, (0, 0, 0, pad)).unflatten(2, (chunks, C)) for x in (q, k, v, g))  # [B, H, N, C, d]
    beta = F.pad(beta, (0, pad)).unflatten(2, (chunks, C))  # [B, H, N, C]

    # G in float64 (exponents cast before exp): a difference of float32 cumsums cancels after one saturated step (G ~ -7e6
    # in a channel: its later steps fall below float32's ulp), as in gated_delta.py and the SSD scan
    G = g.to(torch.float64).cumsum(-2)  # [B, H, N, C, dk]
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    system = decayed_products(k_beta, k, G, visible)  # A (+ a diagonal the unitriangular solve ignores)
    intra = decayed_products(q, k, G, visible)  # [B, H, N, C, C]
    read_decay = G.to(dtype).exp() * carried  # c_i exp(G_i) [B, H, N, C, dk]
    U = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(system, k_beta * read_decay, upper=False, unitriangular=True)
    q_read = q * read_decay
    last_same = visible[..., -1, :].to(dtype).unsqueeze(-1)  # [B, 1, N, C, 1]: [doc_j = doc_L] (row L of M)
    k_write = k * (G[..., -1:, :] - G).to(dtype).exp() * last_same
    state_decay = (G[..., -1, :].to(dtype).exp() * carried[..., -1, :]).unsqueeze(-1)  # c_L exp(G_L): [B, H, N, dk, 1]

    state = (torch.zeros(batch, heads, dk, dv, dtype=dtype, device=q.device) if initial_state is None
             else initial_state.to(dtype))
    o, finals = carry_chunks(q_read, intra, U, W, k_write, state_decay, state, seqlen, states_at, states_in)
    if finals_at is not None:
        return o.transpose(1, 2).to(out_dtype), torch.stack([finals[i][0] for i in finals_at])
    return o.transpose(1, 2).to(out_dtype), (finals[-1] if output_final_state else None)
