"""AdamW, the warmup + cosine schedule, and gradient clipping that works on DTensors."""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridpar.config import TrainConfig


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norms, biases and 1-D SSM parameters excluded)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, foreach=False)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine decay to ``min_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, config.warmup_steps, config.steps, config.min_lr_ratio)
    )


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip the total gradient norm and return it as a plain scalar.

    A DTensor gradient (tensor parallel, FSDP) counts each global element once: its norm
    is reduced over its own mesh, so parameters on different meshes mix freely.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    squares = []
    for grad in grads:
        norm = torch.linalg.vector_norm(grad)
        squares.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float().square())
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    coefficient = max_norm / (float(total) + 1e-6)
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)
    return total
