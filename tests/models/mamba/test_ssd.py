"""ssd_scan (chunked) against ssd_scan_reference (sequential recurrence), float64.

Outputs, final states, varlen states and the gradient of every input agree to 1e-10 relative over
random shapes, groups, chunk sizes, document layouts (boundaries inside chunks, on chunk edges,
single-token documents), initial states and dt processing.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridpar.models.mamba import ssd_chunked as ssd
from tests.models.mamba.ssd_reference import ssd_scan, ssd_scan_reference

RTOL = 1e-10
F64 = torch.float64


def assert_close(actual, expected, name="", rtol=RTOL):
    """Max error <= rtol * max|expected|; a gradient that is exactly 0 in the reference (a
    structural zero) comes out as rounding noise of O(1) terms (~1e-15): the scale is at least 1e-3."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert not torch.isnan(actual).any(), f"{name}: NaN"
    scale = expected.abs().max().clamp(min=1e-3)
    err = (actual - expected).abs().max()
    assert err <= rtol * scale, f"{name}: max error {err:.3e} > {rtol:g} * {scale:.3e}"


def random_boundaries(rng: random.Random, seqlen: int, chunk_size: int) -> list[int]:
    """Sorted document starts in (0, L): some random, some on chunk edges, some single-token docs."""
    starts = set()
    for _ in range(rng.randint(0, 4)):
        starts.add(rng.randrange(1, seqlen) if seqlen > 1 else 0)
    if rng.random() < 0.6:  # boundaries exactly on chunk edges
        starts.update(range(chunk_size, seqlen, chunk_size * rng.randint(1, 2)))
    if rng.random() < 0.5 and seqlen > 3:  # a single-token document
        t = rng.randrange(1, seqlen - 1)
        starts.update({t, t + 1})
    return sorted(s for s in starts if 0 < s < seqlen)


def make_case(seed: int, batch: int | None = None):
    """Random inputs (requires_grad) and scan options for one test case."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = batch or rng.randint(1, 3)
    seqlen = rng.randint(1, 40)
    ngroups = rng.choice([1, 2])
    nheads = ngroups * rng.choice([1, 2, 3])  # G == H and G < H
    headdim, dstate = rng.randint(1, 4), rng.randint(1, 5)
    chunk_size = rng.choice([1, 2, 3, 4, 5, 8, 16, 64])

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=F64)).requires_grad_()

    tensors = dict(
        x=randn(batch, seqlen, nheads, headdim),
        dt=(torch.rand(batch, seqlen, nheads, generator=gen, dtype=F64) * 0.8).requires_grad_(),
        A=(-torch.rand(nheads, generator=gen, dtype=F64) * 1.5 - 0.05).requires_grad_(),
        B=randn(batch, seqlen, ngroups, dstate),
        C=randn(batch, seqlen, ngroups, dstate),
    )
    options = dict(chunk_size=chunk_size)
    if rng.random() < 0.7:
        tensors["D"] = randn(nheads) if rng.random() < 0.5 else randn(nheads, headdim)
    if rng.random() < 0.5:
        tensors["dt_bias"] = randn(nheads, scale=0.5)
        options["dt_softplus"] = True
    elif rng.random() < 0.3:
        options["dt_softplus"] = True
    if rng.random() < 0.3:
        options["dt_limit"] = (0.05, 0.6)
    if rng.random() < 0.6:
        tensors["initial_states"] = randn(batch, nheads, headdim, dstate)
    seq_idx = torch.zeros(batch, seqlen, dtype=torch.int32)
    for row in range(batch):
        for start in random_boundaries(rng, seqlen, chunk_size):
            seq_idx[row, start:] += rng.randint(1, 2)
    if rng.random() < 0.85:
        options["seq_idx"] = seq_idx
    return tensors, options


def run_both(tensors, options):
    """(chunked outputs, reference outputs, chunked grads, reference grads) for one case."""
    results = []
    for fn in (ssd_scan, ssd_scan_reference):
        outputs = fn(**tensors, **options)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        gen = torch.Generator().manual_seed(1234)
        weights = [torch.randn(o.shape, generator=gen, dtype=F64) for o in outputs]
        loss = sum((o * w).sum() for o, w in zip(outputs, weights))
        grads = torch.autograd.grad(loss, list(tensors.values()))
        results.append((outputs, grads))
    (out, grads), (out_ref, grads_ref) = results
    return out, out_ref, grads, grads_ref


def check_case(tensors, options):
    out, out_ref, grads, grads_ref = run_both(tensors, options)
    for i, (a, b) in enumerate(zip(out, out_ref)):
        assert_close(a, b, f"output {i}")
    for name, a, b in zip(tensors, grads, grads_ref):
        assert_close(a, b, f"grad {name}")


@pytest.mark.parametrize("seed", range(30))
def test_matches_reference_random(seed):
    tensors, options = make_case(seed)
    options["return_final_states"] = True
    check_case(tensors, options)


def test_matches_reference_all_features_at_once():
    """G < H, L % Q != 0, boundaries on chunk edges (8, 16) and inside (21), a single-token
    document (16), ids not starting at 0, initial states, softplus + dt_bias, dt_limit, D [H, P]."""
    gen = torch.Generator().manual_seed(42)
    batch, seqlen, nheads, headdim, ngroups, dstate = 2, 37, 4, 3, 2, 5

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).requires_grad_()

    tensors = dict(
        x=randn(batch, seqlen, nheads, headdim), dt=randn(batch, seqlen, nheads),
        A=(-torch.rand(nheads, generator=gen, dtype=F64) - 0.1).requires_grad_(),
        B=randn(batch, seqlen, ngroups, dstate), C=randn(batch, seqlen, ngroups, dstate),
        D=randn(nheads, headdim), dt_bias=randn(nheads), initial_states=randn(batch, nheads, headdim, dstate),
    )
    seq_idx = torch.full((batch, seqlen), 3, dtype=torch.int32)
    for start in (8, 16, 17, 21):
        seq_idx[0, start:] += 1
    seq_idx[1, 30:] = 9
    options = dict(chunk_size=8, seq_idx=seq_idx, dt_softplus=True, dt_limit=(0.1, 1.5), return_final_states=True)
    check_case(tensors, options)


@pytest.mark.parametrize("seed", range(200, 206))
def test_matches_reference_one_chunk_per_slice(seed, monkeypatch):
    """The diagonal blocks run slice by slice over chunks; force one chunk per slice."""
    monkeypatch.setattr(ssd, "DIAGONAL_SLICE_BYTES", 1)
    monkeypatch.setattr(ssd, "HOST_DIAGONAL_SLICE_BYTES", 1)
    tensors, options = make_case(seed)
    options.update(chunk_size=max(2, options["chunk_size"] // 4), return_final_states=True)
    check_case(tensors, options)


def test_slices_are_small_on_a_cpu_and_large_on_an_accelerator():
    """A CPU dispatches an op in microseconds and keeps small slices in cache; on a GPU every op of a
    slice is a kernel launch the host pays for, so the slices there are 16 times larger."""
    assert ssd.slice_budget("cpu") == 16 << 20
    assert ssd.slice_budget("cuda") == ssd.DIAGONAL_SLICE_BYTES == 256 << 20


@pytest.mark.parametrize("seed", range(100, 115))
def test_varlen_states_match_reference(seed):
    tensors, options = make_case(seed, batch=1)
    seqlen = tensors["x"].shape[1]
    rng = random.Random(seed)
    starts = random_boundaries(rng, seqlen, options["chunk_size"])
    if rng.random() < 0.4 and starts:  # an empty sequence
        starts = sorted(starts + [rng.choice(starts)])
    cu_seqlens = torch.tensor([0, *starts, seqlen], dtype=torch.int32)
    options.update(cu_seqlens=cu_seqlens, return_varlen_states=True, return_final_states=seed % 2 == 0)
    if rng.random() < 0.5:  # documents from cu_seqlens alone
        options.pop("seq_idx", None)
    else:
        options["seq_idx"] = torch.searchsorted(cu_seqlens[1:], torch.arange(seqlen), right=True).int()[None]
    check_case(tensors, options)
    out = ssd_scan(**tensors, **options)
    varlen = out[-1]
    assert varlen.shape == (len(cu_seqlens) - 1, *tensors["x"].shape[2:], tensors["B"].shape[-1])
    if options["return_final_states"] and cu_seqlens[-1] > cu_seqlens[-2]:
        assert_close(varlen[-1], out[1][0], "last varlen state == final state")


def test_packed_row_equals_documents_alone():
    """Each document of a packed row, run alone, gives the same outputs and varlen state."""
    tensors, _ = make_case(7, batch=1)
    gen = torch.Generator().manual_seed(0)
    seqlen = 29
    tensors = {k: v.detach() for k, v in tensors.items()}
    nheads, headdim = tensors["A"].shape[0], 3
    ngroups, dstate = 1, 4
    tensors.update(
        x=torch.randn(1, seqlen, nheads, headdim, generator=gen, dtype=F64),
        dt=torch.rand(1, seqlen, nheads, generator=gen, dtype=F64),
        B=torch.randn(1, seqlen, ngroups, dstate, generator=gen, dtype=F64),
        C=torch.randn(1, seqlen, ngroups, dstate, generator=gen, dtype=F64),
        initial_states=torch.randn(1, nheads, headdim, dstate, generator=gen, dtype=F64),
        D=torch.randn(nheads, generator=gen, dtype=F64),
    )
    tensors.pop("dt_bias", None)
    cu_seqlens = torch.tensor([0, 8, 9, 16, 29], dtype=torch.int32)
    y, final, varlen = ssd_scan(**tensors, chunk_size=8, cu_seqlens=cu_seqlens, return_final_states=True, return_varlen_states=True)
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        doc = {k: (v[:, start:end] if v.dim() >= 3 and v.shape[1] == seqlen else v) for k, v in tensors.items()}
        if i > 0:  # initial states belong to the first document only
            doc.pop("initial_states")
        y_doc, final_doc = ssd_scan(**doc, chunk_size=8, return_final_states=True)
        assert_close(y[:, start:end], y_doc, f"doc {i} output")
        assert_close(varlen[i], final_doc[0], f"doc {i} state")
    assert_close(final[0], varlen[-1], "final state")


def test_chunk_size_and_padding_do_not_change_results():
    tensors, options = make_case(3, batch=2)
    tensors = {k: v.detach() for k, v in tensors.items()}
    options["return_final_states"] = True
    base = ssd_scan(**tensors, **{**options, "chunk_size": 1})
    for chunk_size in (2, 7, 16, 128):
        other = ssd_scan(**tensors, **{**options, "chunk_size": chunk_size})
        for a, b in zip(other, base):
            assert_close(a, b, f"chunk {chunk_size}")


def test_strong_decay_is_stable_and_matches_reference():
    """Decays that underflow to exactly zero inside a chunk give finite values and gradients."""
    gen = torch.Generator().manual_seed(5)
    batch, seqlen, nheads, headdim, dstate = 1, 48, 2, 2, 3
    tensors = dict(
        x=torch.randn(batch, seqlen, nheads, headdim, generator=gen, dtype=F64).requires_grad_(),
        dt=(torch.rand(batch, seqlen, nheads, generator=gen, dtype=F64) * 40).requires_grad_(),
        A=torch.tensor([-30.0, -1e-3], dtype=F64).requires_grad_(),
        B=torch.randn(batch, seqlen, 1, dstate, generator=gen, dtype=F64).requires_grad_(),
        C=torch.randn(batch, seqlen, 1, dstate, generator=gen, dtype=F64).requires_grad_(),
        dt_bias=torch.tensor([5.0, 0.0], dtype=F64).requires_grad_(),
    )
    check_case(tensors, dict(chunk_size=16, dt_softplus=True, return_final_states=True))


def test_dtypes():
    """float32 stays float32; bfloat16 inputs compute in float32 and return y in bfloat16."""
    tensors, options = make_case(11, batch=1)
    for dtype in (torch.float32, torch.bfloat16):
        cast = {k: v.detach().to(dtype) for k, v in tensors.items()}
        y, final = ssd_scan(**cast, **options, return_final_states=True)
        y_ref, final_ref = ssd_scan_reference(**cast, **options, return_final_states=True)
        assert y.dtype == dtype and final.dtype == torch.float32
        assert_close(y.double(), y_ref.double(), "y", rtol=1e-5 if dtype == torch.float32 else 2e-2)
        assert_close(final.double(), final_ref.double(), "final", rtol=1e-5)


def small_inputs(batch=1, seqlen=6, nheads=4, headdim=2, ngroups=2, dstate=3):
    return dict(
        x=torch.randn(batch, seqlen, nheads, headdim),
        dt=torch.rand(batch, seqlen, nheads),
        A=-torch.rand(nheads),
        B=torch.randn(batch, seqlen, ngroups, dstate),
        C=torch.randn(batch, seqlen, ngroups, dstate),
        chunk_size=4,
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(x=torch.randn(1, 6, 4)), r"x has shape \(1, 6, 4\).*\[B, L, H, P\]"),
        (dict(x=torch.randn(1, 0, 4, 2)), r"at least 1 token"),
        (dict(dt=torch.rand(1, 6, 3)), r"dt has shape \(1, 6, 3\).*\[B, L, H\]"),
        (dict(A=torch.rand(3)), r"A has shape \(3,\).*\[H\]"),
        (dict(B=torch.randn(1, 5, 2, 3)), r"B has shape \(1, 5, 2, 3\).*match x"),
        (dict(C=torch.randn(1, 6, 2, 4)), r"C has shape \(1, 6, 2, 4\).*shape of B"),
        (dict(B=torch.randn(1, 6, 3, 3), C=torch.randn(1, 6, 3, 3)), r"4 heads are not divisible by 3 groups"),
        (dict(D=torch.randn(4, 3)), r"D has shape \(4, 3\).*\[H\] or \[H, P\]"),
        (dict(dt_bias=torch.randn(2)), r"dt_bias has shape \(2,\).*\[H\]"),
        (dict(initial_states=torch.randn(1, 4, 2, 4)), r"initial_states has shape \(1, 4, 2, 4\).*\[B, H, P, N\]"),
        (dict(chunk_size=0), r"chunk_size is 0; expected a positive int"),
        (dict(dt_limit=(1.0, 0.5)), r"dt_limit is \(1.0, 0.5\)"),
        (dict(seq_idx=torch.zeros(1, 5, dtype=torch.int32)), r"seq_idx has shape \(1, 5\)"),
        (dict(seq_idx=torch.tensor([[0, 0, 1, 1, 0, 2]], dtype=torch.int32)), r"seq_idx decreases along L"),
        (dict(return_varlen_states=True), r"return_varlen_states=True needs cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32)), r"cu_seqlens \[0, 3, 5\] must .* end at L = 6"),
        (dict(cu_seqlens=torch.tensor([0, 4, 3, 6], dtype=torch.int32)), r"non-decreasing"),
        (dict(cu_seqlens=torch.tensor([[0, 6]], dtype=torch.int32)), r"cu_seqlens has shape \(1, 2\)"),
    ],
)
@pytest.mark.parametrize("fn", [ssd_scan, ssd_scan_reference])
def test_bad_input_raises(fn, change, match):
    with pytest.raises(ValueError, match=match):
        fn(**{**small_inputs(), **change})


def test_growing_state_is_rejected():
    with pytest.raises(ValueError, match=r"decays exp\(dt \* A\) <= 1: A <= 0"):
        ssd_scan(**{**small_inputs(), "A": torch.ones(4)})


def test_cu_seqlens_with_batch_above_one_raises():
    inputs = small_inputs(batch=2)
    with pytest.raises(ValueError, match=r"cu_seqlens given with batch size 2.*use batch 1"):
        ssd_scan(**inputs, cu_seqlens=torch.tensor([0, 6], dtype=torch.int32), return_varlen_states=True)
