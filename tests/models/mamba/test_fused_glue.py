"""The fused Mamba op's elementwise steps around its scan (``models/mamba/fused_glue.py``): each
product computed wide and rounded once, the eager forms' values where those round once too, and the
op's backward on bf16 activations without a wide copy or a concatenation of a ``[T, H, P]`` tensor.
The op's gradients against the pure core in float64: ``test_fused.py``, ``test_fla_on_cpu.py``."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpar.models.cuda_compile import compile_steps
from hybridpar.models.mamba.core import row_documents
from hybridpar.models.mamba.fused_glue import add_skip, grad_D, grad_dt, grad_x_into, scan_values
from hybridpar.models.mamba.fused_op import fused_conv_scan
from tests.models.mamba.test_core import make_case
from hybridpar.models.mamba.fused_op import register_scan
from tests.models.mamba.test_fused import simple_gla_contract

BF16 = torch.bfloat16
T, H, P = 64, 4, 16


def _tensors(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    narrow = lambda: (10 * torch.randn(1, T, H, P, generator=gen)).to(BF16)  # noqa: E731
    return narrow(), narrow(), narrow(), torch.rand(T, H, generator=gen) + 0.01, torch.randn(H, generator=gen)


def test_forward_steps_equal_the_eager_forms_bitwise():
    """``v`` and ``y`` round once in the eager forms too: the same bits, without their wide copies."""
    x, o, _, dt, D = _tensors()
    assert torch.equal(scan_values(x, dt), (x * dt[None, :, :, None]).to(BF16))
    assert torch.equal(add_skip(o, x, D), torch.addcmul(o, x, D[:, None]).to(BF16))


def test_grad_x_is_the_exact_sum_rounded_once():
    """``dx = dy D + dv dt`` within half a bf16 step of its float64 value (autograd rounded each term
    and the sum: up to a step and a half), written into a strided view."""
    x, dy, dv, dt, D = _tensors(1)
    exact = dy.double() * D.double()[:, None] + dv.double() * dt.double()[None, :, :, None]
    buffer = torch.zeros(T, H * P + 8, dtype=BF16)  # x's columns of a wider gradient, as in the op
    out = buffer[:, :H * P].view(1, T, H, P)
    grad_x_into(out, dv, dt, dy, D)
    assert out.data_ptr() == buffer.data_ptr() and bool((buffer[:, H * P:] == 0).all())
    half_step = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 9)  # bf16: 8 significant bits
    terms = dy.double().abs() * D.double().abs()[:, None] + dv.double().abs() * dt.double()[None, :, :, None]
    error = (out.double() - exact).abs()
    assert bool((error <= half_step + terms * 2.0**-22).all()), float((error / half_step).max())
    grad_x_into(out, dv, dt, None, D)
    assert torch.equal(out, (dv * dt[None, :, :, None]).to(BF16))


def test_reductions_multiply_in_float32():
    """``d dt`` and ``dD``: products and sums in float32, equal to the eager float32 forms."""
    x, dy, dv, _, D = _tensors(2)
    assert torch.equal(grad_dt(dv, x), (dv.float() * x.float()).sum(-1)[0])
    assert torch.equal(grad_D(dy, x, D), (dy.float() * x.float()).sum(dim=(0, 1, 3)))


class _Ops(TorchDispatchMode):
    """The aten ops that run, our custom ops opened (their Python bodies run under the mode), the
    stand-in scan's own ops not counted (FLA's kernels on a GPU)."""

    def __init__(self):
        super().__init__()
        self.calls, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        if func._schema.name.startswith("hybridpar::"):
            with self:
                return torch._library.custom_ops._maybe_get_opdef(func)._init_fn(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        self.calls.append((func._schema.name.split("::")[-1], torch.utils._pytree.tree_leaves((args, kwargs))))
        return out


OPS = _Ops()


class _OpaqueScan(torch.autograd.Function):
    """The contract scan as one opaque step, forward and backward (its float32 copies are its own)."""

    @staticmethod
    def forward(ctx, q, k, v, g, cu_seqlens):
        ctx.save_for_backward(q, k, v, g)
        ctx.cu_seqlens = cu_seqlens
        OPS.paused = True
        try:
            return simple_gla_contract(q, k, v, g, scale=1.0, cu_seqlens=ctx.cu_seqlens, state_v_first=True)[0]
        finally:
            OPS.paused = False

    @staticmethod
    def backward(ctx, grad_o):
        OPS.paused = True
        try:
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]
                o = simple_gla_contract(*leaves, scale=1.0, cu_seqlens=ctx.cu_seqlens, state_v_first=True)[0]
                return (*torch.autograd.grad(o, leaves, grad_o), None)
        finally:
            OPS.paused = False


def _opaque_scan(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, state_v_first):
    assert initial_state is None and not output_final_state
    return _OpaqueScan.apply(q, k, v, g, cu_seqlens), None


register_scan("opaque", _opaque_scan)


def test_backward_on_bf16_makes_no_wide_copy_and_no_concatenation_of_the_heads_tensors():
    """At bf16 the op's backward (the contract scan standing in for FLA's) widens nothing of ``[T, H, P]``
    size (``_to_copy``) and concatenates nothing: x's, B's and C's gradients are written into their
    columns of the conv output's gradient. (Autograd's version made 7 such copies and 2 concatenations
    per call; ``benchmarks/step_traffic.py`` counts the bytes.)"""
    inputs, cu, sizes = make_case(21, 2)
    inputs = {k: (v.detach().to(BF16) if k in ("xBC", "dt") else v.detach().float()).requires_grad_()
              for k, v in inputs.items()}
    batch, seqlen = inputs["dt"].shape[:2]
    y = fused_conv_scan(*inputs.values(), head_dim=sizes["head_dim"], state_size=sizes["state_size"],
                        cu_docs=row_documents(cu, batch, seqlen, "cpu"), scan="opaque")
    big = y.numel()  # [T, H, P]
    loss = y.float().sum()
    ops = OPS
    with ops:
        loss.backward()
    assert "fused_conv_scan_backward" not in [name for name, _ in ops.calls]  # opened
    names = [name for name, _ in ops.calls]
    wide = [tuple(t.shape) for name, tensors in ops.calls if name == "_to_copy"
            for t in tensors if isinstance(t, torch.Tensor) and t.dtype == BF16 and t.numel() == big]
    assert names.count("fused_conv_scan_backward") == 0 and "addcmul" in names
    assert "cat" not in names and not wide, (names.count("cat"), wide)
    assert all(inputs[name].grad is not None for name in inputs)


@pytest.mark.parametrize("seed", [21, 24])
@pytest.mark.parametrize("dtype", [torch.float64, BF16])
def test_compiled_scan_gradients_equal_the_eager_ones(fresh_compiled_steps, seed, dtype):
    """The gradients after the scan's as one compiled step (``scan_gradients``; ``aot_eager`` here, inductor
    on CUDA) against the eager step: every input's gradient of the op, float64 to 1e-12, bf16 within one
    rounding (the same products in float32, rounded once; their sum may fuse differently)."""
    inputs, cu, sizes = make_case(seed, 2)
    narrow = ("xBC", "dt") if dtype == BF16 else ()
    batch, seqlen = inputs["dt"].shape[:2]
    width = sizes["head_dim"] * inputs["dt"].shape[-1]
    weights = torch.randn(batch, seqlen, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def gradients():
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        leaves = {k: v.detach().to(BF16 if k in narrow else wide).requires_grad_() for k, v in inputs.items()}
        y = fused_conv_scan(*leaves.values(), head_dim=sizes["head_dim"], state_size=sizes["state_size"],
                            cu_docs=row_documents(cu, batch, seqlen, "cpu"), scan="opaque")
        (y.double() * weights).sum().backward()
        return {k: v.grad.double() for k, v in leaves.items()}

    eager = gradients()
    with compile_steps("aot_eager"):
        compiled = gradients()
    assert ("Mamba scan gradients", "aot_eager") in fresh_compiled_steps._COMPILED and not fresh_compiled_steps._FAILED
    tolerance = 1e-12 if dtype == torch.float64 else 2.0**-7
    for name, want in eager.items():
        error = float((compiled[name] - want).abs().max() / want.abs().max())
        assert error <= tolerance, (name, error)
