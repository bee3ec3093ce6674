"""The conv kernels of ``conv.py`` against the token-by-token reference and torch's Conv1d, float64.

``conv_forward`` and the hand-written ``conv_backward`` are checked against autograd through
``causal_conv1d_reference`` (tests/models/mamba/reference.py): documents of every length
including one token, rows back to back, histories entering a row's first document.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridpar.models.mamba.conv import conv_backward, conv_forward
from hybridpar.models.mamba.core import row_documents
from tests.models.mamba.reference import causal_conv1d_reference

F64 = torch.float64


def assert_close(actual, expected, name=""):
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    if expected.numel() == 0:
        return
    scale = expected.abs().max().clamp(min=1e-3)
    err = (actual - expected).abs().max()
    assert err <= 1e-10 * scale, f"{name}: max error {err:.3e} > 1e-10 * {scale:.3e}"


def make_case(seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch, seqlen, channels, width = rng.randint(1, 3), rng.randint(1, 20), rng.randint(1, 6), rng.randint(1, 5)
    x = torch.randn(batch, seqlen, channels, generator=gen, dtype=F64, requires_grad=True)
    weight = torch.randn(channels, width, generator=gen, dtype=F64, requires_grad=True)
    bias = torch.randn(channels, generator=gen, dtype=F64, requires_grad=True) if rng.random() < 0.7 else None
    history = torch.randn(batch, width - 1, channels, generator=gen, dtype=F64, requires_grad=True) if rng.random() < 0.6 else None
    starts = sorted({rng.randrange(1, seqlen) for _ in range(rng.randint(0, 4))} if seqlen > 1 else set())
    cu = torch.tensor([0, *starts, seqlen])  # the same documents in every row
    return x, weight, bias, history, cu


@pytest.mark.parametrize("seed", range(25))
def test_matches_reference_with_gradients(seed):
    x, weight, bias, history, cu = make_case(seed)
    batch, seqlen, channels = x.shape
    seq_idx = torch.searchsorted(cu[1:], torch.arange(seqlen), right=True)[None].expand(batch, -1)
    initial = None if history is None else history.transpose(1, 2)
    expected = causal_conv1d_reference(x, weight, bias, seq_idx=seq_idx, initial_states=initial)
    leaves = [t for t in (x, weight, bias, history) if t is not None]
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    want = torch.autograd.grad((expected * grad_out).sum(), leaves, materialize_grads=True)

    cu_docs = row_documents(cu, batch, seqlen, "cpu")
    init_at = None if history is None else torch.arange(batch) * seqlen
    flat = x.detach().reshape(-1, channels)
    detach = lambda t: None if t is None else t.detach()  # noqa: E731
    pre = conv_forward(flat, weight.detach(), detach(bias), cu_docs, init_at, detach(history))
    assert_close(pre.view(expected.shape), expected.detach(), "output")
    dx, dweight, dbias, dhistory = conv_backward(flat, weight.detach(), bias is not None, cu_docs, init_at,
                                                 detach(history), grad_out.reshape(-1, channels))
    got = [dx.view(x.shape), dweight] + ([dbias] if bias is not None else []) + ([dhistory] if history is not None else [])
    for name, a, b in zip(("x", "weight", "bias" if bias is not None else "history", "history"), got, want):
        assert_close(a, b, f"grad {name}")


def test_orientation_matches_torch_conv1d():
    """Tap j multiplies x_{t-(K-1)+j}, as nn.Conv1d(padding=K-1) does, so HF weights load squeezed."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, 5, generator=gen, dtype=F64)
    conv = torch.nn.Conv1d(5, 5, kernel_size=4, groups=5, padding=3, dtype=F64)
    expected = conv(x.transpose(1, 2))[..., :11].transpose(1, 2).detach()
    pre = conv_forward(x.reshape(-1, 5), conv.weight[:, 0].detach(), conv.bias.detach(), row_documents(None, 2, 11, "cpu"))
    assert_close(pre.view(2, 11, 5), expected, "conv1d")
