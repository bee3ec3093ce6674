"""Mixed precision at every layout, and TF32 for float32 matmuls on CUDA.

``parallel.mixed_precision=bf16`` means fp32 master weights and optimizer state, bf16 matmuls
and fp32 where precision decides (norm statistics, attention softmax/logsumexp, SSD decays and
states, the loss: ``models/precision.py``). Two mechanisms give it, as torchtitan does:

- under FSDP (``dp_shard * cp > 1`` or ``dp_replicate > 1``): FSDP2's ``MixedPrecisionPolicy``
  (parameters gathered in bf16, gradients reduced in fp32; ``data/fsdp.py``); what transformers keeps
  in float32 (``float32_parameters``) is gathered in float32 (``data/fsdp.float32_units``);
- otherwise (one process, TP and/or CP alone): ``apply_autocast`` runs the model's forward in
  ``torch.autocast(bfloat16)`` on the inputs' device type. Parameters stay float32; the
  backward runs in the dtypes autocast chose in the forward.

``set_tf32`` sets torch's float32 matmul and cuDNN conv precision (``"tf32"`` or ``"ieee"``, the
new API; torch refuses a mix with the legacy ``allow_tf32`` flags). It only matters on CUDA;
float64 never uses TF32, and ``hybridpar check`` turns it off.
"""

from __future__ import annotations

import inspect
import re
import types
import warnings

import torch
from torch import nn

from hybridpar.config_rules import Notice

__all__ = ["apply_autocast", "autocast_dtype", "float32_modules", "float32_owners", "float32_parameters", "set_tf32",
           "AUTOCAST_DTYPES"]

AUTOCAST_DTYPES = {"bf16": torch.bfloat16}


def check_autocast_model(model: nn.Module, mixed_precision) -> None:
    """``ValueError`` unless ``mixed_precision`` is a name autocast applies to and what trains is
    float32 (the master weights; a frozen LoRA base may be bfloat16). FSDP's bf16 policy needs the same."""
    if mixed_precision not in AUTOCAST_DTYPES:
        raise ValueError(f"mixed_precision={mixed_precision!r} without FSDP runs through torch.autocast, which "
                         f"takes one of {sorted(AUTOCAST_DTYPES)}; pass 'bf16' (a MixedPrecisionPolicy needs FSDP).")
    # what trains needs float32 masters; a frozen base (LoRA) may stay in bfloat16
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.requires_grad})
    if dtypes and dtypes != ["torch.float32"]:
        raise ValueError(f"mixed_precision={mixed_precision!r} keeps float32 master weights, but the model's "
                         f"trainable parameters are {', '.join(dtypes)}; build the model in float32 (model.dtype="
                         "float32) or train without mixed precision (parallel.mixed_precision=null; None in Python).")


def _device_type(args, kwargs, model: nn.Module) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    for param in model.parameters():
        return param.device.type
    return "cpu"


def _autocast_forward(self, *args, **kwargs):
    with torch.autocast(_device_type(args, kwargs, self), dtype=self._autocast_dtype, cache_enabled=False):
        return self._forward_before_autocast(*args, **kwargs)


def _to_float32(value):
    low = isinstance(value, torch.Tensor) and value.is_floating_point() and value.element_size() < 4
    return value.float() if low else value


def _float32_forward(self, *args, **kwargs):
    """The module's forward with autocast off and its 16-bit floating inputs in float32 (a bf16 ``in_proj`` output
    into a kept ``conv1d``: as a float32 module computes it; a router casts them itself)."""
    with torch.autocast(_device_type(args, kwargs, self), enabled=False):
        return self._forward_before_float32(*map(_to_float32, args), **{k: _to_float32(v) for k, v in kwargs.items()})


def _kept_entries(model: nn.Module) -> tuple[list[str], list[str]]:
    """``(strict, weights)``: the model's ``_keep_in_fp32_modules_strict`` entries (what transformers keeps in float32
    when it loads in bf16) and the ``*.weight`` entries of either list (round 30's routers)."""
    owner = next((m for m in model.modules() if getattr(m, "_keep_in_fp32_modules_strict", None)
                  or getattr(m, "_keep_in_fp32_modules", None)), None)
    if owner is None:
        return [], []
    strict = [e for e in (getattr(owner, "_keep_in_fp32_modules_strict", None) or ()) if isinstance(e, str)]
    loose = [e for e in (getattr(owner, "_keep_in_fp32_modules", None) or ()) if isinstance(e, str)]
    return strict, [e for e in strict + loose if e.endswith(".weight")]


def float32_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters transformers keeps in float32, by name: those an entry of ``_keep_in_fp32_modules_strict``
    matches (``re.search`` of the entry, ``*`` as ``.*``, in the parameter's name, as transformers' loader matches
    them: ``core_model_loading``), and those a ``*.weight`` entry of ``_keep_in_fp32_modules`` matches. Buffers
    (most ``e_score_correction_bias``) are left out: neither autocast nor FSDP casts a buffer."""
    strict, weights = _kept_entries(model)
    patterns = [re.compile(e.replace("*", ".*")) for e in dict.fromkeys(strict + weights)]
    return {name: p for name, p in model.named_parameters() if any(pat.search(name) for pat in patterns)}


def float32_owners(model: nn.Module) -> dict[nn.Module, list[str]]:
    """Each module that directly holds a parameter of ``float32_parameters``, with those parameters' local names."""
    modules, owners = dict(model.named_modules()), {}
    for name in float32_parameters(model):
        path, _, leaf = name.rpartition(".")
        owners.setdefault(modules[path], []).append(leaf)
    return owners


def read_directly(model: nn.Module) -> dict[nn.Module, str]:
    """The owners (``float32_owners``) whose parent's code reads a kept parameter itself (``self.conv1d.weight``
    into ``causal_conv1d_fn``: Bailing-hybrid, GLM5-Next), with ``"Parent.conv1d.weight"``: their own forward never
    runs, so neither autocast-off on it nor an FSDP unit of their own reaches that read."""
    modules, owners, found = dict(model.named_modules()), float32_owners(model), {}
    for name, owner in ((n, m) for n, m in modules.items() if m in owners and n):
        parent_name, _, child = name.rpartition(".")
        try:
            source = inspect.getsource(type(modules[parent_name]))
        except (OSError, TypeError):  # a class defined where no source is kept
            continue
        reads = [leaf for leaf in owners[owner] if f".{child}.{leaf}" in source]
        if reads:
            found[owner] = f"{type(modules[parent_name]).__name__}.{child}.{reads[0]}"
    return found


def float32_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose ``weight`` transformers keeps in float32 (``float32_parameters``): MoE routers
    (``gate.weight``: NemotronH, DeepSeek-V3, GLM4-MoE, Kimi Linear, ...), whose forward casts its input and weight
    to float32 to pick the experts, and a kept ``conv1d`` or linear. They run their matmul with autocast off. A bare
    parameter (``sinks``, ``dt_bias``, ``expert_bias``) is read in elementwise math, float32 under autocast already."""
    return [module for module, leaves in float32_owners(model).items() if "weight" in leaves and module is not model]


def apply_autocast(model: nn.Module, mixed_precision: str = "bf16") -> nn.Module:
    """Run ``model``'s forward under ``torch.autocast(<inputs' device>, dtype)`` (in place).

    The wrapper is a bound method on the instance (``model.forward``), so parameter and module
    names do not change and ``copy.deepcopy`` rebinds it to the copy; ``model._autocast_dtype``
    records the dtype.

    Autocast's cache of bf16 weight copies is off. It only acts on a weight read twice in one forward
    (Zamba2's shared blocks), and there it broke two promises: a selective checkpoint's recomputation
    must dispatch the ops its forward did (the forward cast the shared weights once, each
    recomputation again: torch refused the step), and every checkpointing policy gives the same
    gradients (the cached copy summed its uses' gradients in bf16). Each use now casts its own copy and
    its gradient reaches the float32 weight through it.

    A module whose weight transformers keeps in float32 (``float32_modules``: MoE routers) runs with
    autocast off, as its forward asks: under autocast its ``F.linear`` ran in bf16, and on a tiny NemotronH
    (64 experts, 6 per token, router std 0.02) 9.7% of the tokens got other experts than the float32 router's
    (round 30).
    """
    check_autocast_model(model, mixed_precision)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and head in float32_modules(model):
        warnings.warn(f"{type(model).__name__} keeps lm_head in float32, but hybridpar's loss computes its logits in "
                      f"bf16 matmuls under autocast (models/lm_head_loss.py); train with parallel.mixed_precision=null "
                      "for float32 logits.", Notice, stacklevel=2)
    direct = read_directly(model)
    if bypassed := [direct[m] for m in float32_modules(model) if m in direct]:
        warnings.warn(f"{type(model).__name__} keeps {', '.join(bypassed)} in float32, but its parent reads it "
                      "itself, not through its module, so it runs in bf16 under autocast; train with "
                      "parallel.mixed_precision=null to keep it float32.", Notice, stacklevel=2)
    for module in float32_modules(model):  # routers transformers computes in float32: autocast made them bf16
        module._forward_before_float32 = module.forward
        module.forward = types.MethodType(_float32_forward, module)
    model._autocast_dtype = AUTOCAST_DTYPES[mixed_precision]
    model._forward_before_autocast = model.forward
    model.forward = types.MethodType(_autocast_forward, model)
    return model


def autocast_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype ``apply_autocast`` gave ``model``, or None."""
    return getattr(model, "_autocast_dtype", None)


def set_tf32(enabled: bool) -> None:
    """float32 matmuls and convolutions on CUDA in TF32 (``enabled``) or full IEEE float32."""
    precision = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision
