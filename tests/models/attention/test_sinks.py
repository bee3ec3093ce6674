"""Attention sinks (models/attention/sinks.py) against the softmax written out with the sink as
one more column, as transformers' eager GPT-OSS attention computes it: output, q/k/v gradients
and the sinks' own gradient, in float64, with documents, a window, GQA and queries that see no key."""

from __future__ import annotations

import math

import pytest
import torch

from hybridpar.models.attention.kernels import attention_core
from hybridpar.models.attention.layout import AttentionLayout
from hybridpar.models.attention.sinks import sink_attention
from tests.attention_reference import document_causal_mask
from tests.models.attention.test_blockwise import documents, qkv


def written_out(q, k, v, sinks, q_pos, q_doc, k_pos, k_doc, scale, sliding_window):
    repeat = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~document_causal_mask(q_pos, q_doc, k_pos, k_doc, sliding_window), float("-inf"))
    sink = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]  # the sink's column dropped: its value is 0
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def outputs_and_grads(fn, q, k, v, sinks):
    out = fn(q, k, v, sinks)
    weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    return [out.detach(), *torch.autograd.grad((out * weight).sum(), (q, k, v, sinks))]


@pytest.mark.parametrize("window, keys", [(None, slice(None)), (5, slice(None)), (None, slice(10, None))])
def test_sinks_equal_the_written_out_softmax(window, keys):
    cu = [0, 10, 11, 30, 41]
    pos, doc = documents(cu)
    q, k, v = qkv(2, 41, 41, 4, 2, 8)
    k, v = (x[:, keys].detach().requires_grad_() for x in (k, v))  # (10, None): the first document sees no key
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    args = (pos, doc, pos[keys], doc[keys])
    got = outputs_and_grads(lambda q, k, v, s: sink_attention(
        q, k, v, s, *args, None, scale=0.6, sliding_window=window, block_size=4, keys_per_step=8, softcap=None),
        q, k, v, sinks)
    want = outputs_and_grads(lambda q, k, v, s: written_out(q, k, v, s, *args, 0.6, window), q, k, v, sinks)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert (a - b).abs().max() < 1e-12, name
    assert got[4].abs().min() > 1e-3  # every sink gets a gradient
    if keys.start:
        assert got[0][:, :10].abs().max() == 0  # no key: all weight on the sink


def test_attention_core_runs_sinks_on_the_blockwise_core_only():
    q, k, v = qkv(1, 12, 12, 2, 2, 8)
    layout = AttentionLayout.sequence(torch.zeros(12, dtype=torch.int32))
    sinks = torch.zeros(2, dtype=torch.float64)
    plain = attention_core(q, k, v, layout)
    sunk = attention_core(q, k, v, layout, sinks=sinks)
    # a zero sink is one more key of score 0: the real keys keep exp(lse) / (exp(lse) + 1) of their weight
    assert not torch.allclose(plain, sunk) and math.isfinite(float(sunk.sum()))
    with pytest.raises(ValueError, match="attention kernel 'flex' has no attention sinks"):
        attention_core(q, k, v, layout, sinks=sinks, kernel="flex")
    with pytest.raises(ValueError, match=r"one floating logit per query head, shape \(2,\), got \(3,\)"):
        attention_core(q, k, v, layout, sinks=torch.zeros(3))


def test_sinks_compile_as_custom_ops_without_graph_breaks():
    """dynamo sees one opaque op per direction (as the blockwise core); aot_eager runs them and equals eager."""
    cu = [0, 9, 24]
    pos, doc = documents(cu)
    q, k, v = qkv(1, 24, 24, 4, 2, 8)
    sinks = torch.tensor([0.3, -0.2, 1.0, 0.1], dtype=torch.float64, requires_grad=True)

    def attend(q, k, v, sinks):
        return sink_attention(q, k, v, sinks, pos, doc, pos, doc, None, scale=0.5, sliding_window=7, block_size=4,
                              keys_per_step=8, softcap=None)

    explanation = torch._dynamo.explain(attend)(q, k, v, sinks)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    got, want = outputs_and_grads(compiled, q, k, v, sinks), outputs_and_grads(attend, q, k, v, sinks)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert (a - b).abs().max() < 1e-12, name


def test_sink_ops_pass_opcheck():
    from hybridpar.models.attention import sinks as sinks_module  # noqa: F401 - registers the ops

    pos, doc = documents([0, 5, 12])
    q, k, v = qkv(1, 12, 12, 2, 1, 8)
    sinks = torch.tensor([0.5, -0.5], dtype=torch.float64, requires_grad=True)
    args = (q, k, v, sinks, pos, doc, pos, doc, None, 0.4, 3, 4, 8, None)
    torch.library.opcheck(torch.ops.hybridpar.sink_attention_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
