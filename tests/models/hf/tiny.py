"""What every tiny float64 transformers test model shares: built from its config class in float64, experts
on the eager path (``torch._grouped_mm`` has no float64), every parameter perturbed so that no gradient is
trivially zero. The builders (``hybrid_models``, ``gdn_models``, ...) add what their family needs."""

from __future__ import annotations

import warnings
from typing import Callable

import torch


def perturbed_float64(make: Callable[[], torch.nn.Module], seed: int = 0) -> torch.nn.Module:
    """``make()`` in float64 with eager experts and every parameter moved by ``0.05 * N(0, 1)`` (seeded)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on tiny configs
        model = make().to(torch.float64)
    if type(model)._can_set_experts_implementation():
        model.set_experts_implementation("eager")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model
