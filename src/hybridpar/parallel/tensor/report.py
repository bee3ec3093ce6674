"""How much of a model each tensor-parallel rank holds.

For every parameter (tied ones once), its elements on this rank along the TP mesh dim:

    local(p) = numel(p)                                   replicated over TP
    local(p) = numel(p) / size(p, d) * shard_size(d, r)   Shard(d) on TP (uneven vocab shards exact;
                                                          _StridedShard splits evenly)

    fraction = sum_p local(p) / sum_p numel(p)            1.0 = nothing sharded, ~1/tp = everything

Data-parallel (FSDP) dims of a parameter's mesh are not counted. ``apply_tp`` stores the
report on ``model._tp_shard_report``, logs it, and warns when ``fraction > 0.75`` at
``tp >= 2``, naming the largest replicated modules (layer indices folded to ``*``).
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hybridpar.config_rules import Notice

__all__ = ["TPShardReport", "tp_shard_report", "report_tp_sharding", "REPLICATED_WARNING_FRACTION"]

REPLICATED_WARNING_FRACTION = 0.75


@dataclass(frozen=True)
class TPShardReport:
    """``local`` of ``total`` parameter elements on this rank of ``tp``; ``replicated``: the
    largest fully replicated modules as ``(pattern, module count, elements)``, largest first."""

    tp: int
    total: int
    local: int
    replicated: tuple[tuple[str, int, int], ...]

    @property
    def fraction(self) -> float:
        return self.local / self.total if self.total else 1.0

    def __str__(self) -> str:
        top = ", ".join(f"{name} ({count}x, {elements:,} elements)" for name, count, elements in self.replicated[:5])
        return (f"tensor parallel tp={self.tp}: this rank holds {self.local:,} of {self.total:,} parameter elements "
                f"({self.fraction:.1%}); largest replicated modules: {top or 'none'}")


def _tp_mesh_dim(param: DTensor, tp_dim_names) -> int | None:
    names = param.device_mesh.mesh_dim_names or ()
    return next((i for i, name in enumerate(names) if name in tp_dim_names), None)


def _local_and_tp(param, tp_dim_names) -> tuple[int, int, bool]:
    """(elements on this rank along TP, TP size, sharded?) of one parameter."""
    numel = param.numel()
    if not isinstance(param, DTensor):
        return numel, 1, False
    mesh_dim = _tp_mesh_dim(param, tp_dim_names)
    if mesh_dim is None:
        return numel, 1, False
    tp = param.device_mesh.size(mesh_dim)
    placement = param.placements[mesh_dim]
    if not isinstance(placement, (Shard, _StridedShard)):
        return numel, tp, False
    dim = placement.dim % param.ndim
    size = param.shape[dim]
    if isinstance(placement, _StridedShard):  # packed parts, each split evenly
        return numel // tp, tp, True
    shard, _ = Shard.local_shard_size_and_offset(size, tp, param.device_mesh.get_local_rank(mesh_dim))
    return numel // size * int(shard), tp, True


def tp_shard_report(model: nn.Module, tp_dim_names=("tp",)) -> TPShardReport:
    """The report for ``model`` as it is now (see the module docstring)."""
    tp_mesh = getattr(model, "_tp_mesh", None)
    tp_dim_names = tuple(tp_dim_names) + tuple(getattr(tp_mesh, "mesh_dim_names", None) or ())
    total = local = 0
    tp = 1
    replicated_by_module: dict[str, int] = {}
    sharded_by_module: dict[str, int] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param in module._parameters.values():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            here, size, sharded = _local_and_tp(param, tp_dim_names)
            total, local, tp = total + param.numel(), local + here, max(tp, size)
            bucket = sharded_by_module if sharded else replicated_by_module
            bucket[module_name] = bucket.get(module_name, 0) + param.numel()
    return TPShardReport(tp, total, local, _largest_replicated(replicated_by_module, sharded_by_module))


def _largest_replicated(replicated: dict[str, int], sharded: dict[str, int]) -> tuple[tuple[str, int, int], ...]:
    """Outermost modules whose parameters are all replicated, grouped over layer indices."""
    partly_sharded = {".".join(name.split(".")[:i]) for name in sharded for i in range(len(name.split(".")) + 1)}
    outermost: dict[str, int] = {}
    for name, elements in replicated.items():
        atoms = name.split(".") if name else []
        top = next((".".join(atoms[:i]) for i in range(1, len(atoms) + 1)
                    if ".".join(atoms[:i]) not in partly_sharded), None)
        if top is not None:  # else a partly sharded module (a row-parallel bias): not listed
            outermost[top] = outermost.get(top, 0) + elements
    groups: dict[str, list[tuple[str, int]]] = {}
    for name, elements in outermost.items():
        groups.setdefault(re.sub(r"\.\d+(?=\.|$)", ".*", name), []).append((name, elements))
    rows = [((members[0][0] if len(members) == 1 else pattern) or "<root>", len(members), sum(e for _, e in members))
            for pattern, members in groups.items()]
    return tuple(sorted(rows, key=lambda row: -row[2]))


def report_tp_sharding(model: nn.Module, logger: logging.Logger) -> TPShardReport:
    """Compute, log and (above ``REPLICATED_WARNING_FRACTION`` at tp >= 2) warn; return the report."""
    report = tp_shard_report(model)
    logger.info("%s", report)
    if report.tp >= 2 and report.fraction > REPLICATED_WARNING_FRACTION:
        warnings.warn(
            f"{type(model).__name__}: each of tp={report.tp} ranks holds {report.fraction:.0%} of the parameter "
            f"elements (tensor parallelism saves little); largest replicated modules: "
            f"{', '.join(f'{n} ({c}x, {e:,})' for n, c, e in report.replicated[:5])}. Register a plan that shards "
            "them (register_tp_plan) or use FSDP instead", Notice, stacklevel=3)
    return report
