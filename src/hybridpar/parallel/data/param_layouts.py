"""The tensor-parallel layout of every parameter: sharded or replicated, and on which dim.

``parameter_layouts(model)`` reads each parameter in the order of Megatron's
``_detect_parallelism_type`` (Megatron-FSDP / Megatron-Bridge), with the parameter-level rule
of Megatron PR #4467 (seed 002) placed before the norm-name fallback, and DTensor placements
(what ``apply_tp`` leaves) read first. The first rule that decides wins:

1. ``dtensor``: a DTensor's placement on a TP-named mesh dim (``Shard(d)`` or
   ``_StridedShard(d)``: sharded on d; else replicated). FSDP's data-parallel dims are ignored.
2. ``fused_norm``: ``TELayerNormColumnParallelLinear`` fuses a LayerNorm into a column-parallel
   linear: ``layer_norm_weight`` / ``layer_norm_bias`` are replicated, its other
   parameters column-parallel (dim 0).
3. ``module_type``: the class name is a known TP class: column-parallel (``ColumnParallelLinear``,
   ``TEColumnParallelLinear``, grouped and attention variants: dim 0), row-parallel
   (``RowParallelLinear``, ``TERowParallelLinear``, grouped: dim 1, bias replicated), or
   replicated (``TENorm``, ``FusedLayerNorm``, ``LayerNorm``, ``RMSNorm``, ``TopKRouter``, ...).
4. ``module_attr``: the owning module's ``tensor_model_parallel`` (False: replicated) and
   ``partition_dim`` (0: column, 1: row, bias replicated). A module with
   ``tensor_model_parallel=True`` but no ``partition_dim`` (or another value) does not
   decide: the later rules do.
5. ``param_attr``: the parameter's own ``tensor_model_parallel`` / ``partition_dim`` (Megatron's
   Mamba mixer marks ``A_log``, ``D``, conv weights and its norm weight this way); False:
   replicated; True without a usable ``partition_dim``: undecided.
6. ``norm_name``: a class name containing ``Norm`` or ``Normalization``: replicated.
7. ``parallel_mode``: a ``TELinear``'s ``parallel_mode``: "column" (dim 0), "row" (dim 1, bias
   replicated), anything else replicated.
8. ``default``: replicated.

A sharded dim past the parameter's rank (a row-parallel bias) means replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["Layout", "parameter_layouts", "MODULE_TP_DIMS", "REPLICATED_MODULE_TYPES"]


@dataclass(frozen=True)
class Layout:
    """TP layout of one parameter: ``sharded`` on ``dim`` (None when replicated), and the rule
    that decided it: "dtensor", "fused_norm", "module_type", "module_attr", "param_attr",
    "norm_name", "parallel_mode", "default"."""

    sharded: bool
    dim: int | None
    source: str


# Known tensor-parallel module classes (by class name) -> the dim their weights are split on.
MODULE_TP_DIMS: dict[str, int] = {
    **dict.fromkeys(("ColumnParallelLinear", "TEColumnParallelLinear", "TELayerNormColumnParallelLinear",
                     "TEColumnParallelGroupedLinear", "VocabParallelEmbedding", "DotProductAttention",
                     "TEDotProductAttention"), 0),
    **dict.fromkeys(("RowParallelLinear", "TERowParallelLinear", "TERowParallelGroupedLinear"), 1),
}
REPLICATED_MODULE_TYPES = frozenset(("TENorm", "FusedLayerNorm", "WrappedTorchNorm", "LayerNorm", "RMSNorm", "L2Norm",
                                     "IdentityOp", "TopKRouter"))
_FUSED_NORM_PARAMS = ("layer_norm_weight", "layer_norm_bias")


def _dtensor_layout(param, tp_dim_names) -> Layout | None:
    """Layout from the placement on a TP-named mesh dim; None if the mesh has none (e.g. FSDP-only)."""
    if not isinstance(param, DTensor):
        return None
    names = param.device_mesh.mesh_dim_names or ()
    for mesh_dim, name in enumerate(names):
        if name in tp_dim_names:
            placement = param.placements[mesh_dim]
            if isinstance(placement, (Shard, _StridedShard)):
                return Layout(True, placement.dim % param.ndim, "dtensor")
            return Layout(False, None, "dtensor")
    return None


def _dim_layout(param, dim: int, source: str) -> Layout:
    """Sharded on ``dim`` if the parameter has that dim, else replicated (row-parallel biases)."""
    if dim < 0 or param.ndim <= dim:
        return Layout(False, None, source)
    return Layout(True, dim, source)


def _class_layout(module: nn.Module, param_name: str, param) -> Layout | None:
    kind = type(module).__name__
    if kind == "TELayerNormColumnParallelLinear" and param_name.endswith(_FUSED_NORM_PARAMS):
        return Layout(False, None, "fused_norm")
    if kind in MODULE_TP_DIMS:
        return _dim_layout(param, MODULE_TP_DIMS[kind], "module_type")
    if kind in REPLICATED_MODULE_TYPES:
        return Layout(False, None, "module_type")
    return None


def _attribute_layout(obj, param, source: str, dims=None) -> Layout | None:
    """Megatron convention: ``tensor_model_parallel`` (bool) and ``partition_dim`` on ``obj``;
    None (undecided) when sharded without a ``partition_dim`` in ``dims`` (any dim if None)."""
    if not hasattr(obj, "tensor_model_parallel"):
        return None
    if not obj.tensor_model_parallel:
        return Layout(False, None, source)
    dim = getattr(obj, "partition_dim", None)
    if not isinstance(dim, int) or dim < 0 or (dims is not None and dim not in dims):
        return None
    return _dim_layout(param, dim, source)


def _parallel_mode_layout(module: nn.Module, param) -> Layout | None:
    if type(module).__name__ != "TELinear":
        return None
    mode = getattr(module, "parallel_mode", None)
    if mode in ("column", "row"):
        return _dim_layout(param, 0 if mode == "column" else 1, "parallel_mode")
    return Layout(False, None, "parallel_mode")


def _layout(module: nn.Module, param_name: str, param, tp_dim_names) -> Layout:
    kind = type(module).__name__
    return (
        _dtensor_layout(param, tp_dim_names)
        or _class_layout(module, param_name, param)
        or _attribute_layout(module, param, "module_attr", dims=(0, 1))
        or _attribute_layout(param, param, "param_attr")
        or (Layout(False, None, "norm_name") if "Norm" in kind or "Normalization" in kind else None)
        or _parallel_mode_layout(module, param)
        or Layout(False, None, "default")
    )


def parameter_layouts(model: nn.Module, tp_dim_names=("tp",)) -> dict[str, Layout]:
    """The TP layout of every parameter of ``model`` by name (rule order: module docstring).

    A DTensor mesh dim counts as tensor-parallel when its name is in ``tp_dim_names`` (plus
    the name of the mesh ``apply_tp`` used, if the model has one). Tied parameters are
    listed once, under their first name.
    """
    tp_mesh = getattr(model, "_tp_mesh", None)
    tp_dim_names = tuple(tp_dim_names) + tuple(getattr(tp_mesh, "mesh_dim_names", None) or ())
    layouts: dict[str, Layout] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{param_name}" if module_name else param_name
            layouts[name] = _layout(module, param_name, param, tp_dim_names)
    return layouts
