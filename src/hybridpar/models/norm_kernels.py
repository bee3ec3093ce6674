"""Fused RMSNorm kernels on CUDA behind the norms of ``blocks.py``; the pure norms everywhere else.

Eager on a GPU a pure-PyTorch norm is a dozen elementwise kernels in float32, each a trip through
memory: for the ``1b`` preset at 8K tokens a Mamba mixer's gated norm moves ~9 GB a step, forward and
backward, and a block's RMSNorm ~2 GB (``benchmarks/norm_traffic.py``), where one fused kernel each
way reads the inputs and writes the outputs once (~0.5 and ~0.3 GB). Two maintained kernels do the math of
``blocks._RMSNormFunction`` (statistics in float32; ``rstd = (mean(u^2) + eps)^-1/2``, ``y = w u rstd``):

- ``RMSNorm`` -> torch's ``F.rms_norm`` (``"torch"``: ``aten::_fused_rms_norm`` and its backward,
  one kernel each on CUDA, where input and weight share a dtype: float32 under autocast, bf16 under
  FSDP's policy; torch falls back to its composite otherwise). It saves the input and ``rstd``, as ours.
  Under autocast a ``blocks.RMSNorm``'s output is cast to bf16 for the matmuls that read it; on CUDA
  ``rms_norm_to`` makes the norm and the cast one compiled step each way (``cuda_compile``), which
  writes the bf16 output directly and saves the same tensors.
- ``GatedRMSNorm`` (Mamba2's ``rmsnorm(y * silu(z))`` per group) -> FLA's gated group norm
  (``"fla"``: ``fla.modules.norm.layernorm_gated.layer_norm_fwd/bwd``, mamba_ssm's kernels with the
  norm after the gate) when ``fla-core`` imports. ``_FusedGatedNorm`` calls them and saves what ours
  saves (``x``, the gate as the ``in_proj`` view it is, ``weight``, ``rstd [G*T]``), so a block's saved
  bytes and the planner do not depend on the kernel. Its output is in ``x``'s dtype (bf16 under
  autocast: rounded once; ours is float32 and autocast rounds it at ``out_proj``).

Past float32's squares (a group of values beyond ~1.8e19) ours and ``rms_norm_to`` give NaN where the
mean of squares overflows (``overflow_is_nan``: the guard sees the run diverge); torch's fused
kernel and FLA's give 0 there, a finite output, as ``rsqrt(inf)`` does.

``norm_kernel`` says which runs, logged once per family, kernel and reason (``norm kernel: fla
(...)``): the pure norm on CPU (the exact reference, unchanged), for float64, for DTensors (TP) and
other tensor subclasses, for a group that spans TP ranks, for groups wider than FLA's 64 KiB row, for
an RMSNorm whose input and weight dtypes differ, and under
``torch.compile`` (inductor fuses the pure norm into a kernel or two itself); under
``use_mamba_kernel("pure")`` (one switch for every fused kernel). Tests run either fused path on
CPU: ``fused.use_stand_in("torch", family="rmsnorm")`` (torch's op runs on any device) and
``use_stand_in(name, family="gated_norm")`` with kernels registered by ``register_gated_norm``
(FLA's own, interpreted by triton, in ``tests/models/mamba/fla_on_cpu.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridpar.models.cuda_compile import compiled_backend, run_compiled
from hybridpar.models.mamba import fused
from hybridpar.models.mamba.fused_op import import_fla

__all__ = ["kernel_for", "norm_kernel", "plain_tensors", "fused_rms_norm", "fused_gated_rms_norm", "register_gated_norm",
           "rms_norm_to", "overflow_is_nan", "FLA_ROW_BYTES"]

logger = logging.getLogger(__name__)
FLA_ROW_BYTES = 65536  # FLA's norm kernels hold one group of a row in a block of at most this many bytes
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GATED: dict[str, tuple[Callable, Callable]] = {}
_FLA: tuple[tuple[Callable, Callable] | None, str] | None = None
_LOGGED: set[tuple[str, str, str]] = set()


def _fla_gated_norm() -> tuple[tuple[Callable, Callable] | None, str]:
    """``((layer_norm_fwd, layer_norm_bwd) or None, why not)``: FLA's gated group norm, resolved once."""
    global _FLA
    if _FLA is None:
        fwd, note = import_fla("fla.modules.norm.layernorm_gated", "layer_norm_fwd", "gated group RMSNorm")
        bwd = import_fla("fla.modules.norm.layernorm_gated", "layer_norm_bwd", "")[0] if fwd else None
        _FLA = ((fwd, bwd) if bwd else None), note
    return _FLA


def _fla_gated_status() -> tuple[bool, str]:
    kernels, note = _fla_gated_norm()
    return kernels is not None, note


def _subclass(tensors) -> str | None:
    """The name of the first tensor subclass (a DTensor under TP) among ``tensors``, or None."""
    return next((type(t).__name__ for t in tensors if t is not None and type(t) not in (Tensor, torch.nn.Parameter)),
                None)


def plain_tensors(*tensors: Tensor | None) -> bool:
    """Whether every one of ``tensors`` is a plain tensor or parameter (or None): no DTensor."""
    return _subclass(tensors) is None


def _why_pure(family: str, tensors: tuple[Tensor, ...], group_size: int | None) -> str | None:
    """Why these inputs take the pure norm on the fused path's device (None: they need not)."""
    subclass = _subclass(tensors)
    if subclass:
        return f"a {subclass} input"
    x = tensors[0]
    if family == "rmsnorm" and x.dtype != tensors[1].dtype:
        return f"input {x.dtype} and weight {tensors[1].dtype}: torch fuses one dtype only"
    if family == "gated_norm" and group_size * x.element_size() > FLA_ROW_BYTES:
        return f"a group of {group_size} channels is wider than FLA's {FLA_ROW_BYTES}-byte row"
    return None


def kernel_for(family: str, device_type: str, dtype: torch.dtype, stand_in: str | None = None, mode: str = "auto",
               fla_status: tuple[bool, str] = (False, "")) -> tuple[str, str]:
    """``(kernel, reason)`` for a norm of ``family`` from the inputs' device and dtype (no tensor is read)."""
    if mode == "pure":
        return "pure", "use_mamba_kernel('pure')"
    if stand_in is not None:  # any device and dtype: tests hold the plumbing to the pure norm in float64
        return stand_in, f"stand-in {stand_in!r} for the fused norm"
    if device_type != "cuda":
        return "pure", f"device {device_type}"
    if dtype not in _FUSED_DTYPES:
        return "pure", f"dtype {dtype} has no fused norm"
    if family == "rmsnorm":
        return "torch", "torch F.rms_norm"
    available, note = fla_status
    return ("fla", note) if available else ("pure", note)


def norm_kernel(family: str, tensors: tuple[Tensor | None, ...], group_size: int | None = None) -> str:
    """The kernel for a norm of ``family`` (``"rmsnorm"``, ``"gated_norm"``) on ``tensors`` (input
    first): ``"pure"``, ``"torch"`` (``F.rms_norm``), ``"fla"`` or a stand-in; logged once per reason.
    Compiled: the pure norm, which inductor fuses itself (nothing here is traced)."""
    if torch.compiler.is_compiling():
        return "pure"
    x = tensors[0]
    fla = _fla_gated_status() if family == "gated_norm" and x.device.type == "cuda" else (False, "")
    kernel, reason = kernel_for(family, x.device.type, x.dtype, fused.stand_in(family), fused.mamba_kernel_mode(), fla)
    if kernel != "pure":
        refused = _why_pure(family, tensors, group_size)
        if refused:
            kernel, reason = "pure", refused
    if (family, kernel, reason) not in _LOGGED:
        _LOGGED.add((family, kernel, reason))
        logger.info("norm kernel: %s for %s (%s; %s on %s)", kernel, family, reason, x.dtype, x.device)
    return kernel


def fused_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * x * rstd`` over the last dim through torch's fused op (in ``x``'s dtype)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _norm_to(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(weight * x * rstd in out_dtype, rstd [..., 1])``, as ``F.rms_norm`` then the cast: one rounding."""
    rstd = overflow_is_nan(x.pow(2).mean(-1, keepdim=True), eps)
    return (x * rstd * weight).to(out_dtype), rstd


def overflow_is_nan(mean_square: Tensor, eps: float) -> Tensor:
    """``rstd = (mean(u^2) + eps)^-1/2``, NaN where ``mean(u^2)`` overflowed (a group past ~1.8e19 in float32): ``rsqrt``
    gave 0 there and the norm a finite 0, so a diverged stream trained on in silence (round 30); NaN reaches the loss,
    where ``train.on_nonfinite`` sees it. An op on ``[..., groups]``, not on the activation."""
    return torch.where(mean_square.isinf(), float("nan"), torch.rsqrt(mean_square + eps))


def _norm_to_backward(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """``(dx in x's dtype, dweight)``: with ``n = x rstd`` and ``g = dy weight`` (in x's dtype),
    ``dx = rstd (g - n mean(g n))`` and ``dweight = sum_tokens dy n``."""
    normed, grad = x * rstd, grad.to(x.dtype)
    g = grad * weight
    dx = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
    return dx, (grad * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)


class _CompiledNormTo(torch.autograd.Function):
    """``F.rms_norm(x, weight)`` cast to ``out_dtype`` as one compiled step each way (``cuda_compile``): the
    forward reads float32 ``x`` once and writes the bf16 output, where the fused kernel wrote a float32
    output and the cast read it back (14 bytes per element, now 6); the backward takes the bf16
    gradient as it comes. Saves ``x`` and ``rstd``, as the fused kernel does."""

    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        y, rstd = run_compiled("RMSNorm to the matmul dtype", _norm_to, x.device, x, weight, eps, out_dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = run_compiled("RMSNorm to the matmul dtype backward", _norm_to_backward, grad.device, grad, x,
                                   weight, rstd)
        return dx, dweight, None, None


def rms_norm_to(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor | None:
    """``F.rms_norm`` cast to ``out_dtype`` (the matmul dtype under autocast) as compiled steps where the
    steps inside run compiled (``cuda_compile``: CUDA), the fused kernel would run (``norm_kernel``) and
    ``x`` and ``weight`` share a wider dtype; None elsewhere (the caller norms, then casts)."""
    if compiled_backend(x.device) is None or x.dtype == out_dtype or norm_kernel("rmsnorm", (x, weight)) == "pure":
        return None
    return _CompiledNormTo.apply(x, weight, eps, out_dtype)


def register_gated_norm(name: str, forward: Callable, backward: Callable) -> None:
    """Make ``(forward, backward)`` with FLA's ``layer_norm_fwd``/``layer_norm_bwd`` contract runnable
    as the gated norm ``name`` (tests: a float64 stand-in, FLA's kernels interpreted on CPU)."""
    fused.register_named(_GATED, name, (forward, backward), "gated norm", taken=("fla", "pure", "torch"))


def _gated_kernels(name: str) -> tuple[Callable, Callable]:
    return fused.named_kernel(_GATED, name, _fla_gated_norm, "gated norm")


class _FusedGatedNorm(torch.autograd.Function):
    """``rmsnorm(x * silu(gate))`` per group through a kernel pair with FLA's contract::

        forward(x [T, d], weight [d], None, eps, z=gate [T, d], group_size=, norm_before_gate=False,
                is_rms_norm=True) -> (y [T, d] in x's dtype, None, rstd [G*T] fp32)
        backward(dy, x, weight, None, eps, None, rstd, z=gate, group_size=, norm_before_gate=False,
                 is_rms_norm=True) -> (dx, dweight, None, dgate)

    Rows may be strided (a gate that is a view of ``in_proj``'s output); the last dim is contiguous."""

    @staticmethod
    def forward(ctx, x, gate, weight, group_size, eps, kernel):
        shape = x.shape
        rows, z = _rows(x), _rows(gate)
        y, _, rstd = _gated_kernels(kernel)[0](rows, weight, None, eps, z=z, group_size=group_size,
                                              norm_before_gate=False, is_rms_norm=True)
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.group_size, ctx.eps, ctx.kernel = group_size, eps, kernel
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, grad_out):
        x, gate, weight, rstd = ctx.saved_tensors
        dx, dweight, _, dgate = _gated_kernels(ctx.kernel)[1](
            _rows(grad_out), _rows(x), weight, None, ctx.eps, None, rstd, z=_rows(gate),
            group_size=ctx.group_size, norm_before_gate=False, is_rms_norm=True)
        return dx.reshape(x.shape), dgate.reshape(gate.shape), dweight, None, None, None


def _rows(t: Tensor) -> Tensor:
    """``t [..., d]`` as rows ``[T, d]`` with a unit last stride (a view where strides allow)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def fused_gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, group_size: int, eps: float,
                         kernel: str = "fla") -> Tensor:
    """``weight * rmsnorm_group(x * silu(gate))`` through the named kernel pair (in ``x``'s dtype)."""
    return _FusedGatedNorm.apply(x, gate, weight.contiguous(), group_size, eps, kernel)
