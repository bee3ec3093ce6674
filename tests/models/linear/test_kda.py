"""The chunked KDA rule with document resets (``models/linear/kda.py``) and the KDA core
(``models/linear/kda_core.py``), float64: against a token-by-token recurrence written here, document
by document (output, final state and the gradients of q, k, v, g, beta to 1e-10); against
transformers' torch ``chunk_kimi_delta_attention`` (its in-kernel l2 norm) on one document; initial
and chunk-fed states (context-parallel state passing); decays strong enough that ``exp(-G)``
overflows stay finite.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpar.models.hf.float64 import KeepFloat64
from hybridpar.models.linear.gated_delta import document_ids
from hybridpar.models.linear.kda import chunk_kda_rule
from hybridpar.models.mamba.core import row_documents

B, H, DK, DV, CHUNK = 2, 3, 8, 6, 8
DOCS = [0, 3, 16, 17, 29, 45]  # 3 < a chunk; 13 and 16 cross chunks; 16 ends at a chunk end; 1 token


def recurrence(q, k, v, g, beta, state=None):
    """Token by token (``[T, H, ..]`` of one document): S <- diag(exp g) S; u = beta (v - S^T k);
    S <- S + k u^T; o = S^T q / sqrt(dk). Returns ``(o [T, H, dv], S [H, dk, dv])``."""
    S = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=q.dtype) if state is None else state
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[..., None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][..., None] * u[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t] * q.shape[-1] ** -0.5, S))
    return torch.stack(out), S


def _inputs(seed=0, T=DOCS[-1], strength=1.0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = rand(B, T, H, DK), F.normalize(rand(B, T, H, DK), dim=-1)
    g = -strength * torch.rand(B, T, H, DK, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, rand(B, T, H, DV), g, beta)]


def _relative(got, want):
    return float((got - want).detach().abs().max() / want.detach().abs().max().clamp_min(1.0))


def _per_document(xs, docs):
    outs, finals = [], []
    for row in range(B):
        pieces = [recurrence(*(x[row, a:b] for x in xs)) for a, b in zip(docs[:-1], docs[1:])]
        outs.append(torch.cat([o for o, _ in pieces]))
        finals.append(pieces[-1][1])
    return torch.stack(outs), torch.stack(finals)


@pytest.mark.parametrize("chunk", [CHUNK, 32])  # 32: two sub-chunks of the decayed products (kda.SUB_CHUNK)
def test_rule_equals_the_recurrence_on_each_document_alone(chunk):
    xs = _inputs()
    ids = document_ids(row_documents(torch.tensor(DOCS), B, DOCS[-1], "cpu"), B, DOCS[-1])
    got, final = chunk_kda_rule(*xs, doc_ids=ids, chunk_size=chunk, output_final_state=True)
    want, want_final = _per_document(xs, DOCS)
    assert _relative(got, want) < 1e-10 and _relative(final, want_final) < 1e-10
    weight = torch.randn_like(want)
    got_grads = torch.autograd.grad((got * weight).sum() + final.sum(), xs)
    want_grads = torch.autograd.grad((want * weight).sum() + want_final.sum(), xs)
    for name, g_got, g_want in zip("q k v g beta".split(), got_grads, want_grads):
        assert _relative(g_got, g_want) < 1e-10, name


def test_rule_equals_transformers_torch_chunk_kda():
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    q, k, v, g, beta = _inputs(seed=1, T=19)
    with KeepFloat64():  # transformers computes in float32; in float64 here
        want, want_final = kimi.chunk_kimi_delta_attention.__wrapped__(
            q, k, v, g, beta, chunk_size=CHUNK, output_final_state=True, use_qk_l2norm_in_kernel=True) \
            if hasattr(kimi.chunk_kimi_delta_attention, "__wrapped__") else kimi.chunk_kimi_delta_attention(
            q, k, v, g, beta, chunk_size=CHUNK, output_final_state=True, use_qk_l2norm_in_kernel=True)
    norm = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    got, final = chunk_kda_rule(norm(q), norm(k), v, g, beta, chunk_size=CHUNK, output_final_state=True)
    assert want.dtype == torch.float64
    assert _relative(got, want) < 1e-10 and _relative(final, want_final) < 1e-10


def test_initial_states_and_chunk_fed_states():
    xs = _inputs(seed=2, T=24)
    state = torch.randn(B, H, DK, DV, dtype=torch.float64)
    got, final = chunk_kda_rule(*xs, chunk_size=CHUNK, initial_state=state, output_final_state=True)
    want = [recurrence(*(x[row] for x in xs), state=state[row]) for row in range(B)]
    assert _relative(got, torch.stack([o for o, _ in want])) < 1e-10
    assert _relative(final, torch.stack([s for _, s in want])) < 1e-10
    # one row of chunk-aligned segments [0, 8) [8, 24): states fed at chunks 0 and 1, read after chunks 0 and 2
    row = [x[:1] for x in xs]
    fed = torch.randn(2, H, DK, DV, dtype=torch.float64)
    o, finals = chunk_kda_rule(*row, doc_ids=torch.tensor([[0] * 8 + [1] * 16]), chunk_size=CHUNK, states_in=fed,
                               states_at=[0, 1], finals_at=[0, 2])
    first, second = (recurrence(*(x[0, a:b] for x in row), state=fed[i]) for i, (a, b) in enumerate([(0, 8), (8, 24)]))
    assert _relative(o[0], torch.cat([first[0], second[0]])) < 1e-10
    assert _relative(finals, torch.stack([first[1], second[1]])) < 1e-10


def test_strong_decays_stay_finite():
    """A chunk whose decay sums past 1000 in a channel: exp(-G) alone would overflow even float64."""
    xs = _inputs(seed=3, T=40, strength=200.0)
    got, _ = chunk_kda_rule(*xs, chunk_size=32)
    want = torch.stack([recurrence(*(x[row] for x in xs))[0] for row in range(B)])
    assert torch.isfinite(got).all() and _relative(got, want) < 1e-10
    grads = torch.autograd.grad(got.sum(), xs)
    assert all(torch.isfinite(g).all() for g in grads)
