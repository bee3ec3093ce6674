"""The Mamba2 core op (``mamba_core``) against the implementation it replaced, float64.

``tests/models/mamba/reference.py`` keeps the old core (per-tap conv, chunked SSD with a Python
loop over chunks, autograd through every step). The new op must give the same outputs, initial
and final states and gradients of every input to 1e-10, for packed documents (boundaries
inside chunks, on chunk edges, one-token documents), n_groups in {1, 2, 8}, dt limits; keep
nothing but its inputs for backward; run the inter-chunk recurrence in a number of tensor
operations that does not depend on the number of chunks, exactly at 300 chunks; and compile
without graph breaks.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridpar.models.mamba.core import mamba_conv_scan, row_documents
from hybridpar.models.mamba.recurrence import linear_recurrence
from tests.models.mamba.ssd_reference import ssd_scan, ssd_scan_reference
from tests.models.mamba.reference import causal_conv1d, conv_scan, ssd_scan_chunked
from tests.op_outputs import OpOutputs

F64 = torch.float64
RTOL = 1e-10


def assert_close(actual, expected, name):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().clamp(min=1e-3)  # structural zeros come out as ~1e-15 rounding noise
    err = (actual - expected).abs().max()
    assert err <= RTOL * scale, f"{name}: max error {err:.3e} > {RTOL:g} * {scale:.3e}"


def make_case(seed: int, groups: int, batch: int = 2):
    """Random conv + scan inputs (leaves with grad) and the document starts of one packed layout."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    heads = groups * rng.choice([1, 2])
    headdim, dstate, kernel = rng.randint(1, 4), rng.randint(1, 5), rng.choice([2, 4])
    chunk = rng.choice([2, 4, 8])
    seqlen = rng.randint(12, 40)
    width = heads * headdim + 2 * groups * dstate

    def leaf(t):
        return t.to(F64).requires_grad_()

    inputs = dict(
        xBC=leaf(torch.randn(batch, seqlen, width, generator=gen)),
        dt=leaf(torch.randn(batch, seqlen, heads, generator=gen)),
        conv_weight=leaf(torch.randn(width, kernel, generator=gen)),
        conv_bias=leaf(torch.randn(width, generator=gen)),
        dt_bias=leaf(torch.randn(heads, generator=gen)),
        A_log=leaf(torch.rand(heads, generator=gen).log()),
        D=leaf(torch.randn(heads, generator=gen)),
    )
    starts = {chunk, rng.randrange(1, seqlen), rng.randrange(1, seqlen)}  # one on a chunk edge
    t = rng.randrange(1, seqlen - 1)
    starts |= {t, t + 1}  # a one-token document
    cu = torch.tensor([0, *sorted(s for s in starts if 0 < s < seqlen), seqlen])
    sizes = dict(head_dim=headdim, state_size=dstate, chunk_size=chunk)
    return inputs, cu, sizes


def grads(outputs, inputs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=F64)).sum() for o in outputs)
    return torch.autograd.grad(loss, list(inputs.values()))


@pytest.mark.parametrize("groups", [1, 2, 8])
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, 0.9)])
def test_core_matches_the_old_core(groups, dt_limit):
    for seed in range(3):
        inputs, cu, sizes = make_case(seed, groups)
        batch, seqlen = inputs["dt"].shape[:2]
        seq_idx = torch.searchsorted(cu[1:], torch.arange(seqlen), right=True)[None].expand(batch, -1)
        y_ref = conv_scan(*inputs.values(), **sizes, seq_idx=seq_idx, dt_limit=dt_limit)
        y = mamba_conv_scan(*inputs.values(), **sizes, cu_docs=row_documents(cu, batch, seqlen, "cpu"), dt_limit=dt_limit)
        assert_close(y, y_ref, f"seed {seed} y")
        for name, g, g_ref in zip(inputs, grads([y], inputs), grads([y_ref], inputs)):
            assert_close(g, g_ref, f"seed {seed} grad {name}")


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_initial_and_final_states_match_the_old_core(groups):
    """Conv history and SSM state entering each row's first document, states after each row's
    last token and after every document (varlen), against the old conv + chunked scan."""
    inputs, cu, sizes = make_case(10 + groups, groups, batch=1)
    gen = torch.Generator().manual_seed(5)
    xBC, dt, weight, bias, dt_bias, A_log, D = inputs.values()
    seqlen, width = xBC.shape[1:]
    heads, headdim, dstate = dt.shape[-1], sizes["head_dim"], sizes["state_size"]
    history = torch.randn(1, weight.shape[1] - 1, width, generator=gen, dtype=F64).requires_grad_()
    h0 = torch.randn(1, heads, headdim, dstate, generator=gen, dtype=F64).requires_grad_()
    all_inputs = {**inputs, "history": history, "h0": h0}
    seq_idx = torch.searchsorted(cu[1:], torch.arange(seqlen), right=True)[None]

    conv = causal_conv1d(xBC, weight, bias, seq_idx=seq_idx, initial_states=history.transpose(1, 2), activation="silu")
    groups_n = groups * dstate
    x, B, C = conv.split([heads * headdim, groups_n, groups_n], dim=-1)
    y_ref, final_ref, varlen_ref = ssd_scan_chunked(
        x.unflatten(-1, (heads, headdim)), dt, -torch.exp(A_log), B.unflatten(-1, (groups, dstate)),
        C.unflatten(-1, (groups, dstate)), sizes["chunk_size"], D=D, dt_bias=dt_bias, dt_softplus=True, seq_idx=seq_idx,
        initial_states=h0, return_final_states=True, cu_seqlens=cu, return_varlen_states=True)
    ends = torch.cat([torch.tensor([seqlen - 1]), cu[1:] - 1])
    y, states = mamba_conv_scan(xBC, dt, weight, bias, dt_bias, A_log, D, **sizes, cu_docs=cu,
                                init_at=torch.tensor([0]), init_states=h0, conv_history=history, final_at=ends)
    assert_close(y, y_ref.flatten(-2), "y")
    assert_close(states[:1], final_ref, "final state")
    assert_close(states[1:], varlen_ref, "varlen states")
    got = grads([y, states], all_inputs)
    want = grads([y_ref.flatten(-2), torch.cat([final_ref, varlen_ref])], all_inputs)
    for name, g, g_ref in zip(all_inputs, got, want):
        assert_close(g, g_ref, f"grad {name}")


def test_core_keeps_only_its_inputs_for_backward():
    """Every tensor autograd keeps for the op is an input (or a view of one): no conv output,
    chunk state or decay matrix survives the forward."""
    inputs, cu, sizes = make_case(3, groups=2)
    xBC, dt, *params = inputs.values()
    projection = torch.cat([xBC, dt], dim=-1).detach().requires_grad_()  # stands for in_proj's output
    xBC_view, dt_view = projection.split([xBC.shape[-1], dt.shape[-1]], dim=-1)
    allowed = {t.untyped_storage().data_ptr() for t in (projection, *params)}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mamba_conv_scan(xBC_view, dt_view, *params, **sizes, cu_docs=row_documents(cu, 2, xBC.shape[1], "cpu"))
    big = [tuple(t.shape) for t in saved if t.numel() > 64 and t.untyped_storage().data_ptr() not in allowed]
    assert not big, f"the core saved tensors that are not its inputs: {big}"


def test_state_passing_runs_the_same_operations_for_any_number_of_chunks():
    counts = {}
    for n in (5, 60, 1500):
        u, log_decay, reset = torch.randn(3, n, 4), -torch.rand(3, n), torch.rand(n) < 0.05
        with OpOutputs() as counter:
            linear_recurrence(u, log_decay, reset)
        counts[n] = len(counter.ops)
    assert len(set(counts.values())) == 1, f"tensor operations per number of chunks: {counts}"


def test_exact_at_300_chunks_against_the_sequential_oracle():
    gen = torch.Generator().manual_seed(7)
    batch, seqlen, heads, headdim, groups, dstate = 1, 600, 4, 2, 2, 3

    def leaf(t):
        return t.to(F64).requires_grad_()

    inputs = dict(
        x=leaf(torch.randn(batch, seqlen, heads, headdim, generator=gen)),
        dt=leaf(torch.rand(batch, seqlen, heads, generator=gen) * 0.1),  # slow decay: states live long
        A=leaf(-torch.rand(heads, generator=gen) - 0.1),
        B=leaf(torch.randn(batch, seqlen, groups, dstate, generator=gen)),
        C=leaf(torch.randn(batch, seqlen, groups, dstate, generator=gen)),
        D=leaf(torch.randn(heads, generator=gen)),
        initial_states=leaf(torch.randn(batch, heads, headdim, dstate, generator=gen)),
    )
    seq_idx = (torch.arange(seqlen) >= 333).long()[None] + (torch.arange(seqlen) >= 400).long()[None]
    options = dict(chunk_size=2, seq_idx=seq_idx, return_final_states=True)
    outputs = ssd_scan(**inputs, **options)  # 300 chunks
    expected = ssd_scan_reference(**inputs, **options)
    for name, a, b in zip(("y", "final"), outputs, expected):
        assert_close(a, b, name)
    for name, g, g_ref in zip(inputs, grads(outputs, inputs), grads(expected, inputs)):
        assert_close(g, g_ref, f"grad {name}")


def test_compiles_without_graph_breaks_and_matches_eager():
    inputs, cu, sizes = make_case(4, groups=2)
    docs = row_documents(cu, 2, inputs["xBC"].shape[1], "cpu")

    def core(*tensors):
        return mamba_conv_scan(*tensors, **sizes, cu_docs=docs)

    torch._dynamo.reset()
    compiled = torch.compile(core, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    y = compiled(*inputs.values())
    assert_close(y, core(*inputs.values()), "compiled y")
    for name, g, g_ref in zip(inputs, grads([y], inputs), grads([core(*inputs.values())], inputs)):
        assert_close(g, g_ref, f"compiled grad {name}")


def test_float32_final_states_inside_long_chunks_stay_finite():
    """Final states read mid-chunk (documents shorter than a 256-token chunk, strong decay): the
    masked tokens after the read point must not reach exp() of a large positive exponent (inf in
    float32, then inf * 0 = NaN). Float32 states and gradients match float64."""
    gen = torch.Generator().manual_seed(0)
    heads, headdim, dstate, width = 4, 8, 16, 4 * 8 + 2 * 16
    cu = torch.tensor([0, 70, 150, 230, 307])
    inputs = [torch.randn(1, 307, width, generator=gen), torch.randn(1, 307, heads, generator=gen) + 1.0,
              torch.randn(width, 4, generator=gen) * 0.5, torch.randn(width, generator=gen) * 0.1,
              torch.randn(heads, generator=gen) * 0.5, torch.tensor([-1.5, -1.0, 0.0, 0.6]),
              torch.randn(heads, generator=gen)]
    out = {}
    for dtype in (torch.float32, F64):
        leaves = [t.to(dtype).requires_grad_() for t in inputs]
        y, final = mamba_conv_scan(*leaves, head_dim=headdim, state_size=dstate, chunk_size=256, cu_docs=cu,
                                   final_at=cu[1:] - 1)
        out[dtype] = (final, *torch.autograd.grad(final.sum() + y.sum(), leaves))
    for got, want in zip(out[torch.float32], out[F64]):
        assert torch.isfinite(got).all()
        assert (got.double() - want).abs().max() <= 1e-4 * want.abs().max()
