"""AdamW (and the scale its settings must keep), the warmup + cosine schedule, and gradient clipping that works on DTensors."""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridpar.config import ConfigError, RunConfig, TrainConfig


def check_optimizer_scale(config: RunConfig) -> None:
    """AdamW's first step moves a weight by up to ``lr / (1 - beta1)`` (its bias correction), which must be a
    number in the trained weights' dtype; and decoupled weight decay multiplies each weight by
    ``1 - lr * weight_decay`` per step, which must stay above 0 (at 0 or below it erases or flips them). Trained
    bfloat16 weights (no mixed precision, no LoRA) are said to drop small updates (``bf16_update_note``)."""
    train = config.train
    wide = config.model.dtype == "float64" and not config.parallel.mixed_precision
    largest = 1.7e308 if wide else 3.4e38  # float64, else float32 (bf16's range is float32's)
    if train.lr / (1 - train.betas[0]) > largest:
        raise ConfigError(f"train.lr={train.lr:g} is too large: AdamW's first step, lr/(1-beta1) = "
                          f"{train.lr / (1 - train.betas[0]):.3g}, is past the largest {'float64' if wide else 'float32'} "
                          f"({largest:.3g}); use a train.lr below {largest * (1 - train.betas[0]):.3g} (typical: 1e-5 to 1e-2).")
    if train.lr * train.weight_decay >= 1:
        raise ConfigError(f"train.lr * train.weight_decay = {train.lr:g} * {train.weight_decay:g} = "
                          f"{train.lr * train.weight_decay:.3g} is >= 1: decoupled weight decay multiplies every weight "
                          "by 1 - lr * weight_decay each step, which erases or flips them; use train.weight_decay below "
                          f"{1 / train.lr:.3g} (typical: 0.0 to 0.1).")
    if config.model.dtype == "bfloat16" and not config.parallel.mixed_precision and config.peft.method == "none":
        from hybridpar.train.run.metrics import notice

        notice(bf16_update_note(train.lr))


def bf16_update_note(lr: float) -> str:
    """AdamW moves a weight by about ``lr`` a step (exactly ``lr`` at its first); a bfloat16 ``w`` in ``[2^e, 2^(e+1))``
    is spaced ``2^(e-7)`` apart, so the update rounds away (silently) once ``2^e > 2^8 lr``, for every ``|w| >= 2^9 lr``
    (and some from ``2^8 lr``): lr=1e-4 left 18% of an N(0, 0.02) matrix and every norm weight (1.0) unchanged
    after 3 steps, lr=1e-5 85%."""
    return (f"model.dtype=bfloat16 without parallel.mixed_precision trains bfloat16 weights: an AdamW update (about "
            f"train.lr={lr:g} a step) below half a weight's bfloat16 spacing is rounded away, so weights of magnitude "
            f"{512 * lr:.3g} or more do not change (norm weights at 1.0 until train.lr reaches 0.0039); set "
            "parallel.mixed_precision=bf16 (float32 master weights and AdamW, bf16 compute) or model.dtype=float32.")


NO_DECAY = ("A_log", "D", "dt_bias")  # SSM parameters never decayed, whatever their shape


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norms, biases and the SSM parameters excluded),
    in the implementation ``adamw_implementation`` picks."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        # A Mamba1 mixer's A_log is a matrix [d_inner, N] (Jamba, FalconMamba): decay would pull every A = -exp(A_log)
        # toward -1; mamba_ssm marks it (and D) _no_weight_decay, transformers' models do not, FSDP's new parameters lose it
        if param.requires_grad:
            keep = param.dim() < 2 or name.rsplit(".", 1)[-1] in NO_DECAY or getattr(param, "_no_weight_decay", False)
            (no_decay if keep else decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, **adamw_implementation(decay + no_decay))


def adamw_implementation(params: list[torch.Tensor]) -> dict:
    """AdamW's keyword for ``params``:

    - on CUDA, ``fused=True``: one kernel for the whole update (torchtitan's default), where
      ``foreach`` (torch's default) launches one multi-tensor kernel per op of the update;
    - where DTensor and plain parameters mix (a layout that leaves some replicated as plain
      tensors), ``foreach=False``: the per-parameter loop, as DTensor's foreach and fused ops refuse
      mixed lists;
    - otherwise torch's choice (``foreach=None``): the per-parameter loop on CPU, the exact reference.
    """
    if len({type(param) for param in params}) > 1:
        return {"foreach": False}
    if params and all(param.device.type == "cuda" and param.is_floating_point() for param in params):
        return {"fused": True}
    return {"foreach": None}


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


def apply_settings(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                   config: TrainConfig) -> None:
    """Put ``config``'s lr, betas and weight decay back after a checkpoint's optimizer state was loaded
    (loading restores the recorded ones; resume.py says when they differ); the schedule then
    continues from the loaded step with this config's lambda."""
    scheduler.base_lrs = [config.lr] * len(optimizer.param_groups)
    for index, group in enumerate(optimizer.param_groups):
        group["betas"] = tuple(config.betas)
        group["initial_lr"] = config.lr
        group["weight_decay"] = config.weight_decay if index == 0 else 0.0
        group["lr"] = config.lr * scheduler.lr_lambdas[index](scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip the total gradient norm ``sqrt(sum_g |g|^2)`` and return it as a plain scalar.

    A DTensor gradient counts each global element once: the squares of its local shard are
    summed with those of every gradient sharded over the same process groups, and each such
    group sum is all-reduced once over those groups (``[1] -> [1]``); replicated mesh dims are
    not summed. A ``Partial`` gradient (sequence-parallel norm weights without FSDP) is
    reduced first. One all-reduce per (group set, mesh dim), not one per parameter.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    sums: dict[tuple, torch.Tensor] = {}
    for grad in grads:
        groups: tuple = ()
        if isinstance(grad, DTensor):
            if any(placement.is_partial() for placement in grad.placements):
                local = grad.full_tensor()
            else:
                mesh = grad.device_mesh
                groups = tuple(mesh.get_group(i) for i, placement in enumerate(grad.placements)
                               if not placement.is_replicate() and mesh.size(i) > 1)  # Shard, _StridedShard
                local = grad.to_local()
        else:
            local = grad
        # |g|^2 in float64: float32's squares overflow past |g| = 1.8e19 (a finite norm read as inf stopped the run)
        square = torch.linalg.vector_norm(local, dtype=torch.float64).square()
        sums[groups] = sums[groups] + square if groups in sums else square
    for groups, total in sums.items():
        for group in groups:
            torch.distributed.all_reduce(total, group=group)  # [1] -> [1], summed over the shards
    total = torch.stack([t.double() for t in sums.values()]).sum().sqrt() if sums else torch.zeros(())
    coefficient = max_norm / (float(total) + 1e-6)
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)
    return total
