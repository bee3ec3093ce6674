"""The plan as text (``hybridpar plan``) and as one JSON object (``hybridpar plan --json``)."""

from __future__ import annotations

import json

from hybridpar.config import RunConfig

from hybridpar.plan.planner import GPU_BASELINE_GIB, Plan, TransformersPlan, cpu_baseline_gib, make_plan

__all__ = ["plan_dict", "plan_text", "print_plan", "GIB"]

GIB = 2**30


def plan_dict(plan: Plan, target: str = "gpu") -> dict:
    """JSON-ready: per-rank peak and its parts, parameters, traffic per kind (and per mesh dim), time."""
    m, layout = plan.memory, plan.layout
    baseline = cpu_baseline_gib() if target == "cpu" else GPU_BASELINE_GIB
    return {
        "model": {"pattern": layout.model.pattern, "parameters": m.params.total,
                  **({"transformers": plan.model_name} if plan.model_name else {})},
        "layout": {"dp_replicate": layout.dims.dp_replicate, "dp_shard": layout.dims.dp_shard, "cp": layout.cp,
                   "tp": layout.tp, "sequence_parallel": layout.sp, "cp_attention": layout.cp_attention,
                   "cp_mamba": layout.cp_mamba, "activation_checkpointing": layout.checkpointing,
                   "mixed_precision": layout.mixed_precision, "pack_size": layout.pack_size,
                   "packs_per_rank": layout.packs_per_rank},
        "parameters_per_rank": m.params.per_rank,
        "peak_memory_gib_per_rank": m.peak_bytes / GIB,
        "peak_moment": m.peak_moment,
        "peak_breakdown_gib": {k: v / GIB for k, v in m.breakdown.items()},
        "baseline_gib": baseline,
        "baseline_is": "this process's resident memory (CPU)" if target == "cpu" else "CUDA context + NCCL (estimate)",
        "saved_activation_bytes_per_pack": {**m.saved_by_kind, "total": m.saved_bytes},
        "state_bytes": {"parameters": m.params.param_bytes, "gradients": m.params.grad_bytes,
                        "optimizer": m.params.optimizer_bytes},
        "traffic_bytes_per_step": plan.traffic_by_kind,
        "traffic_bytes_per_step_by_dim": plan.traffic_by_kind_and_dim,
        "estimate": {"device": plan.device.name, "step_s": plan.time.step_s, "compute_s": plan.time.compute_s,
                     "memory_s": plan.time.memory_s, "comm_s": plan.time.comm_s, "tflop_per_step": plan.time.flops / 1e12,
                     "matmul_precision": plan.layout.matmul_precision,
                     "note": "an estimate from the stated device figures, not a measurement"},
    }


def _bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def plan_text(plan: Plan, target: str = "gpu") -> str:
    d = plan_dict(plan, target)
    m, layout = plan.memory, plan.layout
    lines = [
        (f"model: {plan.model_name}, " if plan.model_name else "model: ")
        + f"pattern {layout.model.pattern} ({len(layout.model.pattern)} blocks), {m.params.total:,} parameters",
        f"layout: {layout.describe()} -> {layout.dims.world_size} ranks; {layout.pack_size:,} tokens per pack, "
        f"{layout.packs_per_rank} pack(s) per rank per step, {layout.dtype}"
        + (f", mixed precision {layout.mixed_precision}" if layout.mixed_precision else ""),
        f"per rank: {m.params.per_rank:,} parameters; params {_bytes(m.params.param_bytes)}, grads "
        f"{_bytes(m.params.grad_bytes)}, AdamW {_bytes(m.params.optimizer_bytes)}"
        + (f" (LoRA r={layout.lora_rank}: {m.params.adapters:,} adapter parameters train, the base is frozen"
           f"{_first_gradient(layout)})" if layout.lora_rank else ""),
        "saved for backward per pack: " + ", ".join(f"{k} {_bytes(v)}" for k, v in m.saved_by_kind.items())
        + f" (total {_bytes(m.saved_bytes)})",
        f"peak: {_bytes(d['peak_memory_gib_per_rank'] * GIB)} per rank at {m.peak_moment}: "
        + ", ".join(f"{k} {_bytes(v)}" for k, v in m.breakdown.items()),
        f"baseline (not in the peak): {d['baseline_gib']:.2f} GiB, {d['baseline_is']}",
        "traffic per step per rank: " + (", ".join(f"{k} {_bytes(v)}" for k, v in d["traffic_bytes_per_step_by_dim"].items())
                                         or "none"),
        _time_line(plan),
    ]
    return "\n".join(lines)


def _first_gradient(layout) -> str:
    """Under LoRA, where the first adapter sits when blocks before it run no backward."""
    from hybridpar.plan.params import grad_flow

    reached = grad_flow(layout).output
    first = reached.index(True) if any(reached) else None
    if not first:
        return ""
    return (f"; the first adapter is in block {first}: the {first} block(s) before it keep nothing and run "
            "no backward")


def _scaled(value: float, units: tuple[tuple[float, str], ...]) -> tuple[float, str]:
    """``(scale, unit)``: the largest unit ``value`` reaches (the smallest for a smaller value; the
    largest for 0)."""
    if value == 0:
        return units[0]
    return next(((scale, unit) for scale, unit in units if abs(value) >= scale), units[-1])


def _number(value: float) -> str:
    """One decimal, or two significant digits for a value that one decimal would show as 0.0."""
    return f"{value:,.1f}" if value == 0 or abs(value) >= 0.05 else f"{value:.2g}"


def time_and_flops(step_s: float, flops: float) -> tuple[tuple[float, str], str]:
    """The time unit for ``step_s`` (``(seconds per unit, name)``: ms, µs or ns) and ``flops`` written
    in TFLOP, GFLOP, MFLOP or kFLOP: a small model's estimate is never printed as 0.0."""
    time_unit = _scaled(step_s, ((1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")))
    scale, unit = _scaled(flops, ((1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "kFLOP")))
    return time_unit, f"{_number(flops / scale)} {unit}"


def duration(seconds: float) -> str:
    """``seconds`` in ms, µs or ns (``time_and_flops``' unit for it)."""
    (scale, unit), _ = time_and_flops(seconds, 0.0)
    return f"{_number(seconds / scale)} {unit}"


def _time_line(plan: Plan) -> str:
    t = plan.time
    (scale, unit), flops = time_and_flops(t.step_s, t.flops)
    return (f"time (ESTIMATE, {plan.device.name}): {_number(t.step_s / scale)} {unit} per step = compute "
            f"{_number(t.compute_s / scale)} + memory {_number(t.memory_s / scale)} + communication "
            f"{_number(t.comm_s / scale)} {unit} ({flops} per rank, matmuls in {plan.layout.matmul_precision})")


def plan_json(plan: Plan, target: str = "gpu") -> str:
    return json.dumps(plan_dict(plan, target), indent=2)


def print_plan(run: RunConfig, world_size: int | None = None) -> None:
    """Print the text plan (``hybridpar plan``); refuses an invalid layout as ``train`` does."""
    plan = make_plan(run, world_size)
    print(plan.text() if isinstance(plan, TransformersPlan) else plan_text(plan))
