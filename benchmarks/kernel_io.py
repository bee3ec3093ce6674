"""Stand-ins for the fused kernels a GPU step runs, each counting one read of its inputs and one write
of its outputs (``step_traffic.py``): FLA's ``chunk_simple_gla`` and ``causal_conv1d`` (the Mamba2
scan and conv), FLA's gated norm, torch's fused RMSNorm (``_fused_rms_norm``, a composite on CPU),
FlashAttention (``varlen_attn``; the blockwise core runs on CPU) and the steps compiled inside our
custom ops and the MLP's activation (``models/cuda_compile.py``: inductor on CUDA). The kernels
compute nothing: outputs are ``torch.empty`` of the kernel's shapes and dtypes, so a CPU runs the rest
of the step at full size; the compiled steps run their eager form, uncounted (later steps read their
values). Their insides (e.g. the scan's chunk states) are not counted: a lower bound there.
"""

from __future__ import annotations

import contextlib
import sys
from unittest import mock

import torch
from torch.utils._python_dispatch import _disable_current_modes

from hybridpar.models import cuda_compile
from hybridpar.models.attention import blockwise  # step_traffic.py imports harness first: this checkout's src/
from hybridpar.models.mamba.fused import use_stand_in
from hybridpar.models.mamba.fused_op import register_scan
from hybridpar.models.norm_kernels import register_gated_norm


SINK = None  # where _kernel records: an object with record(kind, tensors), set while a step is counted


def _kernel(inputs, outputs) -> None:
    """One fused kernel: reads ``inputs`` once, writes ``outputs`` once."""
    if SINK is not None:
        SINK.record("fused kernels", [*inputs, *outputs])


def _empty_like(*tensors):
    with _disable_current_modes():
        return tuple(None if t is None else torch.empty_like(t) for t in tensors)


class _Scan(torch.autograd.Function):
    """``chunk_simple_gla``'s shapes and I/O, no math (FLA's kernels: one launch each way, as counted)."""

    @staticmethod
    def forward(ctx, q, k, v, g, initial, documents):
        with _disable_current_modes():
            o, final = torch.empty_like(v), torch.empty(documents, v.shape[2], v.shape[3], k.shape[3])
        _kernel([q, k, v, g, initial], [o])
        ctx.save_for_backward(q, k, v, g, initial)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        grads = _empty_like(*ctx.saved_tensors)
        _kernel([*ctx.saved_tensors, do, dfinal], grads)
        return *grads, None


def scan_stand_in(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, state_v_first):
    o, final = _Scan.apply(q, k, v, g, initial_state, cu_seqlens.shape[0] - 1)
    return o, (final if output_final_state else None)


class _Conv(torch.autograd.Function):
    """``causal_conv1d`` with SiLU: one kernel each way."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        (out,) = _empty_like(x)
        _kernel([x, weight, bias], [out])
        ctx.save_for_backward(x, weight, bias)
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = _empty_like(*ctx.saved_tensors)
        _kernel([*ctx.saved_tensors, dout], grads)
        return grads


def conv_stand_in(x, weight, bias, initial_state, activation, cu_seqlens):
    return _Conv.apply(x, weight, bias), None


def gated_norm_forward(x, weight, bias, eps, z, group_size, norm_before_gate, is_rms_norm):
    (y,) = _empty_like(x)
    with _disable_current_modes():
        rstd = torch.empty(x.shape[0] * (x.shape[1] // group_size))
    _kernel([x, weight, z], [y, rstd])
    return y, None, rstd


def gated_norm_backward(dy, x, weight, bias, eps, mean, rstd, z, group_size, norm_before_gate, is_rms_norm):
    dx, dz, dweight = _empty_like(x, z, weight)
    _kernel([dy, x, weight, rstd, z], [dx, dz, dweight])
    return dx, dweight, None, dz


class _RMSNorm(torch.autograd.Function):
    """torch's ``_fused_rms_norm`` on CUDA (on CPU ``F.rms_norm`` is a composite): one kernel each way."""

    @staticmethod
    def forward(ctx, x, weight):
        (y,) = _empty_like(x)
        with _disable_current_modes():
            rstd = torch.empty(x.shape[:-1])
        _kernel([x, weight], [y, rstd])
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = _empty_like(x, weight)
        _kernel([dy, x, weight, rstd], [dx, dweight])
        return dx, dweight


class _Flash(torch.autograd.Function):
    """FlashAttention's I/O in place of the blockwise core (``varlen_attn`` on a GPU): one kernel each way."""

    @staticmethod
    def forward(ctx, q, k, v, *layout_and_options):
        (out,) = _empty_like(q)
        with _disable_current_modes():
            lse = torch.empty(q.shape[0], q.shape[2], q.shape[1])
        _kernel([q, k, v], [out, lse])
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _empty_like(q, k, v)
        _kernel([dout, q, k, v, out, lse], grads)
        return *grads, *(None,) * 10


class FusedRMSNorm(torch.overrides.TorchFunctionMode):
    """``F.rms_norm`` (the fused RMSNorm's call) as ``_RMSNorm``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.rms_norm:
            kwargs = kwargs or {}
            return _RMSNorm.apply(args[0], args[2] if len(args) > 2 else kwargs["weight"])
        return func(*args, **(kwargs or {}))


def compiled_step_stand_in(name, step, device, *args):
    """``cuda_compile.run_compiled`` on CUDA: a compiled step (the loss's block statistics or gradient, the
    fused Mamba op's glue, the MLP's activation) is one fused kernel that reads its tensors once and
    writes its outputs."""
    with _disable_current_modes():
        out = step(*args)
    _kernel([t for t in args if isinstance(t, torch.Tensor)],
            [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)])
    return out


def compiled_steps_as_on_cuda(stack: contextlib.ExitStack) -> None:
    """Every hybridpar module that runs compiled steps (``from hybridpar.models.cuda_compile import
    run_compiled``) gets the stand-in, and is told a backend is on, as on CUDA."""
    run, backend = cuda_compile.run_compiled, cuda_compile.compiled_backend
    for module in list(sys.modules.values()):
        if module is not cuda_compile and getattr(module, "__name__", "").startswith("hybridpar.") and \
                getattr(module, "run_compiled", None) is run:
            stack.enter_context(mock.patch.object(module, "run_compiled", compiled_step_stand_in))
            if getattr(module, "compiled_backend", None) is backend:
                stack.enter_context(mock.patch.object(module, "compiled_backend", lambda device: "inductor"))


register_scan("traffic", scan_stand_in, conv_stand_in)
register_gated_norm("traffic", gated_norm_forward, gated_norm_backward)


@contextlib.contextmanager
def kernel_stand_ins(sink):
    """Within the block the fused path runs on any device with these stand-ins, each recording its
    inputs and outputs in ``sink``: FLA's scan, conv and gated norm, torch's fused RMSNorm, flash
    attention, the steps compiled inside our custom ops and the MLP's activation."""
    global SINK
    SINK = sink
    try:
        with use_stand_in("traffic"), use_stand_in("traffic", family="gated_norm"), \
                use_stand_in("torch", family="rmsnorm"), mock.patch.object(blockwise, "_BlockwiseAttention", _Flash), \
                contextlib.ExitStack() as stack, FusedRMSNorm():
            compiled_steps_as_on_cuda(stack)
            yield
    finally:
        SINK = None
