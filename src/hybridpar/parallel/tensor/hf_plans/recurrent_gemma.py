"""Tensor (+sequence) parallelism of RecurrentGemma (Griffin) by heads: its RG-LRU blocks, its local MQA
layers and its gated MLPs.

An RG-LRU block (``models/hf/mixers/rglru.py``) is per head ``h`` of ``H`` (``w = Cd / H`` channels each)
from ``linear_x`` / ``linear_y`` to ``linear_out``: the depthwise conv and ``recurrent_param`` are per
channel, the input and recurrence gates block-diagonal per head (``[H, w, w]``). So rank ``r`` of ``tp``
holds heads ``[r H/tp, (r+1) H/tp)``, i.e. channels ``[r Cd/tp, (r+1) Cd/tp)``, of every parameter
(``Shard(0)``), and ``linear_out`` is row-parallel (``RglruHeadParallel``)::

    u [B, S, D] (SP: all-gathered from [B, S/tp, D]; backward: its gradient, a partial sum over TP,
      all-reduced / reduce-scattered)
      -> linear_y, linear_x (rows of this rank's channels) -> y_l, x_l [B, S, Cd/tp]
      -> conv_1d [Cd/tp, 1, K] -> RG-LRU on H/tp heads (or CP state passing on the local channels)
      -> (x_l * act(y_l)) -> linear_out rowwise: partial [B, S, D] -> all-reduce [B, S, D]
         (SP: reduce-scatter [B, S/tp, D])

No collective beyond the row-parallel exit's. The local attention layers are multi-query (one KV head):
q by heads (``Shard(0)``), ``o_proj`` row-parallel, ``k_proj`` / ``v_proj`` replicated, every rank's
query heads reading the one key and value; their gradient is a partial sum over TP (each rank's heads),
summed once in backward (``AllReduceGrad``, ``[D, d]`` each) (``MQAHeadParallel``; a config with more KV heads
is refused at tp > 1). The MLPs are column/row-parallel (``decoder_plan``). No parameter
is split or renamed, so a DCP checkpoint written at tp=2 loads at tp=1. Under TP only hybridpar's core runs
(a cache is refused). LoRA pairs ``linear_x``, ``linear_y``, ``q_proj`` by rows and ``linear_out``,
``o_proj`` row-wise; a LoRA on ``k_proj`` / ``v_proj`` is refused in one line. Exactness:
``tests/distributed/tensor/hf/test_hf_rglru_tp.py``.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from hybridpar.models.hf.mixers.rglru import RGLRU_MARK, rglru_head_problem
from hybridpar.parallel.tensor.decoder import decoder_plan
from hybridpar.parallel.tensor.hf_plans.dense import register_hf_plan
from hybridpar.parallel.tensor.hf_plans.local_heads import LocalHeadsBlock

__all__ = ["HEAD_SHARDED", "RglruHeadParallel", "MQAHeadParallel", "mqa_problem",
           "validate_recurrent_gemma_tp", "recurrent_gemma_plan"]

HEAD_SHARDED = LocalHeadsBlock.marker  # read by mixers.rglru.rglru_training_forward (no cache under TP)


class RglruHeadParallel(LocalHeadsBlock):
    """A switched RG-LRU block by heads (module docstring)."""

    out = "linear_out"
    sharded_children = ("linear_x", "linear_y", "conv_1d", "rg_lru")
    lora_kinds = {"linear_x": "components", "linear_y": "components", "linear_out": "rowwise"}

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        if not getattr(module, RGLRU_MARK, False):
            raise ValueError(f"TP plan entry for {name!r}: RglruHeadParallel shards an RG-LRU block switched by "
                             f"install_rglru_core(model) (parallelize calls it), got {type(module).__name__}.")
        problem = rglru_head_problem(name, module, tp)
        if problem:
            raise ValueError(problem + ".")



def mqa_problem(name: str, module: nn.Module, tp: int) -> str | None:
    """Why attention ``module`` cannot be split by heads over ``tp`` (None: it can)."""
    heads, kv_heads = module.num_attention_heads, module.num_key_value_heads
    if heads % tp:
        return (f"attention {name!r} has {heads} query heads, not divisible by tp={tp}: tensor parallelism splits "
                f"them over the TP ranks; use a tp dividing {heads}")
    if kv_heads != 1 and tp > 1:
        return (f"attention {name!r} has {kv_heads} key/value heads; its TP plan is multi-query (one KV head, "
                f"replicated): use parallel.tp=1 for this config (context parallelism and FSDP apply)")
    return None


class MQAHeadParallel(LocalHeadsBlock):
    """Multi-query attention by query heads (module docstring): rank ``r`` computes heads
    ``[r H/tp, (r+1) H/tp)`` against the one, replicated key and value; ``num_key_value_groups`` becomes
    per rank (``H/tp``)."""

    out = "o_proj"
    sharded_children, summed_children = ("q_proj",), ("k_proj", "v_proj")
    lora_kinds = {"q_proj": "components", "o_proj": "rowwise"}

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        problem = mqa_problem(name, module, tp)
        if problem:
            raise ValueError(problem + ".")


    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(type(module).__name__, module, device_mesh.size())
        module.num_key_value_groups //= device_mesh.size()  # H/tp local query heads over the one KV head
        return super()._apply(module, device_mesh)


def validate_recurrent_gemma_tp(model: nn.Module, tp: int) -> None:
    """Query heads (which are also the RG-LRU heads) and the MLP width divisible by ``tp``; one KV head."""
    config = model.config
    if config.intermediate_size % tp:
        raise ValueError(f"config.intermediate_size={config.intermediate_size} is not divisible by tp={tp}; choose "
                         f"a tp that divides it (the MLP is split on its intermediate dim)")
    for index, layer in enumerate(model.model.layers):
        block, name = layer.temporal_block, f"model.layers.{index}.temporal_block"
        problem = rglru_head_problem(name, block, tp) if getattr(block, RGLRU_MARK, False) else \
            mqa_problem(name, block, tp) if hasattr(block, "q_proj") else None
        if problem:
            raise ValueError(problem + ".")


@register_hf_plan("recurrent_gemma", "RecurrentGemmaForCausalLM", validate=validate_recurrent_gemma_tp)
def recurrent_gemma_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """RecurrentGemma: vocab-parallel (tied) embedding and head; per layer its temporal block by heads
    (``RglruHeadParallel`` or ``MQAHeadParallel``) and its gated MLP (``mlp_block``) on the intermediate dim;
    each pre-norm's output one replicated DTensor (SP: all-gathered once)."""
    sp = sequence_parallel
    plan = decoder_plan(sp, rotary=None, final_norm="final_norm", attn="temporal_block", qkv=(),
                        mlp="mlp_block", in_norms=("temporal_pre_norm", "channel_pre_norm"), shared_norm_output=True)
    del plan["model.layers.*.temporal_block.o_proj"]  # the block's own style has it
    for index, layer in enumerate(model.model.layers):
        block = layer.temporal_block
        style = RglruHeadParallel if hasattr(block, "rg_lru") else MQAHeadParallel
        plan[f"model.layers.{index}.temporal_block"] = style(sequence_parallel=sp)
    return plan
