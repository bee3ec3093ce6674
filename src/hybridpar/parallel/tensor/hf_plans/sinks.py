"""Tensor (+sequence) parallelism of the attention-sink models other than GPT-OSS: Granite-SWA,
Granite-MoE-SWA, MiMo-V2-Flash and Flint, by heads.

An attention sink is one logit per query head ``sinks [Hq]`` added to the softmax's denominator
(``models/attention/sinks.py``). Column-parallel q/k/v give rank ``r`` the query heads
``[r Hq/tp, (r+1) Hq/tp)`` (and their KV heads), so the sinks are ``Shard(0)`` and each rank's
attention reads its ``[Hq/tp]`` (``HeadShardedSinks``, as GPT-OSS's plan); a head's sink gradient
comes from its rank alone, no collective. Per layer::

    x [B, S, D] (SP: all-gathered from [B, S/tp, D]) -> q, k, v column-parallel [B, S, h d | hk d | hk dv]
      -> attention on h = Hq/tp heads with sinks [h] -> o_proj row-parallel: partial [B, S, D]
      -> all-reduce -> [B, S, D]   (SP: reduce-scatter -> [B, S/tp, D])

The MLPs and MoE blocks are sharded as elsewhere (``decoder_plan``, ``moe.moe_block_plan``: experts on
their intermediate dim, routers replicated). MiMo-V2-Flash's values have their own head dim
(``v_head_dim``) and its sliding layers twice the KV heads of its full layers (only those have sinks):
its ``v_proj`` is split by KV heads (``ValueHeadParallel``). Exactness (float64 loss and every
gradient against one process, tp=2 and tp=2 + SP): ``tests/distributed/tensor/hf/test_hf_sinks_tp.py``.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from hybridpar.parallel.tensor.decoder import decoder_plan
from hybridpar.parallel.tensor.hf_plans.dense import llama_plan, register_hf_plan
from hybridpar.parallel.tensor.linear_styles import HeadShardedSinks, _require
from hybridpar.parallel.tensor.moe import moe_blocks_plan, moe_decoder_plan
from hybridpar.parallel.tensor.styles import LocalReplicateParallel

__all__ = ["ValueHeadParallel", "with_head_sharded_sinks", "granite_swa_plan", "granitemoe_swa_plan",
           "mimo_v2_flash_plan", "flint_plan"]


class ValueHeadParallel(ParallelStyle):
    """``ColwiseParallel`` for a value projection ``[heads * dv, D]`` whose head dim ``dv`` is not the
    attention's ``head_dim`` (MiMo-V2-Flash): rank ``r`` computes heads ``[r heads/tp, (r+1) heads/tp)``,
    ``[B, S, heads dv / tp]``. The plan check's head rule reads ``head_dim``, so ``heads % tp`` is checked here."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        _require(isinstance(module, nn.Linear) and module.out_features % self.heads == 0, name,
                 f"a value projection of {self.heads} heads needs an nn.Linear with a multiple of {self.heads} outputs")
        _require(self.heads % tp == 0, name, f"{self.heads} value heads are not divisible by tp={tp}; "
                 f"use a tp that divides {self.heads}")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(type(module).__name__, module, device_mesh.size())
        return ColwiseParallel()._apply(module, device_mesh)


def with_head_sharded_sinks(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` plus ``HeadShardedSinks`` on every layer's attention that holds sinks."""
    for index, layer in enumerate(model.model.layers):
        if isinstance(getattr(layer.self_attn, "sinks", None), nn.Parameter):
            plan[f"model.layers.{index}.self_attn"] = HeadShardedSinks()
    return plan


@register_hf_plan("granite_swa", "GraniteSWAForCausalLM")
def granite_swa_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Granite-SWA: Granite's (Llama's) plan, sinks by head."""
    return with_head_sharded_sinks(model, llama_plan(model, sequence_parallel))


@register_hf_plan("granitemoe_swa", "GraniteMoeSWAForCausalLM")
def granitemoe_swa_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Granite-MoE-SWA: attention by heads with sinks; MoE blocks (``block_sparse_moe``, router ``router``
    replicated) and the optional shared MLP, whose fused ``[gate | up]`` ``input_linear`` is gathered
    before the chunk (as Granite 4.0-H's)."""
    plan = decoder_plan(sequence_parallel, mlp="shared_mlp", mlp_in=("input_linear",), gather_mlp=True,
                        mlp_out="output_linear", shared_norm_output=True)
    plan.update(moe_blocks_plan(model, sequence_parallel, "block_sparse_moe"))
    plan.update({f"model.layers.{i}.block_sparse_moe.router": LocalReplicateParallel()
                 for i in range(len(model.model.layers))})
    return with_head_sharded_sinks(model, plan)


@register_hf_plan("mimo_v2_flash", "MiMoV2FlashForCausalLM")
def mimo_v2_flash_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """MiMo-V2-Flash: attention by heads (values by KV heads of ``v_head_dim``, ``ValueHeadParallel``),
    sinks on the sliding layers; dense MLPs and MoE blocks (router ``gate`` replicated)."""
    plan = moe_decoder_plan(model, sequence_parallel)
    del plan["model.layers.*.self_attn.v_proj"]  # per layer: the KV heads differ
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        plan[f"model.layers.{index}.self_attn.v_proj"] = ValueHeadParallel(
            attention.v_proj.out_features // attention.v_head_dim)
    return with_head_sharded_sinks(model, plan)


@register_hf_plan("flint", "FlintForCausalLM")
def flint_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Flint: attention by heads with per-head q/k norms (local heads, gradients summed over TP) and sinks;
    dense MLPs and MoE blocks (router ``gate`` replicated, the ungated shared expert column/row)."""
    return with_head_sharded_sinks(model, moe_decoder_plan(model, sequence_parallel, head_norms=("q_norm", "k_norm")))
