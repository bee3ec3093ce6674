"""The fused norms behind ``RMSNorm`` and Mamba2's ``GatedRMSNorm`` (``models/norm_kernels.py``).

On CPU the pure norms run, unchanged. Each fused path runs here through a stand-in: torch's own
``F.rms_norm`` (the op CUDA runs fused), and FLA's gated norm contract written out in float64 (group-major
``rstd``, the gate a strided view); a whole model on them equals the pure model in float64, loss and
every gradient, and keeps the same bytes for backward. FLA's own kernels, interpreted by triton,
are held to the pure norm in ``tests/models/mamba/test_fla_on_cpu.py``."""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models import norm_kernels
from hybridpar.models.blocks import gated_rms_norm
from hybridpar.models.hybrid import HybridConfig, HybridLM
from hybridpar.models.mamba.fused import use_mamba_kernel, use_stand_in
from hybridpar.models.norm_kernels import kernel_for, norm_kernel, register_gated_norm
from tests.op_outputs import OpOutputs, kept_for_backward


_CALLS: list[str] = []


def _contract_forward(x, weight, bias, eps, z=None, group_size=None, norm_before_gate=True, is_rms_norm=False):
    """FLA's ``layer_norm_fwd`` for Mamba2's norm in float64: ``(y in x's dtype, None, rstd [G*T])``
    (FLA's ``rstd`` is float32; float32 or wider here, so that a float64 model stays exact)."""
    _CALLS.append("forward")
    assert bias is None and z is not None and not norm_before_gate and is_rms_norm
    assert x.dim() == 2 and x.stride(-1) == 1 and z.stride(-1) == 1 and z.shape == x.shape
    rows, width = x.shape
    u = (x.double() * F.silu(z.double())).view(rows, width // group_size, group_size)
    rstd = torch.rsqrt(u.square().mean(-1) + eps)  # [T, G]
    y = (u * rstd[..., None]).view(rows, width) * weight.double()
    return y.to(x.dtype), None, rstd.T.reshape(-1).to(torch.promote_types(x.dtype, torch.float32))  # group-major


def _contract_backward(dy, x, weight, bias, eps, mean, rstd, z=None, group_size=None, norm_before_gate=True,
                       is_rms_norm=False):
    """FLA's ``layer_norm_bwd`` for Mamba2's norm (its kernel's formulas, from the saved ``rstd``)."""
    _CALLS.append("backward")
    assert bias is None and mean is None and dy.shape == x.shape and dy.stride(-1) == 1
    rows, width = x.shape
    groups = (rows, width // group_size, group_size)
    r = rstd.double().view(width // group_size, rows).T[..., None]  # [T, G, 1]
    sig = torch.sigmoid(z.double())
    u = (x.double() * z.double() * sig).view(groups)
    wdy = (weight.double() * dy.double()).view(groups)
    xhat = u * r
    du = ((wdy - xhat * (xhat * wdy).mean(-1, keepdim=True)) * r).view(rows, width)
    dweight = (dy.double() * xhat.view(rows, width)).sum(0)
    dz = du * x.double() * sig * (1 + z.double() * (1 - sig))
    return (du * z.double() * sig).to(x.dtype), dweight.to(weight.dtype), None, dz.to(z.dtype)


register_gated_norm("contract", _contract_forward, _contract_backward)
STAND_INS = {"rmsnorm": "torch", "gated_norm": "contract"}


def _model_run(model, ids, packed):
    with kept_for_backward() as kept:
        loss = model(ids, packed=packed, labels=ids)[0]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(kept.values())


@pytest.mark.parametrize("groups", [1, 2])
def test_a_model_on_the_fused_norms_equals_the_pure_model(groups):
    """Loss and every gradient in float64; the gated norm also keeps the bytes ours keeps (torch's
    ``_fused_rms_norm`` saves its input and ``rstd`` on CUDA, as ours; on CPU it is composite)."""
    torch.manual_seed(0)
    base = HybridLM(HybridConfig.from_preset("tiny", mamba_n_groups=groups, dtype=torch.float64))
    for p in base.parameters():
        if p.dim() == 1:
            p.data.normal_(1.0, 0.3)  # norms' weights away from one
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 19, 40, 64], dtype=torch.int32))
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    with OpOutputs() as pure:
        loss, grads, kept = _model_run(copy.deepcopy(base), ids, packed)
    mamba_layers = base.config.pattern.count("M")
    for families in (("gated_norm",), ("rmsnorm", "gated_norm")):
        _CALLS.clear()
        with contextlib.ExitStack() as stack, OpOutputs() as seen:
            for family in families:
                stack.enter_context(use_stand_in(STAND_INS[family], family=family))
            fused_loss, fused_grads, fused_kept = _model_run(copy.deepcopy(base), ids, packed)
        assert _CALLS == ["forward"] * mamba_layers + ["backward"] * mamba_layers
        torch.testing.assert_close(fused_loss, loss, rtol=1e-13, atol=0)
        assert fused_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(fused_grads[name], grad, rtol=1e-11, atol=1e-14, msg=name)
        if families == ("gated_norm",):
            assert fused_kept == kept
        else:  # F.rms_norm ran, not ours (ours takes one mean per norm, forward and backward)
            assert seen.ops.count("aten.mean.dim") < pure.ops.count("aten.mean.dim")


def test_the_fused_gated_norm_keeps_the_gate_as_a_view_and_returns_the_input_dtype():
    projection = torch.randn(2, 9, 40, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    gate = projection[..., 20:36]
    weight = torch.randn(16, dtype=torch.float64, requires_grad=True)
    with use_stand_in("contract", family="gated_norm"):
        with kept_for_backward() as kept:
            y = gated_rms_norm(x.float(), gate, weight, 8, 1e-5)
    assert y.dtype == torch.float32
    assert projection.untyped_storage().data_ptr() in kept  # the view's storage, no copy of the gate
    y.sum().backward()
    assert projection.grad[..., :20].abs().max() == 0 and projection.grad[..., 20:36].abs().max() > 0


@pytest.mark.parametrize("family, device, dtype, fla, expected", [
    ("rmsnorm", "cpu", torch.float32, True, ("pure", "device cpu")),
    ("rmsnorm", "cuda", torch.bfloat16, False, ("torch", "torch F.rms_norm")),
    ("rmsnorm", "cuda", torch.float64, True, ("pure", "dtype torch.float64 has no fused norm")),
    ("gated_norm", "cuda", torch.float32, True, ("fla", "fla-core 0.6.0 gated group RMSNorm")),
    ("gated_norm", "cuda", torch.bfloat16, False, ("pure", "fla-core is not installed")),
    ("gated_norm", "cpu", torch.float32, True, ("pure", "device cpu")),
])
def test_kernel_rules(family, device, dtype, fla, expected):
    status = (True, "fla-core 0.6.0 gated group RMSNorm") if fla else (False, "fla-core is not installed")
    assert kernel_for(family, device, dtype, fla_status=status) == expected
    assert kernel_for(family, device, dtype, mode="pure", fla_status=status) == ("pure", "use_mamba_kernel('pure')")


class _Subclass(torch.Tensor):
    pass


def test_inputs_the_fused_norms_cannot_take_keep_the_pure_norm(caplog, monkeypatch):
    """Tensor subclasses (DTensors under TP), mixed dtypes for torch's op and groups wider than FLA's
    row keep the pure norm, and each choice is logged once with its reason."""
    monkeypatch.setattr(norm_kernels, "_LOGGED", set())
    x, w = torch.randn(3, 8), torch.ones(8)
    with caplog.at_level(logging.INFO, logger="hybridpar.models.norm_kernels"):
        for _ in range(2):
            assert norm_kernel("rmsnorm", (x, w)) == "pure"
        with use_stand_in("torch", family="rmsnorm"):
            assert norm_kernel("rmsnorm", (x, w)) == "torch"
            assert norm_kernel("rmsnorm", (x.as_subclass(_Subclass), w)) == "pure"
            assert norm_kernel("rmsnorm", (x.bfloat16(), w)) == "pure"
            with use_mamba_kernel("pure"):
                assert norm_kernel("rmsnorm", (x, w)) == "pure"
        wide = torch.randn(2, 16385)  # 16385 float32 channels: 65540 bytes
        with use_stand_in("contract", family="gated_norm"):
            assert norm_kernel("gated_norm", (wide, wide, torch.ones(16385)), 16385) == "pure"
            assert norm_kernel("gated_norm", (wide.bfloat16(), wide, torch.ones(16385)), 16385) == "contract"
    lines = [r.getMessage() for r in caplog.records if r.name == "hybridpar.models.norm_kernels"]
    assert lines == [
        "norm kernel: pure for rmsnorm (device cpu; torch.float32 on cpu)",
        "norm kernel: torch for rmsnorm (stand-in 'torch' for the fused norm; torch.float32 on cpu)",
        "norm kernel: pure for rmsnorm (a _Subclass input; torch.float32 on cpu)",
        "norm kernel: pure for rmsnorm (input torch.bfloat16 and weight torch.float32: torch fuses one dtype only; "
        "torch.bfloat16 on cpu)",
        "norm kernel: pure for rmsnorm (use_mamba_kernel('pure'); torch.float32 on cpu)",
        "norm kernel: pure for gated_norm (a group of 16385 channels is wider than FLA's 65536-byte row; "
        "torch.float32 on cpu)",
        "norm kernel: contract for gated_norm (stand-in 'contract' for the fused norm; torch.bfloat16 on cpu)",
    ], lines
    with pytest.raises(ValueError, match="'fla' is taken"):
        register_gated_norm("fla", _contract_forward, _contract_backward)


def test_a_compiled_norm_is_the_pure_norm():
    """Inductor fuses the pure norm; the fused kernels stay out of the trace (no graph break)."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    x, gate, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    with use_stand_in("contract", family="gated_norm"):
        compiled = torch.compile(lambda a, b: gated_rms_norm(a, b, w, 8, 1e-5), backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(x, gate), gated_rms_norm(x, gate, w, 8, 1e-5).float(), rtol=1e-6, atol=1e-6)
    assert sum(counters["graph_break"].values()) == 0


def test_the_norm_cast_to_the_matmul_dtype_is_the_norm_then_the_cast(fresh_compiled_steps):
    """``rms_norm_to`` (compiled steps, ``aot_eager`` here, inductor on CUDA) in float64 to a float32 output:
    the output is ``F.rms_norm`` then the cast, and ``dx``, ``dweight`` its gradients to 1e-12."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 16, generator=gen, dtype=torch.float64)
    weight = torch.randn(16, generator=gen, dtype=torch.float64)
    grad = torch.randn(2, 9, 16, generator=gen, dtype=torch.float32)
    want_x, want_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    want = F.rms_norm(want_x, (16,), want_w, 1e-5)
    want.backward(grad.double())
    got_x, got_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    assert norm_kernels.rms_norm_to(got_x, got_w, 1e-5, torch.float32) is None  # CPU: the caller norms, casts
    with use_stand_in("torch", family="rmsnorm"), fresh_compiled_steps.compile_steps("aot_eager"):
        got = norm_kernels.rms_norm_to(got_x, got_w, 1e-5, torch.float32)
        got.backward(grad)
    assert got.dtype == torch.float32 and torch.equal(got, want.float())
    for g, w in ((got_x.grad, want_x.grad), (got_w.grad, want_w.grad)):
        assert g.dtype == torch.float64 and (g - w).abs().max() <= 1e-12 * w.abs().max()
    assert {name for name, _ in fresh_compiled_steps._COMPILED} == {
        "RMSNorm to the matmul dtype", "RMSNorm to the matmul dtype backward"}


def test_a_bf16_model_norms_straight_to_bf16_where_the_steps_compile(fresh_compiled_steps):
    """Under autocast a block's RMSNorm writes its bf16 output in its compiled step (no float32 output, no
    cast) wherever the fused norm would run: the tiny model's loss is the fused norm's bit for bit, its
    gradients within float32's rounding of the norm's backward carried through bf16 matmuls."""
    torch.manual_seed(0)
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize

    base = HybridLM(HybridConfig.from_preset("tiny"))
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 40, 104, 128], dtype=torch.int32))
    ids = torch.randint(0, 256, (1, 129), generator=torch.Generator().manual_seed(1))
    results = []
    for backend in (None, "aot_eager"):
        model = parallelize(copy.deepcopy(base), ParallelDims(), mixed_precision="bf16")
        with use_stand_in("torch", family="rmsnorm"), fresh_compiled_steps.compile_steps(backend):
            loss, count = model(ids[:, :-1], packed=packed, labels=ids[:, 1:])
            (loss / count).backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss, grads), (got_loss, got_grads) = results
    assert "RMSNorm to the matmul dtype" in {name for name, _ in fresh_compiled_steps._COMPILED}
    assert torch.equal(got_loss, loss)  # the forward: the same float32 math, rounded once to bf16
    worst = max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got_grads, grads))
    assert worst < 1e-2, worst  # 4e-3 measured: float32 rounding of the norm's backward, through bf16
