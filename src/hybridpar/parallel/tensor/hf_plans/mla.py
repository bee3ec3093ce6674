"""Tensor (+sequence) parallelism of multi-head latent attention (MLA: DeepSeek-V3, DeepSeek-V2, MiniCPM3,
GLM-4-MoE-Lite) by heads, Megatron's way.

The low-rank down projections are replicated, the up projections column-parallel by heads, ``o_proj``
row-parallel. The attention's input ``x [B, S, D]`` is the input norm's output, one ``Replicate``
DTensor (SP: all-gathered once, ``[B, S/tp, D] -> [B, S, D]``). Per rank, with ``h = H / tp`` heads::

    q:  x -> q_a_proj (replicated) [B, S, Rq] -> q_a_layernorm (replicated) [B, S, Rq]
          -> q_b_proj (column, ColwiseParallel) [B, S, h (dn + dr)]
          backward: d[B, S, Rq] is a partial sum over TP -> all-reduce once, at q_b_proj's input,
          so q_a_layernorm and q_a_proj get full gradients (no q_lora_rank: q_proj column-parallel
          on x, its partial dx summed with the other readers' before the norm's one all-reduce)
    kv: x -> kv_a_proj_with_mqa (replicated) [B, S, Rkv + dr] = [latent | shared rope key]
          -> kv_a_layernorm(latent) (replicated) -> kv_b_proj (column, on local shards) [B, 1, S, h (dn + dv)]
          backward: the latent's gradient (through kv_b_proj's local heads) and the shared rope key's
          (expanded to the local heads only) are both partial sums over TP: they are all-reduced once
          together, ``[B, S, Rkv + dr]`` at kv_a_proj_with_mqa's output (``LatentDownParallel``);
          kv_a_layernorm, between the two, all-reduces its weight's partial gradient ``[Rkv]``
    out: attention on h heads [B, S, h dv] -> o_proj (row) -> partial [B, S, D] -> all-reduce
          (SP: reduce-scatter -> [B, S/tp, D])

transformers' MLA reshapes with ``-1`` heads, so its forward runs unchanged on the local heads. MoE
layers (experts on their intermediate dim, router replicated, shared experts column/row) come from
``moe.moe_block_plan``. Exactness (float64 loss and every gradient against one process):
``tests/distributed/tensor/hf/test_hf_mla_tp.py``.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle

from hybridpar.parallel.tensor.check import validate_tp_sizes
from hybridpar.parallel.tensor.hf_plans.dense import register_hf_plan
from hybridpar.parallel.tensor.linear_styles import _distribute, _require
from hybridpar.parallel.tensor.moe import moe_decoder_plan
from hybridpar.parallel.tensor.styles import (LocalReplicateParallel, replicated_local, restore_params,
                                             swap_in_local_params)

__all__ = ["LatentDownParallel", "LatentUpParallel", "mla_attention_plan", "validate_mla", "deepseek_v3_plan"]


class LatentDownParallel(LocalReplicateParallel):
    """A replicated down projection whose output gradient arrives as a partial sum over TP (its readers
    hold local heads only): forward ``[B, S, R]`` unchanged, backward all-reduced once (``replicated_local``)."""

    pairs_lora = False  # a LoRA hook would add its term after the all-reduce's seam: refused (parallel/lora.py)

    def _restore(self, mesh: DeviceMesh, mod, args, outputs):
        restore_params(mod)
        return replicated_local(outputs, mesh)  # [B, S, R]; backward: partial -> all-reduce


class LatentUpParallel(ParallelStyle):
    """An up projection ``nn.Linear`` column-parallel by heads (weight and bias ``Shard(0)``), computed on
    its local shard: plain ``[.., R]`` -> ``[.., h w]``; its input gradient is left a partial sum over TP
    (summed with the shared rope key's at ``LatentDownParallel``), no collective here."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        _require(self.heads % tp == 0, name, f"{self.heads} attention heads are not divisible by tp={tp}")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(type(module).__name__, module, device_mesh.size())
        _distribute(module, {"weight": Shard(0), "bias": Shard(0)}, device_mesh, self.src_data_rank)
        module.register_forward_pre_hook(lambda mod, args: swap_in_local_params(mod))
        module.register_forward_hook(lambda mod, args, out: restore_params(mod), always_call=True)
        return module


def mla_attention_plan(model: nn.Module, path: str = "model.layers.*.self_attn") -> dict[str, ParallelStyle]:
    """The MLA entries of every ``path`` attention (q/kv down and up projections); ``o_proj`` and the
    input layouts come from ``decoder_plan``. Heads not divisible by tp are refused in one line."""
    config = model.config
    heads = config.num_attention_heads
    plan: dict[str, ParallelStyle] = {
        f"{path}.kv_a_proj_with_mqa": LatentDownParallel(),
        f"{path}.kv_a_layernorm": LocalReplicateParallel(grad_allreduce=True),  # partial dy: weight grad summed
        f"{path}.kv_b_proj": LatentUpParallel(heads),
    }
    if getattr(config, "q_lora_rank", None) is not None:
        plan[f"{path}.q_a_proj"] = LocalReplicateParallel()
        plan[f"{path}.q_a_layernorm"] = LocalReplicateParallel()
    return plan


def _check_heads(heads: int, model: nn.Module, tp: int) -> None:
    if heads % tp:
        raise ValueError(f"{type(model).__name__}: {heads} attention heads are not divisible by tp={tp}; "
                         f"use a tp that divides {heads}")


def validate_mla(model: nn.Module, tp: int) -> None:
    """Refuse attention heads not divisible by ``tp`` (one line), then the usual size checks."""
    _check_heads(model.config.num_attention_heads, model, tp)
    validate_tp_sizes(model, tp)


@register_hf_plan("deepseek_v3", "DeepseekV3ForCausalLM", validate=validate_mla)
@register_hf_plan("deepseek_v2", "DeepseekV2ForCausalLM", validate=validate_mla)
@register_hf_plan("minicpm3", "MiniCPM3ForCausalLM", validate=validate_mla)
@register_hf_plan("glm4_moe_lite", "Glm4MoeLiteForCausalLM", validate=validate_mla)
def deepseek_v3_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """DeepSeek-V3, DeepSeek-V2, MiniCPM3, GLM-4-MoE-Lite (GLM-4.7-Flash): MLA by heads (see the module docstring),
    dense MLPs on their intermediate dim, MoE blocks through ``moe_block_plan``; each norm's output one replicated
    DTensor without SP."""
    q = "q_proj" if getattr(model.config, "q_lora_rank", None) is None else "q_b_proj"
    plan = moe_decoder_plan(model, sequence_parallel, qkv=(q,))
    plan.update(mla_attention_plan(model))
    return plan
