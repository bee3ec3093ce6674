"""RoPE with its gradient written out (``models/attention/rotary.py``): eager autograd's values and
gradients bit for bit (float64, float32, bf16), transformers' Llama rotation in float64 (whole and
partial rotary dims), a float64 gradcheck, bf16 within rounding, no concatenation in either
direction, the compiled form, and angles that would train refused."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hybridpar.models.attention.rotary import apply_rotary, rotary_cos_sin
from tests.op_outputs import OpOutputs

F64 = torch.float64


def _case(rotary_dim: int, head_dim: int = 16, dtype=F64):
    gen = torch.Generator().manual_seed(rotary_dim)
    x = torch.randn(2, 11, 3, head_dim, generator=gen, dtype=F64).to(dtype).requires_grad_()
    positions = torch.randint(0, 500, (2, 11), generator=gen)
    cos, sin = rotary_cos_sin(positions, rotary_dim, 10000.0, dtype)
    return x, cos, sin


def _transformers(x, cos, sin):
    """transformers' Llama rotation on the first ``r`` channels (its layout ``[B, H, S, D]``), the rest passed."""
    r = cos.shape[-1]
    rotated, _ = apply_rotary_pos_emb(x[..., :r].transpose(1, 2), x[..., :r].transpose(1, 2), cos, sin)
    return torch.cat([rotated.transpose(1, 2), x[..., r:]], dim=-1)


def _eager(x, cos, sin):
    """The autograd form this replaced: ``x * cos + rotate_half(x) * sin`` on the first ``r`` channels."""
    r, half = cos.shape[-1], cos.shape[-1] // 2
    x_rot, x_pass = x[..., :r], x[..., r:]
    rotated_half = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos[:, :, None, :] + rotated_half * sin[:, :, None, :], x_pass], dim=-1)


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [16, 6])
def test_values_and_gradient_are_eager_autograds_bit_for_bit(dtype, rotary_dim):
    """No fused multiply-add: a trained model's trajectory stays that of eager autograd."""
    x, cos, sin = _case(rotary_dim, dtype=dtype)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=F64).to(dtype)
    outs = []
    for fn in (apply_rotary, _eager):
        out = fn(x, cos, sin)
        outs.append((out, *torch.autograd.grad(out, x, grad)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("rotary_dim", [16, 8, 2])
def test_equals_transformers_rotation_and_its_gradient_in_float64(rotary_dim):
    x, cos, sin = _case(rotary_dim)
    grad = torch.randn(x.shape, dtype=F64, generator=torch.Generator().manual_seed(7))
    ours = apply_rotary(x, cos, sin)
    (dx,) = torch.autograd.grad(ours, x, grad)
    want = _transformers(x, cos, sin)
    (want_dx,) = torch.autograd.grad(want, x, grad)
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-14)
    torch.testing.assert_close(dx, want_dx, rtol=0, atol=1e-14)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin), (x,))


def test_bf16_within_rounding_of_float64():
    x, cos, sin = _case(16, dtype=torch.bfloat16)
    ours = apply_rotary(x, cos, sin)
    (dx,) = torch.autograd.grad(ours.float().sum(), x)
    exact = _transformers(x.double(), cos.double(), sin.double())
    (exact_dx,) = torch.autograd.grad(exact.sum(), x)  # x is bf16: its grad comes back bf16, summed in float64
    assert ours.dtype == dx.dtype == torch.bfloat16
    scale = x.detach().double().abs().max()
    assert float((ours.double() - exact).detach().abs().max()) <= 2 * 2.0**-8 * float(scale)
    assert float((dx.double() - exact_dx.double()).abs().max()) <= 2 * 2.0**-8 * 2


def test_no_concatenation_forward_or_backward():
    """Eager autograd of ``rotate_half`` concatenated twice forward (once with an empty pass-through)
    and sliced into zeros three times backward; here each direction is one output written in place."""
    x, cos, sin = _case(16)
    grad = torch.ones(x.shape, dtype=x.dtype)
    with OpOutputs() as seen:
        apply_rotary(x, cos, sin).backward(grad)
    names = [name for name in seen.ops if "detach" not in name]
    assert not [n for n in names if "cat" in n or "slice_backward" in n], names
    full = [name for name, shape in seen.shapes if shape == tuple(x.shape) and "detach" not in name]
    assert full == ["aten.empty.memory_format"] * 2, full  # one output each way, written half by half


def test_angles_that_would_train_are_refused():
    x, cos, sin = _case(16)
    with pytest.raises(ValueError, match="cos and sin as constants"):
        apply_rotary(x, cos.requires_grad_(), sin)


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_compiled_equals_eager_without_graph_breaks(rotary_dim):
    """Under ``torch.compile`` the plain form runs (dynamo takes no strided ``out=``): one graph, the same
    values and gradient in float64."""
    x, cos, sin = _case(rotary_dim)
    grad = torch.randn(x.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(apply_rotary, backend="aot_eager", fullgraph=True)  # a graph break raises
    for fn, name in ((apply_rotary, "eager"), (compiled, "compiled")):
        out = fn(x, cos, sin)
        (dx,) = torch.autograd.grad(out, x, grad)
        if name == "eager":
            want, want_dx = out, dx
    torch.testing.assert_close(out, want, rtol=0, atol=1e-14)
    torch.testing.assert_close(dx, want_dx, rtol=0, atol=1e-14)
