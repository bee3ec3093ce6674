"""``peft.*``: LoRA adapters on the single-device model, before ``parallelize`` (``models/lora.py``).

``apply_peft`` is called by the trainer on the model it will train and by the preflight on
the shape-only model, so a target that matches nothing or a bad rank is a ``ConfigError``
before torchrun starts; a target whose TP style has no LoRA pairing is refused by
``parallelize``'s validation (``parallel/lora.py``), also before any collective.
"""

from __future__ import annotations

from torch import nn

from hybridpar.config import ConfigError, RunConfig
from hybridpar.models.lora import add_lora, lora_modules

__all__ = ["apply_peft", "trainable_parameter_count"]


def apply_peft(config: RunConfig, model: nn.Module) -> nn.Module:
    """Add ``config.peft``'s adapters to ``model`` (frozen otherwise); no-op for ``peft.method=none``
    or a model that already has them."""
    peft = config.peft
    if peft.method == "none" or lora_modules(model):
        return model
    try:
        add_lora(model, r=peft.r, alpha=peft.alpha, dropout=peft.dropout, targets=peft.target_modules,
                 seed=config.train.seed)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return model


def trainable_parameter_count(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter elements of a single-device model."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total
