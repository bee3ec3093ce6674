"""Full, layout-free parameter and gradient dicts of a parallelized model, and their inverse.

``canonical_state_dict(model)`` maps the single-device names (``model.named_parameters()`` of
the unparallelized model: tied weights once, no buffers) to full tensors, whatever was applied:

- DTensors (TP, FSDP, FSDP+TP, HSDP) are gathered with ``full_tensor()``; a ``Partial``
  gradient is summed. This is a collective: every rank of the model's meshes must call it,
  and every rank gets the full dict.
- Parameters stored per component (``tp_hybrid.SplitInProj`` / ``SplitConv1d``, or any
  module with ``fused_parameters()`` and ``component_sizes``) are concatenated back into the
  fused tensor, e.g. ``in_proj.weight = cat(weight_z, weight_x, weight_B, weight_C, weight_dt)``
  in Hugging Face row order.
- Wrapper atoms (``_checkpoint_wrapped_module``, ``_fsdp_wrapped_module``, ``_orig_mod``) are
  dropped from names.

``load_canonical_state_dict(model, state)`` copies such full tensors into a parallelized model,
each rank keeping its own shard (no communication: every rank holds the full tensors).

Both first reshard every FSDP module that a forward left gathered (the root after a forward
without backward, e.g. evaluation): a gathered module's parameters are FSDP's compute copies,
bf16 under mixed precision, and a value copied into them never reaches the float32 shards.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from hybridpar.models.names import WRAPPER_ATOMS, canonical_name

__all__ = ["WRAPPER_ATOMS", "canonical_name", "canonical_state_dict", "load_canonical_state_dict"]



def _components(model: nn.Module) -> dict[str, tuple[str, int, list[int]]]:
    """``{component parameter name: (canonical fused name, position, full rows of each part)}``."""
    out = {}
    for module_name, module in model.named_modules():
        fused = getattr(module, "fused_parameters", None)
        if fused is None:
            continue
        sizes = list(module.component_sizes.values())
        for fused_name, parts in fused().items():
            full_name = canonical_name(f"{module_name}.{fused_name}" if module_name else fused_name)
            for position, part in enumerate(parts):
                out[f"{module_name}.{part}" if module_name else part] = (full_name, position, sizes)
    return out


def _full(t: Tensor) -> Tensor:
    """A copy of the whole tensor on this rank (all-gather / sum over the DTensor's mesh), detached."""
    if not isinstance(t, DTensor):
        return t.detach().clone()
    full = t.full_tensor().detach()
    if full.untyped_storage().data_ptr() == t._local_tensor.untyped_storage().data_ptr():
        full = full.clone()  # Replicate: full_tensor() is the local tensor itself
    return full


@torch.no_grad()
def _check_module(model, caller: str) -> None:
    """One line before any collective: ``model`` must be an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"{caller} takes the model (an nn.Module), got {type(model).__name__}.")


def reshard_gathered(model: nn.Module) -> None:
    """Reshard every FSDP module of ``model`` (a no-op for one already sharded): its parameters are the
    float32 shards again, not the compute copies a forward gathered."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def canonical_state_dict(model: nn.Module, grads: bool = False) -> dict[str, Tensor]:
    """Full tensors under single-device names (see the module docstring); ``grads=True`` gives
    the same for ``.grad`` (parameters without a gradient are left out). Collective."""
    _check_module(model, "canonical_state_dict")
    reshard_gathered(model)
    components = _components(model)
    out: dict[str, Tensor | None] = {}
    parts: dict[str, dict[int, Tensor]] = {}
    for name, param in model.named_parameters():
        value = param.grad if grads else param
        if value is None:
            continue
        full = _full(value)
        if name in components:
            fused_name, position, _ = components[name]
            out.setdefault(fused_name, None)  # keep the fused tensor where its first part was
            parts.setdefault(fused_name, {})[position] = full
        else:
            out[canonical_name(name)] = full
    for fused_name, pieces in parts.items():
        expected = len(next(sizes for n, (f, _, sizes) in components.items() if f == fused_name))
        if len(pieces) != expected:
            raise ValueError(f"{fused_name}: only parts {sorted(pieces)} of {expected} have "
                             f"{'gradients' if grads else 'values'}; a fused tensor needs all of them.")
        out[fused_name] = torch.cat([pieces[i] for i in range(expected)], dim=0)
    return out


def _shard_like(full: Tensor, param: DTensor) -> Tensor:
    """This rank's local shard of ``full`` under ``param``'s mesh and placements (no communication)."""
    mesh = param.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, param.placements).to_local()


@torch.no_grad()
def load_canonical_state_dict(model: nn.Module, state: dict[str, Tensor], strict: bool = True) -> None:
    """Copy full canonical tensors (``canonical_state_dict``'s format) into ``model``'s
    parameters, sharded like each parameter. ``strict``: every key used, every parameter set.
    Every tensor is checked before the first is copied: a refused state leaves the model as it was."""
    _check_module(model, "load_canonical_state_dict")
    reshard_gathered(model)
    if not isinstance(state, dict):
        raise ValueError(f"load_canonical_state_dict: state must be a dict of name -> tensor, got {type(state).__name__}.")
    pairs = _state_pairs(model, state, strict)
    for param, full in pairs:
        full = full.to(device=param.device, dtype=param.dtype)
        if isinstance(param, DTensor):
            param.to_local().copy_(_shard_like(full, param))
        else:
            param.copy_(full)


def _state_pairs(model: nn.Module, state: dict, strict: bool) -> list[tuple[Tensor, Tensor]]:
    """``(parameter, full tensor)`` for each parameter ``state`` sets; ValueError for a value that is not a tensor,
    a shape unlike the parameter's, and (``strict``) a key missing or unused."""
    components = _components(model)
    used, missing, pairs = set(), [], []
    for name, param in model.named_parameters():
        key, position, sizes = components.get(name, (canonical_name(name), None, None))
        source = state.get(key)
        if source is not None and not isinstance(source, Tensor):  # a numpy array was "has no attribute 'to'"
            raise ValueError(f"load_canonical_state_dict: state[{key!r}] is a {type(source).__name__}, not a "
                             "torch.Tensor; pass tensors (torch.from_numpy(array) for a numpy array).")
        if position is not None and source is not None and (source.dim() == 0 or source.shape[0] != sum(sizes)):
            raise ValueError(f"{key}: state tensor has shape {tuple(source.shape)}, its rows are not the model's "
                             f"{sum(sizes)} (full shape); load a state of the same model config.")
        full = source if source is None or position is None else source.split(sizes, dim=0)[position]
        if full is None:
            missing.append(key)
            continue
        used.add(key)
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(f"{key}: state tensor has shape {tuple(full.shape)} but the parameter {name} is "
                             f"{tuple(param.shape)} (full shape); load a state of the same model config.")
        pairs.append((param, full))
    unexpected = sorted(set(state) - used)
    if strict and (missing or unexpected):
        raise ValueError(f"canonical state does not match the model: missing {_some(sorted(set(missing)))}, "
                         f"unexpected {_some(unexpected)}; pass strict=False to load a subset.")
    return pairs


def _some(names: list[str]) -> str:
    """``names`` for a one-line message: the count and the first three."""
    return f"{len(names)} {names[:3]}" + (" ..." if len(names) > 3 else "")
