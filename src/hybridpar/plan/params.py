"""Parameters, gradients and AdamW state each rank holds.

The parameter list is ``step_comm.unit_parameters`` (the TP-local shapes of every FSDP unit, the
list the collective closed forms use, tested against the real model). FSDP2 shards dim 0 of
every parameter over ``P_f = dp_shard * cp`` ranks; rank 0 holds the largest shard::

    N_rank  = sum_p ceil(d0_p / P_f) * prod(rest_p)          (P_f = 1 without FSDP)
    persistent = N_rank * e_p * (1 param + 1 grad + 2 AdamW)  (fp32 master with bf16 compute too)
    gathered(u) = sum_{p in u} numel_p * e_fsdp              one unit's unsharded parameters
                                                             (e_fsdp = 2 under bf16, else e_p; 4 for a
                                                             parameter kept in float32, its own unit)

LoRA (``peft.method=lora``, rank r): the base keeps ``N_rank * e_p`` of frozen parameters and no
gradient or AdamW state; the adapters (``adapter_units``: per adapted linear ``A [r, in]`` and
``B [out, r]``, the TP-sharded factor split like its base) add their own parameters, gradients
and AdamW state (``A_rank``, sharded by FSDP like the rest) at ``e_a`` bytes (4 on a bfloat16
base, whose adapters are float32: ``models.lora.adapter_dtype``; else ``e_p``)::

    persistent = N_rank * e_p + A_rank * e_a * (1 + 1 + 2)

HSDP replicates the shards over ``dp_replicate`` (no change per rank). With several packs per
rank FSDP accumulates *unsharded* gradients until the last pack (one reduction per step), so
during accumulation a rank holds ``sum_u numel_u * e_p`` of gradients instead of ``N_rank * e_p``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from hybridpar.models.hybrid import HybridConfig
from hybridpar.parallel.comm.grad_flow import GradFlow
from hybridpar.parallel.comm.step import ParamShape, unit_parameters
from hybridpar.plan.hf.zamba2 import is_zamba2, zamba2_units
from hybridpar.plan.hf.zamba2_lora import zamba2_lora_linears
from hybridpar.plan.layout import Layout

__all__ = ["model_units", "parameter_count", "ParameterMemory", "parameter_memory", "adapter_units", "adapter_params",
           "grad_flow"]


def model_units(config: HybridConfig, tp: int = 1, sequence_parallel: bool = False) -> dict[str, list[ParamShape]]:
    """``unit_parameters``, or a Zamba2 twin's units (its shared blocks once, ``plan/hf/zamba2.py``)."""
    return (zamba2_units if is_zamba2(config) else unit_parameters)(config, tp, sequence_parallel)


def parameter_count(config: HybridConfig) -> int:
    """Parameters of the whole ``HybridLM`` (no model is built)."""
    return sum(math.prod(p.shape) for unit in model_units(config).values() for p in unit)


@dataclass(frozen=True)
class ParameterMemory:
    total: int  # parameters of the model
    per_rank: int  # N_rank, the elements this rank stores
    unit_numel: dict  # TP-local unsharded elements per FSDP unit ("" = root: embeddings, norm_f, lm_head)
    param_bytes: int  # N_rank * e_p
    grad_bytes: int  # sharded (reduced) gradients
    optimizer_bytes: int  # AdamW exp_avg + exp_avg_sq
    gather_bytes_per_element: int  # e_fsdp
    element_bytes: int  # bytes per element of what trains: e_p, or the adapters' e_a under LoRA
    grad_unit_numel: dict | None = None  # trainable elements per unit (LoRA: the adapters'); None: unit_numel
    adapters: int = 0  # adapter parameters of the model (LoRA)
    adapter_gather_bytes: int = 0  # e_fsdp of the adapters (LoRA): 2 under bf16, else e_a
    float32_unit_numel: dict | None = None  # elements kept in float32 per unit, gathered in 4 bytes under bf16

    def gathered(self, unit: str) -> int:
        adapters = self.grad_unit_numel[unit] if self.grad_unit_numel is not None else 0
        kept = (self.float32_unit_numel or {}).get(unit, 0) * (4 - self.gather_bytes_per_element)
        return (self.unit_numel[unit] - adapters) * self.gather_bytes_per_element + adapters * self.adapter_gather_bytes + kept

    @property
    def trainable_unit_numel(self) -> dict:
        return self.unit_numel if self.grad_unit_numel is None else self.grad_unit_numel

    @property
    def unsharded_grad_bytes(self) -> int:
        """Gradients of every unit before FSDP reduces them (kept while accumulating)."""
        return sum(self.trainable_unit_numel.values()) * self.element_bytes


def _adapted(name: str, targets: tuple[str, ...]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def adapter_units(layout: Layout) -> dict[str, list[tuple[int, ...]]]:
    """TP-local shapes of the LoRA factors per FSDP unit (``adapter_params``' shapes)."""
    return {unit: [p.shape for p in params] for unit, params in adapter_params(layout).items()}


def grad_flow(layout: Layout) -> GradFlow:
    """Where a gradient reaches (``parallel/comm/grad_flow.py``): everywhere, or under LoRA from the
    first adapter on."""
    return _grad_flow(*_adapter_key(layout))


def adapter_params(layout: Layout) -> dict[str, list[ParamShape]]:
    """The LoRA factors per FSDP unit as ``parallel/lora.py`` lays them out, named
    ``<linear>.lora_A``/``lora_B``: column-parallel base (q/k/v, gate/up, Mamba in_proj per
    component): ``A [r, in]`` replicated, ``B [out/tp, r]`` sharded; row-parallel base (o, down,
    out_proj): ``A [r, in/tp]`` sharded, ``B [out, r]`` replicated (``tp_sharded`` marks the sharded
    factor; the replicated one's gradient is all-reduced over TP)."""
    return {unit: list(params) for unit, params in _adapter_params(*_adapter_key(layout)).items()}


def _adapter_key(layout: Layout) -> tuple:
    c = layout.model
    shape = tuple(getattr(c, f.name) for f in dataclasses.fields(c))
    return type(c), shape, layout.tp, layout.lora_rank, layout.lora_targets, layout.lora_parameters


@functools.lru_cache(maxsize=64)  # asked per block and again for every layout of a --fit search
def _grad_flow(kind: type, shape: tuple, tp: int, r: int, targets: tuple, stacked: tuple) -> GradFlow:
    blocks = len(kind(*shape).pattern)
    return GradFlow.of_adapters(_adapter_params(kind, shape, tp, r, targets, stacked), blocks) if r else GradFlow.full(blocks)


@functools.lru_cache(maxsize=64)
def _adapter_params(kind: type, shape: tuple, tp: int, r: int, targets: tuple,
                    stacked: tuple) -> dict[str, tuple[ParamShape, ...]]:
    c = kind(*shape)
    d, out = c.hidden_size, {}
    d_inner = c.mamba_intermediate_size
    width = 2 * d_inner + 2 * c.mamba_n_groups * c.ssm_state_size + c.mamba_num_heads
    mamba = {"in_proj": (d, width, "col"), "out_proj": (d_inner, d, "row")}
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention = {"q_proj": (d, q, "col"), "k_proj": (d, kv, "col"), "v_proj": (d, kv, "col"), "o_proj": (q, d, "row")}
    sharded = tp > 1
    for index, block in enumerate(c.pattern):
        m = f"backbone.layers.{index}.mixer"
        if block in "M*P":  # P: a twin's parallel layer (Falcon-H1), both mixers
            linears = {**(mamba if block in "MP" else {}), **(attention if block in "*P" else {})}
        elif block == "Z":  # a Zamba2 shared block's use: its copy's linears and its layer's linear
            linears = zamba2_lora_linears(c)
        elif block == "E" or getattr(c, "mlp_fused", False):  # a twin's MoE block: its shared experts' linears
            linears = _shared_mlp(c, c.moe_shared_size if block == "E" else c.intermediate_size)
        else:
            linears = {"up_proj": (d, c.intermediate_size, "col"), "down_proj": (c.intermediate_size, d, "row")}
            if c.mlp_gated:
                linears["gate_proj"] = (d, c.intermediate_size, "col")
        params = []
        for name, (fan_in, fan_out, style) in linears.items():
            if not _adapted(f"{m}.{name}", targets):
                continue
            if style == "whole":  # a linear TP leaves whole: both factors replicated
                params += [ParamShape(f"{m}.{name}.lora_A", (r, fan_in), False),
                           ParamShape(f"{m}.{name}.lora_B", (fan_out, r), False)]
                continue
            col = style == "col"
            in_proj = name == "in_proj"  # its replicated factors sum over TP in autograd (parallel/lora.py)
            params.append(ParamShape(f"{m}.{name}.lora_A", (r, fan_in) if col else (r, fan_in // tp), sharded and not col,
                                     tp_sum_in_autograd=in_proj))
            if in_proj:  # B per component, like the base (one B/C group: those rows whole on every rank)
                params += [ParamShape(f"{m}.in_proj.lora_B.weight_{part}", (rows // div, r), div > 1,
                                      tp_sum_in_autograd=div == 1) for part, rows, div in _in_proj_parts(c, tp)]
            else:
                params.append(ParamShape(f"{m}.{name}.lora_B", (fan_out // tp, r) if col else (fan_out, r), sharded and col))
        if block == "E":
            params += _expert_factors(c, f"{m}.experts", r, tp, stacked)
        out[f"backbone.layers.{index}"] = tuple(params)
    return out


def _expert_factors(c, m: str, r: int, tp: int, stacked: tuple) -> list[ParamShape]:
    """Factors of the adapted stacked expert weights (``models/lora_experts.py``, ``peft.target_parameters``),
    TP as ``parallel/lora.py`` pairs them: the factor on the intermediate dim ``I`` sharded like the
    weight, the other replicated (its gradient summed over TP in autograd): ``gate_up_proj``/``up_proj``
    ``A [r E, D]``, ``B [2I/tp, r E]`` (gated: ``weight_gate``, ``weight_up`` [I/tp, r E]);
    ``down_proj`` ``A [r E, I/tp]``, ``B [D, r E]``."""
    re, inter, sharded = r * c.moe_experts, c.moe_intermediate_size, tp > 1
    d = getattr(c, "moe_latent_size", 0) or c.hidden_size  # the experts' width (NemotronH's latent L)
    up = "gate_up_proj" if c.moe_gated else "up_proj"
    params = []
    if _adapted(f"{m}.{up}", stacked):
        params.append(ParamShape(f"{m}.lora_{up}.lora_A", (re, d), False, tp_sum_in_autograd=True))
        parts = ("weight_gate", "weight_up") if c.moe_gated else ("weight",)
        params += [ParamShape(f"{m}.lora_{up}.lora_B.{part}", (inter // tp, re), sharded) for part in parts]
    if _adapted(f"{m}.down_proj", stacked):
        params += [ParamShape(f"{m}.lora_down_proj.lora_A", (re, inter // tp), sharded),
                   ParamShape(f"{m}.lora_down_proj.lora_B", (d, re), False, tp_sum_in_autograd=True)]
    return params


def _shared_mlp(c, size: int) -> dict[str, tuple[int, int, str]]:
    """The linears of a twin's shared MLP of intermediate ``size``, by transformers' names (the routed
    experts are stacked parameters, not linears: ``peft.target_parameters``, which the twins do not plan):
    Granite's fused ``shared_mlp`` (``input_linear [2 Is, D]``, ``output_linear``), NemotronH's
    ``shared_experts`` (``up_proj``, ``down_proj``)."""
    d = c.hidden_size
    if not size:
        return {}
    if c.mlp_fused:
        return {"shared_mlp.input_linear": (d, 2 * size, "col"), "shared_mlp.output_linear": (size, d, "row")}
    return {"shared_experts.up_proj": (d, size, "col"), "shared_experts.down_proj": (size, d, "row")}


def _in_proj_parts(c, tp: int) -> list[tuple[str, int, int]]:
    """``(component, rows, ranks it is split over)`` of a Mamba2 ``in_proj`` (``z, x, B, C, dt``)."""
    from hybridpar.models.mamba.mixer import replicated_groups

    gn, bc = c.mamba_n_groups * c.ssm_state_size, 1 if replicated_groups(c.mamba_n_groups, tp) else tp
    d_inner = c.mamba_intermediate_size
    return [("z", d_inner, tp), ("x", d_inner, tp), ("B", gn, bc), ("C", gn, bc), ("dt", c.mamba_num_heads, tp)]


def parameter_memory(layout: Layout) -> ParameterMemory:
    units = model_units(layout.model, layout.tp, layout.sequence_parallel)
    shard = layout.shard
    per_rank = sum(math.ceil(p.shape[0] / shard) * math.prod(p.shape[1:]) for u in units.values() for p in u)
    unit_numel = {name: sum(math.prod(p.shape) for p in params) for name, params in units.items()}
    e_p = layout.param_bytes
    gather = 2 if layout.mixed_precision == "bf16" else e_p
    kept = {name: sum(math.prod(p.shape) for p in params if p.float32) for name, params in units.items()} if gather < 4 else None
    if not layout.lora_rank:
        return ParameterMemory(parameter_count(layout.model), per_rank, unit_numel, per_rank * e_p, per_rank * e_p,
                               2 * per_rank * e_p, gather, e_p, float32_unit_numel=kept)
    adapters = adapter_units(layout)
    adapter_rank = sum(math.ceil(s[0] / shard) * math.prod(s[1:]) for u in adapters.values() for s in u)
    adapter_numel = {name: sum(math.prod(s) for s in adapters.get(name, ())) for name in unit_numel}
    full = adapter_units(dataclasses.replace(layout, dims=dataclasses.replace(layout.dims, tp=1)))
    e_a = layout.adapter_bytes
    return ParameterMemory(parameter_count(layout.model), per_rank + adapter_rank,
                           {n: unit_numel[n] + adapter_numel[n] for n in unit_numel}, per_rank * e_p + adapter_rank * e_a,
                           adapter_rank * e_a, 2 * adapter_rank * e_a, gather, e_a, adapter_numel,
                           sum(math.prod(s) for u in full.values() for s in u),
                           2 if layout.mixed_precision == "bf16" else e_a, kept)
