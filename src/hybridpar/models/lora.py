"""LoRA: a trainable low-rank update beside a frozen linear layer (single-device code).

    y = base(x) + (alpha / r) * B(A(dropout(x)))      A: [r, in] (Kaiming uniform), B: [out, r] (zeros)

On a bfloat16 (or float16) base the adapters are float32, as peft makes them: the frozen base
costs 2 bytes per parameter, and what trains keeps float32 weights and AdamW state; the adapters'
matmuls run in the input's bf16 (fp32 masters, bf16 compute: ``lora_update``).

The adapter lives *inside* the base module as children ``lora_A`` / ``lora_B`` (peft's names
once its adapter name is dropped: ``...q_proj.lora_A.weight``) and runs from a forward hook, so
the base module keeps its class, its parameter names and its forward. A tensor-parallel style
that wraps the base's forward with input/output conversions therefore hands the hook the
converted input (e.g. the all-gathered, replicated DTensor) and the not yet converted output
(column shards, or partial sums before the all-reduce): ``parallel/lora.py`` lays A and
B out to match, and the update rides on the base layer's own collective.

``add_lora`` freezes every base parameter (``requires_grad=False``: no gradient, no optimizer
state, no FSDP gradient reduce-scatter) and adds adapters to the ``nn.Linear`` modules whose
name ends with one of the targets (peft's rule: ``name == t`` or ``name.endswith("." + t)``).

Why not peft's ``LoraLayer``: peft wraps the base (``q_proj.base_layer``), which renames every
base weight and moves the module torch's ``ColwiseParallel``/``RowwiseParallel`` and our Mamba
head split act on; its forward adds the update after the base layer's output conversion, i.e.
after the TP all-reduce, so a row-parallel update would need its own collective. peft is used
for the adapter file format, its config and merging (``train/run/adapters.py``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridpar.config_rules import quoted
from hybridpar.models.arguments import python_number
from hybridpar.models.names import canonical_name
from hybridpar.models.lora_experts import adapt_experts, adapter_child, expert_lora_modules, expert_targets
from hybridpar.models.token_dropout import TokenDropout, dropout_tokens

__all__ = ["DEFAULT_TARGETS", "LORA_PARAMETERS", "add_lora", "adapter_dtype", "adapter_settings", "refuse_adapters", "lora_modules", "is_lora_parameter",
           "target_matches", "lora_update", "lora_forward_hook"]

# attention q/k/v/o, the (gated) MLP, the Mamba mixer's projections; transformers models use the
# same names (Llama, Mistral, Qwen, Bamba, NemotronH, Falcon-H1's feed_forward); Phi: add dense, fc1, fc2
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj", "out_proj")
LORA_PARAMETERS = ("lora_A", "lora_B")


def target_matches(name: str, target: str) -> bool:
    """peft's module-name rule: the whole name, or its last dotted atoms."""
    return name == target or name.endswith("." + target)


def is_lora_parameter(name: str) -> bool:
    """Whether a parameter name belongs to an adapter (``...q_proj.lora_A.weight``)."""
    return any(f".{atom}." in f".{name}" for atom in LORA_PARAMETERS)


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: base module}`` of every module carrying an adapter, by its single-device name (under activation
    checkpointing too: an export named ``layers.0._checkpoint_wrapped_module.q_proj``, which no base has)."""
    return {canonical_name(name): m for name, m in model.named_modules() if getattr(m, "lora_scaling", None) is not None}


def refuse_adapters(model: nn.Module, state: dict | None, caller: str) -> None:
    """ValueError when the weights to export (``state``, else ``model``'s) hold LoRA adapters: a plain checkpoint
    wrote their ``lora_A``/``lora_B`` tensors, which transformers drops as unexpected keys (the update lost)."""
    if any(map(is_lora_parameter, state)) if state is not None else adapter_settings(model) is not None:
        raise ValueError(f"{caller}: the weights hold LoRA adapters, which a plain checkpoint cannot carry "
                         "(transformers drops lora_A/lora_B as unexpected keys); export with export_lora(model, out_dir, "
                         "canonical_state_dict(model), merge=True) for merged weights, or merge=False for the adapter.")


def adapter_settings(model: nn.Module) -> dict | None:
    """``{"r", "alpha", "dtype", "dropout"}`` of ``model``'s adapters (one set for all: ``add_lora``),
    read from a linear adapter or, with experts only, an expert adapter; None without adapters."""
    linear = next(iter(lora_modules(model).values()), None)
    if linear is not None:
        return {"r": linear.lora_rank, "alpha": linear.lora_scaling * linear.lora_rank,
                "dtype": linear.lora_A.weight.dtype, "dropout": float(getattr(linear.lora_dropout, "p", 0.0))}
    experts = next(iter(expert_lora_modules(model).values()), None)
    if experts is None:
        return None
    factors = getattr(experts, adapter_child(experts.lora_parameters[0]))
    return {"r": factors.rank, "alpha": factors.scaling * factors.rank, "dtype": factors.lora_A.weight.dtype,
            "dropout": 0.0}


def adapter_dtype(base_dtype: torch.dtype) -> torch.dtype:
    """The adapters' dtype on a base of ``base_dtype``: float32 on a 16-bit base (peft's
    ``autocast_adapter_dtype``), else the base's."""
    return torch.float32 if base_dtype in (torch.bfloat16, torch.float16) else base_dtype


def lora_update(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``(alpha / r) * B(A(dropout(x)))``: [..., in] -> [..., r] -> [..., out].

    A bf16 input of float32 adapters runs their matmuls in bf16 under autocast (fp32 masters, as
    FSDP's bf16 policy gives them): the saved input is the base layer's own, not a float32 copy
    of ``[tokens, in]`` per adapter."""
    x = module.lora_dropout(x)
    weight_dtype = module.lora_A.weight.dtype  # under FSDP's bf16 policy: the gathered bf16 copy
    if x.dtype == weight_dtype:
        return module.lora_B(module.lora_A(x)) * module.lora_scaling
    if x.dtype.itemsize > weight_dtype.itemsize:
        return module.lora_B(module.lora_A(x.to(weight_dtype))) * module.lora_scaling
    with torch.autocast(x.device.type, dtype=x.dtype):
        return module.lora_B(module.lora_A(x)) * module.lora_scaling


def lora_forward_hook(module: nn.Module, args, output):
    return output + lora_update(module, args[0]).to(output.dtype)


def _linear_targets(model: nn.Module, targets: tuple[str, ...] | None) -> dict[str, nn.Linear]:
    """Target ``nn.Linear`` modules by name; ``None``: the defaults the model has (at least one)."""
    if targets is None:
        present = tuple(t for t in DEFAULT_TARGETS if any(target_matches(n, t) and isinstance(m, nn.Linear)
                                                          for n, m in model.named_modules()))
        targets = present or DEFAULT_TARGETS[:1]
    names = {}
    for target in targets:
        found = {n: m for n, m in model.named_modules() if n and target_matches(n, target)}
        linear = {n: m for n, m in found.items() if isinstance(m, nn.Linear) and n.split(".")[-1] != "lm_head"}
        if found and not linear and all(n.split(".")[-1] == "lm_head" for n in found):
            raise ValueError(f"peft.target_modules entry {target!r} names the LM head, which LoRA here leaves alone "
                             "(it is vocab-parallel); drop it from peft.target_modules.")
        if not linear:
            kinds = sorted({type(m).__name__ for m in found.values()})
            what = f"only non-Linear modules ({kinds})" if found else "no module"
            examples = sorted({n.split(".")[-1] for n, m in model.named_modules()
                               if isinstance(m, nn.Linear) and not n.endswith("lm_head")})
            stacked = sorted({f"{n.split('.')[-1]}.{k}" for n, m in found.items()  # MoE experts: [E, out, in] weights
                              for k, w in m.named_parameters(recurse=False) if w.dim() == 3})
            experts = f"; its stacked expert weights are adapted by peft.target_parameters=[{','.join(stacked)}]" if stacked else ""
            raise ValueError(f"peft.target_modules entry {target!r} matches {what} of {type(model).__name__}; "
                             f"use names of its linear layers, e.g. {examples[:12]}{experts}.")
        names.update(linear)
    return names


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def add_lora(model: nn.Module, *, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             targets: tuple[str, ...] | list[str] | None = None, seed: int | None = None,
             target_parameters: tuple[str, ...] | list[str] | None = None) -> list[str]:
    """Freeze ``model`` and add a LoRA adapter to every target ``nn.Linear``; returns their names
    (then the adapted stacked parameters' ``<module>.<parameter>`` names).

    ``targets``: module names (peft's rule), each of which must match an ``nn.Linear``; None: those
    of ``DEFAULT_TARGETS`` the model has; empty: none (with ``target_parameters``: experts only). Run before ``parallelize`` (adapters are laid out with
    their base layer there). A target matching no ``nn.Linear``, ``r < 1`` or ``r`` above a target's smaller side is a
    ``ValueError``. ``target_parameters``: stacked MoE expert weights by ``<module>.<parameter>``
    (peft's ``target_parameters``, e.g. ``experts.gate_up_proj``), adapted per expert (``lora_experts.py``).
    """
    if not isinstance(model, nn.Module):  # add_lora("x"): an AttributeError
        raise ValueError(f"add_lora takes the model (an nn.Module), got {quoted(model, 60)} (type {type(model).__name__}).")
    r, alpha, dropout, seed = map(python_number, (r, alpha, dropout, seed))  # np.int64(4) is 4
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"peft.r={r!r} is invalid: the LoRA rank must be an integer >= 1; e.g. peft.r=8.")
    if not _number(dropout) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"peft.dropout={quoted(dropout)} is invalid: it must be in [0, 1); e.g. peft.dropout=0.0.")
    if not _number(alpha) or not (math.isfinite(alpha) and alpha > 0):  # 0: no update; negative: subtracted
        raise ValueError(f"peft.alpha={quoted(alpha)} is invalid: the update's scale alpha/r needs a finite number > 0; "
                         "e.g. peft.alpha=16 (twice peft.r=8).")
    for key, names in (("target_modules", targets), ("target_parameters", target_parameters)):
        if isinstance(names, str):  # iterated letter by letter ('q', '_', ...) before
            raise ValueError(f"peft.{key}={quoted(names)} is a string; pass a list of names, e.g. [{quoted(names, 40)}].")
    if targets is not None and not targets and not target_parameters:
        raise ValueError("peft.target_modules is empty and peft.target_parameters is not set: nothing would train; name "
                         "at least one linear layer, e.g. [q_proj, v_proj], or expert weights in peft.target_parameters.")
    if adapter_settings(model):
        raise ValueError(f"{type(model).__name__} already has LoRA adapters; add_lora runs once per model.")
    if getattr(model, "_parallel_dims", None) is not None or getattr(model, "_tp_mesh", None) is not None:
        raise ValueError("add_lora runs on the single-device model, before parallelize(); call it first.")
    if target_parameters and dropout:
        raise ValueError(f"peft.dropout={dropout!r} with peft.target_parameters: an expert adapter is folded into the "
                         "weight, so its input cannot be dropped (peft refuses it too); set peft.dropout=0.")
    chosen = _linear_targets(model, None if targets is None else tuple(targets))
    if target_parameters:
        expert_targets(model, tuple(target_parameters))  # a bad name fails before anything changes
    narrow, layer = min(((min(m.in_features, m.out_features), n) for n, m in chosen.items()), default=(r, None))
    if r > narrow:  # B @ A has rank <= the layer's smaller side: the rest only costs memory (r=1e8: out of memory)
        raise ValueError(f"peft.r={r} is larger than the smaller side of the target layer {layer} ({narrow}): an "
                         f"adapter's update has rank at most {narrow}, so the rest trains nothing and costs memory; "
                         f"use peft.r <= {narrow} (8-64 is usual) or leave that layer out of peft.target_modules.")
    for param in model.parameters():
        param.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    for name, linear in chosen.items():
        weight = linear.weight
        dtype = adapter_dtype(weight.dtype)
        a = nn.Linear(linear.in_features, r, bias=False, device=weight.device, dtype=dtype)
        b = nn.Linear(r, linear.out_features, bias=False, device=weight.device, dtype=dtype)
        with torch.no_grad():
            bound = 1.0 / math.sqrt(linear.in_features)  # kaiming_uniform_(a=sqrt(5)), as peft and nn.Linear
            a.weight.copy_(torch.empty(a.weight.shape, dtype=torch.float64).uniform_(-bound, bound, generator=generator))
            b.weight.zero_()
        linear.lora_A, linear.lora_B = a, b
        linear.lora_dropout = nn.Identity() if dropout == 0 else TokenDropout(  # keyed by token (token_dropout.py)
            dropout, f"{name}.lora_dropout", dropout_tokens(model, seed or 0),
            fix="set peft.dropout=0 or leave this module out of peft.target_modules")
        linear.lora_scaling = float(alpha) / r
        linear.lora_rank = r
        linear.register_forward_hook(lora_forward_hook)
    experts = adapt_experts(model, tuple(target_parameters), r=r, alpha=alpha, dtype_of=adapter_dtype,
                            generator=generator) if target_parameters else []
    return sorted(chosen) + experts
