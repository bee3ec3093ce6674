"""Make a plan: validate a run as ``train`` does, then price its layout (``Plan``), or give a
transformers model its parameter share (``TransformersPlan``)."""


from __future__ import annotations

import resource
from dataclasses import dataclass

from hybridpar.config import RunConfig
from hybridpar.plan.estimate import H100, DeviceFigures, TimeEstimate, estimate_time
from hybridpar.plan.layout import Layout
from hybridpar.plan.memory import MemoryPlan, memory_plan
from hybridpar.plan.params import parameter_count
from hybridpar.plan.traffic import by_kind, by_kind_and_dim, step_traffic

__all__ = ["Plan", "TransformersPlan", "make_plan", "plan_layout", "parameter_count", "DeviceFigures", "H100", "GPU_BASELINE_GIB"]

GPU_BASELINE_GIB = 1.0  # CUDA context + NCCL buffers per rank: an estimate, not measured here


@dataclass
class Plan:
    layout: Layout
    memory: MemoryPlan
    traffic: dict  # source -> Tally
    time: TimeEstimate
    device: DeviceFigures

    @property
    def traffic_by_kind(self) -> dict[str, int]:
        return by_kind(self.traffic)

    @property
    def traffic_by_kind_and_dim(self) -> dict[str, int]:
        return by_kind_and_dim(self.traffic)


def cpu_baseline_gib() -> float:
    """Resident memory of this process (the interpreter, torch and hybridpar imported): what a
    CPU rank holds before its first tensor."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def plan_layout(layout: Layout, device: DeviceFigures = H100, docs_per_pack: int = 1) -> Plan:
    """The plan of an already validated layout (used by the search)."""
    memory = memory_plan(layout)
    traffic = step_traffic(layout, docs_per_pack)
    time = estimate_time(layout, memory.saved_bytes, by_kind_and_dim(traffic), device)
    return Plan(layout, memory, traffic, time, device)


def make_plan(run: RunConfig, world_size: int | None = None, device: DeviceFigures = H100,
              docs_per_pack: int = 1) -> Plan | TransformersPlan:
    """Validate ``run`` as ``train`` does (``ValueError`` with train's message) and plan it; a
    transformers model gets its parameter share only (``TransformersPlan``)."""
    from hybridpar.models.hybrid import HybridConfig
    from hybridpar.train.preflight import validate_layout

    model = validate_layout(run, world_size)
    if not isinstance(model, HybridConfig):
        return TransformersPlan.build(run, model)
    return plan_layout(Layout.from_run(run, model), device, docs_per_pack)


@dataclass
class TransformersPlan:
    """What the planner says about a transformers model: its size and each rank's share of it
    (the memory and traffic model covers ``HybridLM``'s blocks only)."""

    name: str
    parameters: int
    parameters_per_rank: int
    layout: str

    @classmethod
    def build(cls, run: RunConfig, shape) -> "TransformersPlan":
        from hybridpar.train.preflight import meta_model

        meta = meta_model(shape)
        p = run.parallel
        params = sum(t.numel() for t in meta.parameters())
        return cls(type(meta).__name__, params, -(-params // (p.tp * p.dp_shard * p.cp)),
                   f"dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} cp={p.cp} tp={p.tp} "
                   f"sequence_parallel={p.sequence_parallel}")

    def as_dict(self) -> dict:
        return {"model": {"class": self.name, "parameters": self.parameters}, "layout": self.layout,
                "parameters_per_rank": self.parameters_per_rank,
                "note": "memory and traffic are modelled for HybridLM configs only"}

    def text(self) -> str:
        per_rank = self.parameters_per_rank
        return (f"model: {self.name} (transformers), {self.parameters / 1e6:,.1f}M parameters\n"
                f"layout: {self.layout}\n"
                f"per rank: {per_rank / 1e6:,.1f}M parameters; fp32 params + grads + AdamW = "
                f"{per_rank * 16 / 2**30:,.2f} GiB (memory and traffic are modelled for HybridLM configs only)")
