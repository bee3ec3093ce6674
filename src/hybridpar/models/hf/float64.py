"""A float64 transformers model that computes in float64 throughout.

transformers casts some steps to float32 whatever the model's dtype: RMSNorms
(``x.to(torch.float32)``), gated Mamba norms, its torch SSD scan (``.float()``), MoE routers,
``softmax(..., dtype=torch.float32)``, some logits (``.float()``). In a float64 model these casts
cap agreement at float32 rounding: a 1e-16 difference between two exact computations (another
reduction order under CP or TP) flips a float32 rounding now and then, and a gradient moves by
~1e-9. ``keep_float64(model)`` runs the model's forward under a torch function mode that turns
every such cast of a float64 tensor into float64 (no cast), so ``hybridpar check`` compares
float64 with float64. Backward needs nothing: the casts that did not happen have no backward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["KeepFloat64", "keep_float64"]

_F32, _F64 = torch.float32, torch.float64
_CASTS = {torch.Tensor.to, torch.Tensor.type, torch.Tensor.float}


def _has_float64(values) -> bool:
    return any(isinstance(v, torch.Tensor) and v.dtype == _F64 for v in values)


class KeepFloat64(TorchFunctionMode):
    """Inside: a float64 tensor cast to float32 stays float64; ``dtype=float32`` becomes float64
    for functions of a float64 tensor (softmax, ...)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CASTS and args and isinstance(args[0], torch.Tensor) and args[0].dtype == _F64:
            if func is torch.Tensor.float:
                return args[0]
            rest = args[1:]
            wants_f32 = kwargs.get("dtype") is _F32 or any(a is _F32 or a == "torch.FloatTensor" for a in rest)
            if wants_f32:
                args = (args[0], *(_F64 if a is _F32 else a for a in rest))
                if kwargs.get("dtype") is _F32:
                    kwargs = {**kwargs, "dtype": _F64}
                if func is torch.Tensor.type:
                    return args[0]
        elif kwargs.get("dtype") is _F32 and _has_float64(args):
            kwargs = {**kwargs, "dtype": _F64}
        return func(*args, **kwargs)


def keep_float64(model: nn.Module) -> nn.Module:
    """Run ``model``'s forward (and each layer's, recomputed or not) under ``KeepFloat64``
    (module docstring); returns ``model``."""
    modes: list[KeepFloat64] = []

    def enter(module, args, kwargs):
        mode = KeepFloat64()
        mode.__enter__()
        modes.append(mode)

    def leave(module, args, kwargs, output):
        modes.pop().__exit__(None, None, None)

    # the root, and every layer of a ModuleList: activation checkpointing recomputes a layer in
    # backward, outside the root's forward, and must see the same float64 casts
    layers = [m for holder in model.modules() if isinstance(holder, nn.ModuleList) for m in holder]
    for module in (model, *layers):
        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True, always_call=True)
    return model
