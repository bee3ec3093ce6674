"""``hybridpar plan``: what a layout costs per rank, before anything runs.

For a run config and a world size: parameters, gradients and AdamW state (``params``), bytes kept
for backward per block kind under the checkpointing policy (``activations``; under LoRA ``lora``), the largest
workspaces (``transients``), the peak of a steady-state step (``memory``), bytes per collective
kind and mesh dim (``traffic``, from ``parallel.comm.step``), a step-time estimate (``estimate``)
and the layouts that fit a memory budget (``search``). Nothing is built but a ``meta`` model for
validation (``train.preflight.validate_layout``, the same rules and messages as ``train``); no
process group starts.

May import ``config``, ``models/``, ``parallel/`` and ``train/`` (its preflight rules); imported by
``api`` and ``cli``.
"""

from hybridpar.plan.planner import (  # noqa: F401
    Plan, TransformersPlan, make_plan, plan_layout, parameter_count, DeviceFigures, H100, GPU_BASELINE_GIB, cpu_baseline_gib,
)
from hybridpar.plan.report import print_plan  # noqa: F401

__all__ = ["Plan", "TransformersPlan", "make_plan", "plan_layout", "print_plan", "parameter_count", "DeviceFigures", "H100", "GPU_BASELINE_GIB"]
