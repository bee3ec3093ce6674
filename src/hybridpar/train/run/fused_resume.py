"""Resume a checkpoint written before a fused weight was stored per component.

A Mamba1 mixer's ``in_proj.weight`` (``[2 Cd, D]``, rows ``[x | z]``) is stored as
``in_proj.weight_x`` and ``in_proj.weight_z`` (``split_mamba1``), as Mamba2's ``in_proj`` and
``conv1d`` are (``SplitInProj``, ``SplitConv1d``). A DCP checkpoint of an older run holds the fused
name only. Within ``with fused_legacy_names(state, path, model):`` each such pair of component
entries of ``state`` (the model's and the optimizer's ``exp_avg``/``exp_avg_sq``) is one
``FusedRows`` under the fused name: the fused global shape, one box per component at its row
offset (plus this rank's shard offset), each a view of the component's local tensor, so
``dcp.load`` copies the stored rows straight into the components. On exit the component entries
are put back; the optimizer's ``step`` and ``param_groups`` are renamed. No communication.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hybridpar.models.names import canonical_name
from hybridpar.parallel.packed_checkpoint import BoxedTensor

__all__ = ["FusedRows", "fused_legacy_names", "legacy_fused_keys"]

def _box(tensor: Tensor, row_offset: int) -> tuple[torch.Size, torch.Size, Tensor]:
    """(global offsets, sizes, local view) of a component's rows on this rank, shifted by its row offset."""
    if isinstance(tensor, DTensor):
        sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        local = tensor._local_tensor.detach()
    else:
        sizes, offsets, local = tensor.shape, [0] * tensor.dim(), tensor.detach()
    offsets = list(offsets)
    offsets[0] += row_offset
    return torch.Size(offsets), torch.Size(sizes), local


class FusedRows(BoxedTensor):
    """Components ``[rows_i, ...]`` as DCP sees their fused ``[sum rows_i, ...]`` tensor (module docstring)."""

    @staticmethod
    def __new__(cls, parts: list[Tensor]):
        shape = torch.Size([sum(p.shape[0] for p in parts), *parts[0].shape[1:]])
        first = parts[0]._local_tensor if isinstance(parts[0], DTensor) else parts[0]
        starts = [sum(p.shape[0] for p in parts[:i]) for i in range(len(parts))]
        boxes = [box for box in (_box(p, s) for p, s in zip(parts, starts)) if box[1].numel() > 0]
        return BoxedTensor._wrap(cls, shape, first, boxes)


def legacy_fused_keys(path: str | Path, model: torch.nn.Module) -> dict[str, list[str]]:
    """``{fused FQN: component FQNs}`` for each split weight whose checkpoint at ``path`` holds only the fused name."""
    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    found = {}
    for name, module in model.named_modules():
        fused = getattr(module, "fused_parameters", None)
        if not callable(fused):
            continue
        prefix = canonical_name(f"{name}." if name else "")
        for kind, components in fused().items():
            keys = [prefix + c for c in components]
            if f"model.{prefix}{kind}" in stored and not any(f"model.{k}" in stored for k in keys):
                found[prefix + kind] = keys
    return found


@contextmanager
def fused_legacy_names(state: dict, path: str | Path, model: torch.nn.Module):
    """Within the block, ``state`` (``{"model": ..., "optim": ...}`` of ``get_state_dict``) names each
    legacy fused weight as the checkpoint does (module docstring); on exit it names the components."""
    legacy = legacy_fused_keys(path, model)
    model_state, optim = state["model"], state.get("optim") or {}
    optim_state = optim.get("state", {})
    saved = []
    for fused, keys in legacy.items():
        if not all(k in model_state for k in keys):
            continue  # a frozen base weight (LoRA): neither saved nor loaded
        saved.append((fused, keys, [model_state.pop(k) for k in keys], [optim_state.pop(k, None) for k in keys]))
        model_state[fused] = FusedRows(saved[-1][2])
        moments = saved[-1][3]
        if all(m is not None for m in moments):
            optim_state[fused] = {name: (FusedRows([m[name] for m in moments]) if name != "step" else moments[0][name])
                                  for name in moments[0]}
    try:
        yield state
    finally:
        for fused, keys, tensors, moments in saved:
            del model_state[fused]
            model_state.update(zip(keys, tensors))
            loaded = optim_state.pop(fused, None)
            for key, moment in zip(keys, moments):
                if moment is not None:
                    if loaded is not None and "step" in moment:
                        moment["step"] = loaded["step"].clone() if isinstance(loaded["step"], Tensor) else loaded["step"]
                    optim_state[key] = moment
            for group in optim.get("param_groups", []):
                params = group.get("params", [])
                if fused in params:
                    at = params.index(fused)
                    group["params"] = params[:at] + keys + params[at + 1:]
