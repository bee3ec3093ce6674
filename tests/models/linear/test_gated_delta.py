"""The chunked gated delta rule with document resets (``models/linear/gated_delta.py``) and the
gated DeltaNet core (``models/linear/gdn_core.py``) against transformers' torch path run on each
document alone, float64: output, and the gradients of q, k, v, g, beta (and of the conv weight,
A_log, dt_bias, a, b) to 1e-10. Documents shorter than a chunk, documents crossing chunk
boundaries, a document ending exactly at a chunk end, value heads grouped over key heads (4 over
2), two rows with different contents, initial and final states.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpar.models.hf.float64 import KeepFloat64
from hybridpar.models.linear.gated_delta import chunk_gated_delta_rule, document_ids
from hybridpar.models.linear.gdn_core import gated_delta_core
from hybridpar.models.mamba.core import row_documents

B, HK, HV, DK, DV, CHUNK = 2, 2, 4, 8, 6, 8
DOCS = [0, 3, 16, 17, 29, 45]  # 3 < a chunk; 13 and 16 cross chunks; 16 ends at a chunk end; 1 token


def _reference():
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    return qwen3_next


def _inputs(seed=0, T=DOCS[-1]):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = rand(B, T, HK, DK), F.normalize(rand(B, T, HK, DK), dim=-1)
    g = -torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, rand(B, T, HV, DV), g, beta)]


def _grads(output, tensors, weight):
    return torch.autograd.grad((output * weight).sum(), tensors)


def _relative(got, want):
    return float((got - want).detach().abs().max() / want.detach().abs().max().clamp_min(1.0))


def test_rule_equals_transformers_on_each_document_alone():
    xs = _inputs()
    docs = torch.tensor(DOCS)
    ids = document_ids(row_documents(docs, B, DOCS[-1], "cpu"), B, DOCS[-1])
    got, _ = chunk_gated_delta_rule(*xs, doc_ids=ids, chunk_size=CHUNK)
    with KeepFloat64():  # transformers computes in float32; in float64 here
        want = torch.cat([_reference().torch_chunk_gated_delta_rule(*(x[:, a:b] for x in xs), chunk_size=CHUNK)[0]
                          for a, b in zip(DOCS[:-1], DOCS[1:])], dim=1)
    assert want.dtype == torch.float64 and _relative(got, want) < 1e-10
    weight = torch.randn_like(want)
    for name, g_got, g_want in zip("q k v g beta".split(), _grads(got, xs, weight), _grads(want, xs, weight)):
        assert _relative(g_got, g_want) < 1e-10, name


@pytest.mark.parametrize("T", [13, 24])
def test_initial_and_final_state_of_one_document(T):
    xs = _inputs(1, T)
    state = torch.randn(B, HV, DK, DV, dtype=torch.float64, requires_grad=True)
    got, got_final = chunk_gated_delta_rule(*xs, chunk_size=CHUNK, initial_state=state, output_final_state=True)
    with KeepFloat64():
        want, want_final = _reference().torch_chunk_gated_delta_rule(*xs, chunk_size=CHUNK, initial_state=state,
                                                                    output_final_state=True)
    assert _relative(got, want) < 1e-10 and _relative(got_final, want_final) < 1e-10
    weight, weight_final = torch.randn_like(want), torch.randn_like(want_final)
    inputs = [*xs, state]
    got_grads = torch.autograd.grad((got * weight).sum() + (got_final * weight_final).sum(), inputs)
    want_grads = torch.autograd.grad((want * weight).sum() + (want_final * weight_final).sum(), inputs)
    for name, got_grad, want_grad in zip("q k v g beta initial_state".split(), got_grads, want_grads):
        assert _relative(got_grad, want_grad) < 1e-10, name


def test_core_with_conv_equals_transformers_per_document():
    """Conv (documents reset) + SiLU + l2 norm + beta + decay + rule, against transformers' steps per document."""
    gen = torch.Generator().manual_seed(5)
    T, width = DOCS[-1], 2 * HK * DK + HV * DV
    mixed = torch.randn(B, T, width, generator=gen, dtype=torch.float64, requires_grad=True)
    a, b = (torch.randn(B, T, HV, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight = torch.randn(width, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    A_log, dt_bias = (torch.randn(HV, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu = row_documents(torch.tensor(DOCS), B, T, "cpu")
    got = gated_delta_core(mixed, a, b, weight, None, A_log, dt_bias, head_k_dim=DK, head_v_dim=DV, chunk_size=CHUNK,
                           cu_docs=cu)
    ref = _reference()
    pieces = []
    with KeepFloat64():
        for s, e in zip(DOCS[:-1], DOCS[1:]):
            x = ref.causal_conv1d_fn(mixed[:, s:e].transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
            q, k, v = x.split([HK * DK, HK * DK, HV * DV], dim=-1)
            g = -A_log.exp() * F.softplus(a[:, s:e] + dt_bias)
            o, _ = ref.torch_chunk_gated_delta_rule(q.unflatten(-1, (HK, DK)), k.unflatten(-1, (HK, DK)),
                                                    v.unflatten(-1, (HV, DV)), g, b[:, s:e].sigmoid(), chunk_size=CHUNK,
                                                    use_qk_l2norm_in_kernel=True)
            pieces.append(o.flatten(-2))
    want = torch.cat(pieces, dim=1)
    assert _relative(got, want) < 1e-10
    w = torch.randn_like(want)
    inputs = [mixed, a, b, weight, A_log, dt_bias]
    for name, g_got, g_want in zip("mixed a b conv A_log dt_bias".split(), _grads(got, inputs, w), _grads(want, inputs, w)):
        assert _relative(g_got, g_want) < 1e-10, name


def test_bad_shapes_are_refused_in_one_line():
    q, k, v, g, beta = _inputs(T=8)
    with pytest.raises(ValueError, match="Hv % Hk == 0") as error:
        chunk_gated_delta_rule(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    assert "\n" not in str(error.value)
