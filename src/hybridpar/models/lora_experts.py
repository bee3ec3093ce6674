"""LoRA on transformers' stacked MoE experts (``peft.target_parameters``; single-device code).

transformers keeps the experts of a layer as 3-D parameters, ``gate_up_proj [E, 2I, D]`` (or
``up_proj [E, I, D]``) and ``down_proj [E, D, I]``, ``[E, in, out]`` when ``is_transposed`` (peft's reading,
``peft_transposed``: Llama 4's experts, transposed without the flag, are adapted as peft adapts them). Each
adapted parameter gets peft's ``ParamWrapper`` factors, per expert ``e`` a rank-``r`` update::

    lora_A.weight [r*E, in]     A_e = A[e*r:(e+1)*r]          (rows: expert-major)
    lora_B.weight [out, r*E]    B_e = B[:, e::E]              (columns: expert-minor)
    W_e + (alpha / r) * B_e @ A_e                              ([out, in]; transposed: its transpose)

The factors live in a child ``lora_<parameter>`` of the experts module (``experts.lora_gate_up_proj
.lora_A.weight``; a concatenated gate_up's B as ``lora_B.weight_gate`` / ``weight_up``, fused back
by ``canonical_state_dict``: ``GateUpB``; peft's file nests them as ``experts[.base_layer].lora_A.weight``,
``models/hf/lora_export.py``), float32 on a 16-bit base, with peft's init (A Kaiming-uniform, B zero).

The experts' forward is switched (``adapt_experts``) to one that puts the effective weight
``W + delta`` in place of each adapted parameter for the call and restores it afterwards, so every
experts implementation transformers dispatches to (eager loop, batched, grouped mm) computes
with it, and a TP style's or FSDP's hooks around the call see the module as they left it (the
switched forward runs after every pre-hook, before every post-hook). The frozen base gets no
gradient. Cost: per adapted parameter and layer, the effective weight (weight-sized, base dtype)
is kept by the experts' matmuls until backward, plus a transient weight-sized delta (adapter dtype)
and its gradient in backward; activation checkpointing drops the kept one. Dropout cannot be
applied (the update is folded into the weight; peft refuses it too).
"""

from __future__ import annotations

import difflib
import math
import types

import torch
from torch import nn

from hybridpar.models.names import canonical_name

__all__ = ["ExpertLoRA", "GateUpB", "stacked_parameters", "expert_targets", "adapt_experts", "expert_lora_modules",
           "expert_delta", "adapter_child", "experts_transposed", "peft_transposed", "peft_names",
           "peft_target_parameters"]

MARK = "_hybridpar_expert_lora"


def experts_transposed(module: nn.Module) -> bool:
    """Whether a grouped experts module stores ``[E, in, out]`` (``gate_up_proj [E, D, 2I]``, ``down_proj [E, I, D]``)
    rather than transformers' usual ``[E, out, in]``: its ``is_transposed`` flag, else the shapes (Llama 4's
    ``Llama4TextExperts`` is transposed without the flag): a concatenated ``gate_up_proj`` is ``2I`` wide where
    ``down_proj`` is ``I``; ``up_proj`` against ``down_proj`` by the module's ``hidden_size``."""
    flag = getattr(module, "is_transposed", None)
    if flag is not None:
        return bool(flag)
    down, gate_up = module._parameters["down_proj"], module._parameters.get("gate_up_proj")
    if gate_up is not None and getattr(module, "is_concatenated", True):
        return gate_up.shape[2] == 2 * down.shape[1] and gate_up.shape[1] == down.shape[2]
    hidden = getattr(module, "hidden_size", None)
    return isinstance(hidden, int) and down.shape[1] != down.shape[2] and down.shape[2] == hidden


def peft_transposed(module: nn.Module) -> bool:
    """Whether peft's ``ParamWrapper`` reads the stacked weights as ``[E, in, out]``: the ``is_transposed``
    flag alone. Llama 4's experts, transposed without it, are adapted as ``[E, out, in]`` (their ``2I``/``I``
    dim as ``in``): a rank-``r`` update of each expert all the same, and the adapter file peft loads."""
    return bool(getattr(module, "is_transposed", False))


def adapter_child(parameter: str) -> str:
    """The child of the experts module holding ``parameter``'s factors."""
    return f"lora_{parameter}"


def expert_delta(a: torch.Tensor, b: torch.Tensor, num_experts: int, scaling: float,
                 transposed: bool) -> torch.Tensor:
    """``scaling * B_e @ A_e`` per expert in the weight's layout: a [r*E, in], b [out, r*E] ->
    [E, out, in] ([E, in, out] when ``transposed``); shards of ``in`` (a) or ``out`` (b) give that shard."""
    a = a.reshape(num_experts, -1, a.shape[-1])  # [E, r, in]
    b = b.reshape(b.shape[0], -1, num_experts).permute(2, 0, 1)  # [E, out, r]
    delta = torch.bmm(b, a) * scaling  # [E, out, in]
    return delta.transpose(1, 2) if transposed else delta


class GateUpB(nn.Module):
    """``lora_B`` of a concatenated ``gate_up_proj`` ([2I, r*E] = [gate | up] rows) stored as two
    parameters ``weight_gate``, ``weight_up`` [I, r*E], so tensor parallelism shards each by rows
    (``Shard(0)``, composing with FSDP's) where the fused rows would need a strided shard;
    ``canonical_state_dict`` fuses them back to ``lora_B.weight`` (``fused_parameters``)."""

    def __init__(self, out_features: int, columns: int, device, dtype):
        super().__init__()
        half = out_features // 2
        self.component_sizes = {"gate": half, "up": half}
        self.weight_gate = nn.Parameter(torch.zeros(half, columns, device=device, dtype=dtype))
        self.weight_up = nn.Parameter(torch.zeros(half, columns, device=device, dtype=dtype))

    def fused_parameters(self) -> dict[str, list[str]]:
        return {"weight": ["weight_gate", "weight_up"]}

    @property
    def weight(self) -> torch.Tensor:
        """[gate | up] rows (under TP: this rank's of each, as the weight's local shard)."""
        return torch.cat([self.weight_gate, self.weight_up], dim=0)


class ExpertLoRA(nn.Module):
    """The factors of one stacked parameter ``[E, d1, d2]`` (peft's ``ParamWrapper`` layout)."""

    def __init__(self, weight: torch.Tensor, r: int, alpha: float, transposed: bool, dtype: torch.dtype,
                 generator: torch.Generator | None = None, gate_up: bool = False):
        super().__init__()
        experts, d1, d2 = weight.shape
        in_features, out_features = (d1, d2) if transposed else (d2, d1)
        self.lora_A = nn.Linear(in_features, r * experts, bias=False, device=weight.device, dtype=dtype)
        self.lora_B = GateUpB(out_features, r * experts, weight.device, dtype) if gate_up else \
            nn.Linear(r * experts, out_features, bias=False, device=weight.device, dtype=dtype)
        with torch.no_grad():
            bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)), as peft's nn.Linear
            self.lora_A.weight.copy_(torch.empty(self.lora_A.weight.shape, dtype=torch.float64)
                                     .uniform_(-bound, bound, generator=generator))
            for param in self.lora_B.parameters():
                param.zero_()
        self.num_experts, self.rank, self.scaling, self.transposed = experts, r, float(alpha) / r, transposed
        self.factor_hooks: dict = {}  # {"lora_A"|"lora_B": callable on the (local) weight}: set by TP pairing

    def delta(self, dtype: torch.dtype) -> torch.Tensor:
        """The update in the (local) weight's layout, cast to the base ``dtype`` (as peft does)."""
        a, b = self.lora_A.weight, self.lora_B.weight
        a = self.factor_hooks["lora_A"](a) if "lora_A" in self.factor_hooks else a
        b = self.factor_hooks["lora_B"](b) if "lora_B" in self.factor_hooks else b
        return expert_delta(a, b, self.num_experts, self.scaling, self.transposed).to(dtype)


def _adapted_forward(self, *args, **kwargs):
    saved = {}
    try:
        for name in self.lora_parameters:
            weight = self._parameters[name]  # plain, FSDP-unsharded or the TP-local shard: whatever hooks left
            saved[name] = weight
            self._parameters[name] = weight + getattr(self, adapter_child(name)).delta(weight.dtype)
        return self._hybridpar_experts_forward(*args, **kwargs)
    finally:
        self._parameters.update(saved)


def stacked_parameters(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """``{"<module>.<parameter>": (module, parameter)}`` of every 3-D parameter (Conv1d aside)."""
    return {f"{m}.{n}": (module, n) for m, module in model.named_modules() if not isinstance(module, nn.Conv1d)
            for n, p in module.named_parameters(recurse=False) if p.dim() == 3 and not n.startswith("lora_")}


def expert_targets(model: nn.Module, targets) -> dict[str, tuple[nn.Module, str]]:
    """The stacked parameters ``targets`` name (peft's rule on ``<module>.<parameter>``); each
    target must match one, else ``ValueError`` with the names the model has."""
    stacked = stacked_parameters(model)
    known = sorted({".".join(n.split(".")[-2:]) for n in stacked})
    chosen = {}
    for target in targets:
        found = {n: v for n, v in stacked.items() if n == target or n.endswith("." + target)}
        if not found:
            close = difflib.get_close_matches(str(target), known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"peft.target_parameters entry {target!r} matches no stacked (3-D) parameter of "
                             f"{type(model).__name__}; {hint}its stacked parameters are {known[:8] or 'none'}.")
        chosen.update(found)
    for name, (module, _) in chosen.items():  # expert biases (GPT-OSS) stay as they are: only weights are adapted
        if getattr(module, "has_post_expert_norm", False):
            raise ValueError(f"peft.target_parameters: {name.rpartition('.')[0]} has a post-expert norm, which LoRA "
                             "here does not adapt; leave it out of peft.target_parameters.")
    return chosen


def adapt_experts(model: nn.Module, targets, *, r: int, alpha: float, dtype_of, generator=None) -> list[str]:
    """Add factors to each stacked parameter ``targets`` names and switch its module's forward;
    returns the adapted ``<module>.<parameter>`` names. The base must already be frozen."""
    chosen = expert_targets(model, targets)
    narrow, where = min((min(p.shape[1:]), n) for n, (m, p_name) in chosen.items() for p in [m._parameters[p_name]])
    if r > narrow:
        raise ValueError(f"peft.r={r} is larger than the smaller side of the expert weight {where} ({narrow}): each "
                         f"expert's update has rank at most {narrow}; use peft.r <= {narrow} or leave it out of "
                         "peft.target_parameters.")
    for name, (module, parameter) in chosen.items():
        weight = module._parameters[parameter]
        transposed = peft_transposed(module)
        # [gate | up] are rows of B where the adapter's out is the weight's 2I dim (not Llama 4's: peft reads it as in)
        gate_up = parameter == "gate_up_proj" and getattr(module, "is_concatenated", True) and \
            transposed == experts_transposed(module)
        module.add_module(adapter_child(parameter), ExpertLoRA(weight, r, alpha, transposed, dtype_of(weight.dtype),
                                                               generator, gate_up))
    for module in {id(m): m for m, _ in chosen.values()}.values():
        order = [n for n, p in module._parameters.items() if p is not None]  # peft nests wrappers in this order
        module.lora_parameters = tuple(n for n in order if hasattr(module, adapter_child(n)))
        if not getattr(module, MARK, False):
            module._hybridpar_experts_forward = module.forward
            module.forward = types.MethodType(_adapted_forward, module)
            setattr(module, MARK, True)
    return sorted(chosen)


def expert_lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: experts module}`` of every module whose stacked parameters carry adapters, by its single-device
    name (activation checkpointing's wrapper atoms dropped, as ``lora.lora_modules``)."""
    return {canonical_name(n): m for n, m in model.named_modules() if getattr(m, MARK, False)}


def peft_names(model: nn.Module) -> dict[str, str]:
    """``{our adapter name: peft's}`` for the expert adapters: peft nests one ``ParamWrapper`` per
    parameter in the module's parameter order, the last outermost (``experts.lora_A.weight``), each
    earlier one a ``base_layer.`` deeper (``experts.base_layer.lora_A.weight``)."""
    names = {}
    for path, module in expert_lora_modules(model).items():
        adapted = module.lora_parameters
        for i, parameter in enumerate(adapted):
            for factor in ("lora_A", "lora_B"):
                names[f"{path}.{adapter_child(parameter)}.{factor}.weight"] = \
                    f"{path}.{'base_layer.' * (len(adapted) - 1 - i)}{factor}.weight"
    return names


def peft_target_parameters(model: nn.Module) -> list[str]:
    """peft's ``target_parameters`` for the adapted stacked weights: ``<module>.<parameter>``, full names (peft
    matches a name or its last atoms, so ``experts.down_proj`` would adapt every layer's)."""
    return sorted(f"{path}.{p}" for path, m in expert_lora_modules(model).items() for p in m.lora_parameters)
