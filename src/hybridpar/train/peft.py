"""``peft.*``: LoRA adapters on the single-device model, before ``parallelize`` (``models/lora.py``).

``apply_peft`` is called by the trainer on the model it will train and by the preflight on
the shape-only model, so a target that matches nothing or a bad rank is a ``ConfigError``
before torchrun starts; a target whose TP style has no LoRA pairing is refused by
``parallelize``'s validation (``parallel/lora.py``), also before any collective.
"""

from __future__ import annotations


import torch
from torch import nn

from hybridpar.config import ConfigError, RunConfig
from hybridpar.models.lora import adapter_settings, add_lora, lora_modules
from hybridpar.models.lora_experts import expert_lora_modules
from hybridpar.models.token_dropout import set_dropout_tokens, token_keys
from hybridpar.parallel.context.inputs import ShardedInputs

__all__ = ["apply_peft", "key_dropout", "lora_line", "trainable_parameter_count"]


def apply_peft(config: RunConfig, model: nn.Module) -> nn.Module:
    """Add ``config.peft``'s adapters to ``model`` (frozen otherwise); no-op for ``peft.method=none``
    or a model that already has them."""
    peft = config.peft
    if peft.method == "none" or adapter_settings(model):
        return model
    try:
        add_lora(model, r=peft.r, alpha=peft.alpha, dropout=peft.dropout, targets=peft.target_modules,
                 seed=config.train.seed, target_parameters=peft.target_parameters)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if config.model.export_hf and peft.merge:  # before step 1, not after training
        from hybridpar.models.hf.lora_export import check_mergeable

        try:
            check_mergeable(model)
        except ValueError as error:
            raise ConfigError(f"model.export_hf with peft.merge=true: {error}") from None
    if config.model.export_hf and not peft.merge:
        from hybridpar.models.hf.lora_export import mamba_out_proj_targets

        refused = mamba_out_proj_targets(model)
        if refused:
            raise ConfigError(f"model.export_hf with peft.merge=false writes a peft adapter, and peft cannot load one on "
                              f"a Mamba mixer's out_proj ({refused[0]!r}); set peft.merge=true or peft.target_modules "
                              "without out_proj.")
    return model


def key_dropout(model: nn.Module, step: int, pack: int, sharded: ShardedInputs) -> None:
    """Key ``model``'s dropout masks (LoRA's, the checkpoint's hidden-state dropout) by each token's
    place in the step (``pack``: the pack's index among the step's global packs; positions in the
    full row), so every layout draws one process's masks. No-op without keyed dropout."""
    if getattr(model, "dropout_tokens", None) is not None:
        keys = token_keys(torch.tensor([pack]), sharded.global_positions())  # [1, S/cp]
        set_dropout_tokens(model, step, keys.to(sharded.labels.device))  # once per pack, not per module


def trainable_parameter_count(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter elements of a single-device model."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total


def lora_line(model: nn.Module) -> str | None:
    """The first-lines statement of what LoRA adapts: the adapted layer names, the adapted stacked
    expert weights (``peft.target_parameters``), trainable elements and dtype, and the stacked weights
    no adapter reaches (transformers' fused MoE experts ``[E, out, in]`` left out of
    ``peft.target_parameters``)."""
    settings = adapter_settings(model)
    if settings is None:
        return None
    modules = lora_modules(model)
    trainable, total = trainable_parameter_count(model)
    kinds = sorted({name.rsplit(".", 1)[-1] for name in modules})
    base = next(p.dtype for n, p in model.named_parameters() if not p.requires_grad)
    line = (f"LoRA r={settings['r']}: adapters on {len(modules)} linear layers ({', '.join(kinds) or 'none'}), "
            f"{trainable:,} of {total:,} parameters train ({100 * trainable / total:.2f}%; adapters "
            f"{str(settings['dtype']).removeprefix('torch.')}, base {str(base).removeprefix('torch.')})")
    adapted = {f"{m}.{p}" for m, module in expert_lora_modules(model).items() for p in module.lora_parameters}
    if adapted:
        names = sorted({".".join(n.split(".")[-2:]) for n in adapted})
        line += f"; expert adapters (rank {settings['r']} per expert) on {len(adapted)} stacked weights ({', '.join(names)})"
    stacked = {f"{m}.{n}": p.numel() for m, module in model.named_modules() if not isinstance(module, nn.Conv1d)
               for n, p in module.named_parameters(recurse=False) if p.dim() > 2 and f"{m}.{n}" not in adapted}
    if stacked:
        names = sorted({".".join(n.split(".")[-2:]) for n in stacked})
        line += (f"; not adapted: {len(stacked)} stacked weights ({', '.join(names[:4])}"
                 f"{', ...' if len(names) > 4 else ''}; {100 * sum(stacked.values()) / total:.0f}% of the parameters); "
                 f"adapt them with peft.target_parameters=[{','.join(names[:4])}]")
    return line
