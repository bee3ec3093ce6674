"""Building blocks shared by every layer kind: RMSNorm, the MLP, the residual block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.models.cuda_compile import compiled_backend, run_compiled
from hybridpar.models.norm_kernels import (fused_gated_rms_norm, fused_rms_norm, norm_kernel, overflow_is_nan,
                                           rms_norm_to)


class _Relu2(torch.autograd.Function):
    """``y = r * r`` with ``r = relu(x)`` and one backward pass ``dx = 0 + 2 dy r`` (one ``addcmul`` on a
    zero scalar; ``r = 0`` where ``x <= 0``, so no mask is needed). Eager autograd ran ``dy * r`` twice,
    their sum, then relu's mask: four ``[T, I]`` passes where this makes one, with the same values
    (``round(2 dy r) = 2 round(dy r)``: doubling is exact, and a bf16 product is exact in the float32 it
    is computed in). Eager (CPU) it keeps ``r``, as eager autograd does; where the steps inside run
    compiled (CUDA, ``cuda_compile``) it keeps ``x`` instead, the same bytes, and each direction is one
    kernel: ``relu`` then the product forward, ``relu`` inside the product backward."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.kept_input = compiled_backend(x.device) is not None
        if ctx.kept_input:
            ctx.save_for_backward(x)
            return run_compiled("relu2", _relu2, x.device, x)
        r = F.relu(x)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (kept,) = ctx.saved_tensors
        if ctx.kept_input:
            return run_compiled("relu2 backward", _relu2_backward, grad.device, grad, kept)
        return _twice_product(grad, kept)


def _relu2(x: Tensor) -> Tensor:
    r = F.relu(x)
    return r * r


def _twice_product(grad: Tensor, r: Tensor) -> Tensor:
    return torch.addcmul(grad.new_zeros(()), grad, r, value=2)


def _relu2_backward(grad: Tensor, x: Tensor) -> Tensor:
    return _twice_product(grad, F.relu(x))


def relu2(x: Tensor) -> Tensor:
    """``relu(x)^2`` as a product: CUDA's autocast runs ``pow`` (what ``square`` becomes) in float32,
    and kept a float32 copy of every MLP's ``[T, I]`` activation for backward, 15.9 GiB more than
    planned for the ``1b`` preset at 32K tokens on an H200. A bf16 product of bf16 factors rounds
    the exact product, as the float32 ``pow`` then cast to bf16 did. ``_Relu2`` gives its backward."""
    return _Relu2.apply(x)


ACTIVATIONS = {
    "relu2": relu2,
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
}


# d act(g) / dg applied to a gradient, through the aten kernel eager autograd calls for ``act``
_ACTIVATION_BACKWARDS = {
    "silu": lambda grad, gate: torch.ops.aten.silu_backward(grad, gate),
    "gelu": lambda grad, gate: torch.ops.aten.gelu_backward(grad, gate, approximate="tanh"),
    "gelu_erf": lambda grad, gate: torch.ops.aten.gelu_backward(grad, gate, approximate="none"),
}
_GATED_FORWARDS = {"silu": F.silu, "gelu": ACTIVATIONS["gelu"], "gelu_erf": F.gelu}


class _GatedProduct(torch.autograd.Function):
    """``y = act(gate) * up`` keeping only ``gate`` and ``up`` for backward (eager autograd keeps
    ``act(gate)`` too: four ``[T, I]`` tensors per gated MLP with the product ``down_proj`` keeps,
    now three; 2 GiB of a 1.2B Llama's 8K step)::

        d up   = dy * act(gate)                 (act recomputed)
        d gate = act'(gate) * (dy * up)         (aten's own ``*_backward`` kernel)

    the same ops eager autograd runs, so values and gradients are bitwise equal to ``act(gate) * up``.
    On CUDA each direction runs compiled (``cuda_compile``): one kernel where eager makes two forward
    and four backward passes over ``[T, I]``."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, kind: str) -> Tensor:
        ctx.kind = kind
        ctx.save_for_backward(gate, up)
        return run_compiled(f"{kind} gated product", _gated_product, gate.device, gate, up, kind)

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up = ctx.saved_tensors
        grad_gate, grad_up = run_compiled(f"{ctx.kind} gated product backward", _gated_product_backward,
                                          grad.device, grad, gate, up, ctx.kind, *ctx.needs_input_grad[:2])
        return grad_gate, grad_up, None


def _gated_product(gate: Tensor, up: Tensor, kind: str) -> Tensor:
    return _GATED_FORWARDS[kind](gate) * up


def _gated_product_backward(grad: Tensor, gate: Tensor, up: Tensor, kind: str, want_gate: bool, want_up: bool):
    grad_gate = _ACTIVATION_BACKWARDS[kind](grad * up, gate) if want_gate else None
    grad_up = grad * _GATED_FORWARDS[kind](gate) if want_up else None
    return grad_gate, grad_up


def gated_product(gate: Tensor, up: Tensor, kind: str) -> Tensor:
    """``act(gate) * up`` for ``kind`` in ``GATED_KINDS`` (``_GatedProduct``: one ``[T, I]`` less kept)."""
    return _GatedProduct.apply(gate, up, kind)


GATED_KINDS = tuple(_GATED_FORWARDS)


def matmul_input(t: Tensor) -> Tensor:
    """``t`` in autocast's dtype when autocast is on (else unchanged): a norm's output is cast once,
    not once per linear that reads it (autocast copies a float32 input for every matmul, and each
    copy is kept for backward: five for a Mamba ``in_proj`` split in parts)."""
    device = t.device.type
    return t.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else t


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32 or wider; under autocast its
    output is in autocast's dtype (``matmul_input``; on CUDA the norm and the cast are one compiled
    step each way, ``norm_kernels.rms_norm_to``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        device = hidden_states.device.type
        if torch.is_autocast_enabled(device):  # on CUDA the norm and the cast may be one compiled step
            out = rms_norm_to(hidden_states, self.weight, self.eps, torch.get_autocast_dtype(device))
            if out is not None:
                return out
        return matmul_input(rms_norm(hidden_states, self.weight, self.eps))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * (x * rstd).to(x.dtype)`` over the last dim, statistics in float32 or wider: ours
    (``_RMSNormFunction``: saves ``x`` and ``rstd`` only) or torch's fused kernel where
    ``norm_kernels.norm_kernel`` picks it (CUDA)."""
    if norm_kernel("rmsnorm", (x, weight)) == "pure":
        return _RMSNormFunction.apply(x, None, weight, x.shape[-1], eps)
    return fused_rms_norm(x, weight, eps)


class GatedRMSNorm(nn.Module):
    """Mamba2's norm: ``rmsnorm(y * silu(z))`` over groups of ``group_size`` channels.

    Grouping by ``d_inner / n_groups`` keeps each group inside one tensor-parallel shard,
    so sharding the mixer by heads needs no extra all-reduce, unless a single group spans the
    shards (``gated_rms_norm``'s ``span``, set up by ``parallel/tensor/hybrid.spanning_group_norm``).
    Same math and parameter name as transformers' ``MambaRMSNormGated``.
    """

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, hidden_states: Tensor, gate: Tensor) -> Tensor:
        return gated_rms_norm(hidden_states, gate, self.weight, self.group_size, self.eps)


class _RMSNormFunction(torch.autograd.Function):
    """``weight * (u * rstd)`` with ``u = x`` or ``x * silu(gate)`` and ``rstd = (mean_group(u^2) +
    eps)^-1/2`` per group of ``group_size`` channels, in float32 or wider.

    Saves only the inputs (``x``, ``gate``: for a Mamba mixer ``gate`` is a view of ``in_proj``'s
    output) and ``rstd`` ``[..., groups]``; the backward recomputes ``u``. Gradients, with
    ``g = weight * dy`` and ``n = u * rstd``: ``du = rstd (g - n mean_group(g n))``,
    ``dx = du * silu(gate)``, ``dgate = du * x * silu'(gate)``, ``dweight = sum(dy * n)``.

    ``span = (sum_over_ranks, width)``: one group of ``width`` channels of which this process holds
    ``group_size`` (a tensor-parallel shard); both group means sum their ``[..., 1]`` partial sums
    with ``sum_over_ranks`` (an all-reduce the caller supplies) and divide by ``width``.
    """

    @staticmethod
    def forward(ctx, x, gate, weight, group_size, eps, span=None):
        u, _ = _gated(x, gate)
        grouped = u.unflatten(-1, (-1, group_size))
        if span is None:
            rstd = overflow_is_nan(grouped.pow(2).mean(-1), eps)  # [..., groups]
        else:
            rstd = overflow_is_nan(span[0](grouped.pow(2).sum(-1)) / span[1], eps)  # [..., 1], summed over ranks
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.group_size, ctx.span = group_size, span
        normed = (grouped * rstd[..., None]).flatten(-2)
        return weight * normed.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, gate, weight, rstd = ctx.saved_tensors
        u, silu_gate = _gated(x, gate)
        grouped = (-1, ctx.group_size)
        normed = u.unflatten(-1, grouped) * rstd[..., None]  # [..., groups, group_size]
        grad_weight = (grad_out * normed.flatten(-2).to(x.dtype)).sum(tuple(range(grad_out.dim() - 1)))
        g = (grad_out * weight).to(u.dtype).unflatten(-1, grouped)
        if ctx.span is None:
            mean_gn = (g * normed).mean(-1, keepdim=True)
        else:
            mean_gn = ctx.span[0]((g * normed).sum(-1, keepdim=True)) / ctx.span[1]
        du = (rstd[..., None] * (g - normed * mean_gn)).flatten(-2)
        if gate is None:
            return du.to(x.dtype), None, grad_weight, None, None, None
        sig = torch.sigmoid(gate.to(u.dtype))
        grad_gate = du * x.to(u.dtype) * sig * (1 + gate.to(u.dtype) * (1 - sig))
        return (du * silu_gate).to(x.dtype), grad_gate.to(gate.dtype), grad_weight, None, None, None


def gated_rms_norm(x: Tensor, gate: Tensor | None, weight: Tensor, group_size: int, eps: float, span=None) -> Tensor:
    """``_RMSNormFunction`` (saves only its inputs and ``rstd``; ``span``: see there), or a fused kernel
    with the same math where ``norm_kernels.norm_kernel`` picks one (CUDA, a gate, no span)."""
    if span is None and gate is not None:
        kernel = norm_kernel("gated_norm", (x, gate, weight), group_size)
        if kernel != "pure":
            return fused_gated_rms_norm(x, gate, weight, group_size, eps, kernel)
    return _RMSNormFunction.apply(x, gate, weight, group_size, eps, span)


def _gated(x: Tensor, gate: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``(u, silu(gate))`` in float32 or wider: ``u = x`` or ``x * silu(gate)``."""
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    if gate is None:
        return x.to(compute_dtype), None
    silu_gate = F.silu(gate.to(compute_dtype))
    return x.to(compute_dtype) * silu_gate, silu_gate


class MLP(nn.Module):
    """Feed-forward block: ``down(act(up(x)))``, or ``down(act(gate(x)) * up(x))`` when gated."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "relu2", gated: bool = False, bias: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"mlp activation {activation!r} is unknown; use one of {sorted(ACTIVATIONS)}.")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias) if gated else None
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act, self.activation = ACTIVATIONS[activation], activation

    def forward(self, hidden_states: Tensor, packed=None) -> Tensor:
        up = self.up_proj(hidden_states)
        if self.gate_proj is not None:
            if self.activation in GATED_KINDS:
                return self.down_proj(gated_product(self.gate_proj(hidden_states), up, self.activation))
            return self.down_proj(self.act(self.gate_proj(hidden_states)) * up)
        return self.down_proj(self.act(up))


class ResidualBlock(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x), packed)``.

    The mixer is a Mamba2 mixer, an attention layer or an MLP; each takes
    ``(hidden_states [B, S, D], packed)`` and returns ``[B, S, D]``.
    """

    def __init__(self, norm: nn.Module, mixer: nn.Module, kind: str):
        super().__init__()
        self.norm = norm
        self.mixer = mixer
        self.kind = kind

    def forward(self, hidden_states: Tensor, packed=None) -> Tensor:
        return hidden_states + self.mixer(self.norm(hidden_states), packed)
