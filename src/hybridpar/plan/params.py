"""Parameters, gradients and AdamW state each rank holds.

The parameter list is ``step_comm.unit_parameters`` (the TP-local shapes of every FSDP unit, the
list the collective closed forms use, tested against the real model). FSDP2 shards dim 0 of
every parameter over ``P_f = dp_shard * cp`` ranks; rank 0 holds the largest shard::

    N_rank  = sum_p ceil(d0_p / P_f) * prod(rest_p)          (P_f = 1 without FSDP)
    persistent = N_rank * e_p * (1 param + 1 grad + 2 AdamW)  (fp32 master with bf16 compute too)
    gathered(u) = sum_{p in u} numel_p * e_fsdp              one unit's unsharded parameters
                                                             (e_fsdp = 2 under bf16, else e_p)

HSDP replicates the shards over ``dp_replicate`` (no change per rank). With several packs per
rank FSDP accumulates *unsharded* gradients until the last pack (one reduction per step), so
during accumulation a rank holds ``sum_u numel_u * e_p`` of gradients instead of ``N_rank * e_p``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpar.models.hybrid import HybridConfig
from hybridpar.parallel.comm.step import unit_parameters
from hybridpar.plan.layout import Layout

__all__ = ["parameter_count", "ParameterMemory", "parameter_memory"]


def parameter_count(config: HybridConfig) -> int:
    """Parameters of the whole ``HybridLM`` (no model is built)."""
    return sum(math.prod(p.shape) for unit in unit_parameters(config).values() for p in unit)


@dataclass(frozen=True)
class ParameterMemory:
    total: int  # parameters of the model
    per_rank: int  # N_rank, the elements this rank stores
    unit_numel: dict  # TP-local unsharded elements per FSDP unit ("" = root: embeddings, norm_f, lm_head)
    param_bytes: int  # N_rank * e_p
    grad_bytes: int  # sharded (reduced) gradients
    optimizer_bytes: int  # AdamW exp_avg + exp_avg_sq
    gather_bytes_per_element: int  # e_fsdp
    element_bytes: int  # e_p

    def gathered(self, unit: str) -> int:
        return self.unit_numel[unit] * self.gather_bytes_per_element

    @property
    def unsharded_grad_bytes(self) -> int:
        """Gradients of every unit before FSDP reduces them (kept while accumulating)."""
        return sum(self.unit_numel.values()) * self.element_bytes


def parameter_memory(layout: Layout) -> ParameterMemory:
    units = unit_parameters(layout.model, layout.tp, layout.sequence_parallel)
    shard = layout.shard
    per_rank = sum(math.ceil(p.shape[0] / shard) * math.prod(p.shape[1:]) for u in units.values() for p in u)
    unit_numel = {name: sum(math.prod(p.shape) for p in params) for name, params in units.items()}
    e_p = layout.param_bytes
    gather = 2 if layout.mixed_precision == "bf16" else e_p
    return ParameterMemory(parameter_count(layout.model), per_rank, unit_numel, per_rank * e_p, per_rank * e_p,
                           2 * per_rank * e_p, gather, e_p)
