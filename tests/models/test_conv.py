"""causal_conv1d against its token-by-token reference and torch's Conv1d, float64."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from hybridpar.models.conv import causal_conv1d, causal_conv1d_reference

F64 = torch.float64


def assert_close(actual, expected, name="", rtol=1e-10):
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    if expected.numel() == 0:
        return
    scale = expected.abs().max().clamp(min=1e-30)
    err = (actual - expected).abs().max()
    assert err <= rtol * scale, f"{name}: max error {err:.3e} > {rtol:g} * {scale:.3e}"


def make_case(seed: int, batch: int | None = None):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = batch or rng.randint(1, 3)
    seqlen, channels, width = rng.randint(1, 20), rng.randint(1, 6), rng.randint(1, 5)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).requires_grad_()

    tensors = dict(x=randn(batch, seqlen, channels), weight=randn(channels, width))
    options = dict(activation=rng.choice([None, "silu", "swish"]))
    if rng.random() < 0.7:
        tensors["bias"] = randn(channels)
    if rng.random() < 0.6:
        tensors["initial_states"] = randn(batch, channels, width - 1)
    if rng.random() < 0.8:
        seq_idx = torch.zeros(batch, seqlen, dtype=torch.int32)
        for row in range(batch):
            for _ in range(rng.randint(0, 4)):
                seq_idx[row, rng.randrange(seqlen):] += 1  # includes single-token documents
        options["seq_idx"] = seq_idx
    return tensors, options


@pytest.mark.parametrize("seed", range(25))
def test_matches_reference_with_gradients(seed):
    tensors, options = make_case(seed)
    results = []
    for fn in (causal_conv1d, causal_conv1d_reference):
        out = fn(**tensors, **options)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
        grads = torch.autograd.grad((out * weight).sum(), list(tensors.values()), materialize_grads=True)
        results.append((out, grads))
    (out, grads), (out_ref, grads_ref) = results
    assert_close(out, out_ref, "output")
    for name, a, b in zip(tensors, grads, grads_ref):
        assert_close(a, b, f"grad {name}")


def test_orientation_matches_torch_conv1d():
    """Tap j multiplies x_{t-(K-1)+j}, as nn.Conv1d(padding=K-1) does, so HF weights load squeezed."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, 5, generator=gen, dtype=F64)
    conv = torch.nn.Conv1d(5, 5, kernel_size=4, groups=5, padding=3, dtype=F64)
    expected = conv(x.transpose(1, 2))[..., :11].transpose(1, 2)
    seq_idx = torch.zeros(2, 11, dtype=torch.int32)
    for fn in (causal_conv1d, causal_conv1d_reference):
        for kwargs in ({}, {"seq_idx": seq_idx}):
            assert_close(fn(x, conv.weight[:, 0], conv.bias, **kwargs), expected.detach(), fn.__name__)


def test_initial_states_continue_a_split_sequence():
    """Running the halves with the first half's last K-1 inputs as history equals one run."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 13, 3, generator=gen, dtype=F64)
    weight, bias = torch.randn(3, 4, generator=gen, dtype=F64), torch.randn(3, generator=gen, dtype=F64)
    full = causal_conv1d(x, weight, bias, activation="silu")
    head = causal_conv1d(x[:, :6], weight, bias, activation="silu")
    tail = causal_conv1d(x[:, 6:], weight, bias, initial_states=x[:, 3:6].transpose(1, 2), activation="silu")
    assert_close(torch.cat([head, tail], dim=1), full, "split")


def test_packed_row_equals_documents_alone():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 17, 4, generator=gen, dtype=F64)
    weight, bias = torch.randn(4, 4, generator=gen, dtype=F64), torch.randn(4, generator=gen, dtype=F64)
    history = torch.randn(1, 4, 3, generator=gen, dtype=F64)
    cu_seqlens = [0, 5, 6, 8, 17]
    seq_idx = torch.searchsorted(torch.tensor(cu_seqlens[1:]), torch.arange(17), right=True).int()[None]
    packed = causal_conv1d(x, weight, bias, seq_idx=seq_idx, initial_states=history, activation="silu")
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        alone = causal_conv1d(x[:, start:end], weight, bias, initial_states=history if i == 0 else None, activation="silu")
        assert_close(packed[:, start:end], alone, f"doc {i}")


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(x=torch.randn(2, 5)), r"x has shape \(2, 5\).*\[B, L, C\]"),
        (dict(weight=torch.randn(4, 1, 3)), r"weight has shape \(4, 1, 3\).*squeeze"),
        (dict(weight=torch.randn(3, 3)), r"weight has shape \(3, 3\).*\[C, K\] = \[4, K\]"),
        (dict(bias=torch.randn(3)), r"bias has shape \(3,\); expected \[C\] = \[4\]"),
        (dict(seq_idx=torch.zeros(1, 6, dtype=torch.int32)), r"seq_idx has shape \(1, 6\)"),
        (dict(seq_idx=torch.zeros(1, 5)), r"seq_idx .* dtype torch.float32; expected integer"),
        (dict(initial_states=torch.randn(1, 4, 3)), r"initial_states has shape \(1, 4, 3\).*\[1, 4, 2\]"),
        (dict(activation="relu"), r"activation is 'relu'"),
    ],
)
@pytest.mark.parametrize("fn", [causal_conv1d, causal_conv1d_reference])
def test_bad_input_raises(fn, change, match):
    inputs = dict(x=torch.randn(1, 5, 4), weight=torch.randn(4, 3))
    with pytest.raises(ValueError, match=match):
        fn(**{**inputs, **change})
