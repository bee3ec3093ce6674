"""Tensor (+sequence) parallelism of Kimi Linear: its Kimi Delta Attention (KDA) layers by heads, its MLA
layers by heads (``mla.mla_attention_plan``), MLPs and MoE blocks on their intermediate dim.

Rank ``r`` of ``tp`` holds heads ``[r H/tp, (r+1) H/tp)`` of every KDA layer (``h = H/tp`` heads of ``d``
channels), so the layer runs on local heads up to ``o_proj`` with no collective of its own::

    u [B, S, D] (replicated norm output; SP: all-gathered from [B, S/tp, D]), gradient summed over TP once
      -> q_proj | k_proj | v_proj (local rows) [B, S, 3 h d] -> conv1d on the local q|k|v channels
      -> f_a_proj (replicated, low rank d) -> f_b_proj (local rows) f [B, S, h d];  b_proj [B, S, h]
      -> core (A_log [1, 1, h, 1], dt_bias [h d] local; a CP strategy alike) -> o [B, S, h d]
      -> o_norm per head (weight [d] replicated), gated by g_b_proj(g_a_proj(u)) (g_a replicated, g_b local rows)
      -> o_proj rowwise: partial [B, S, D] -> all-reduce [B, S, D] (SP: reduce-scatter [B, S/tp, D])

The replicated parts read local heads' gradients only (f_a_proj, g_a_proj: their outputs feed local rows of
f_b_proj / g_b_proj; o_norm: local heads), so their weight gradients are summed over TP
(``AllReduceGrad``); their input gradients join ``u``'s partial sum, all-reduced once at the layer's
entry (``local_mixer_input``). ``conv1d`` over ``[q | k | v]`` is stored per component (``SplitConv1d``:
``weight_q/k/v``) when the style applies, so each is a plain ``Shard(0)``; ``canonical_state_dict`` and
exports fuse it back to transformers' name. Exactness: ``tests/distributed/tensor/hf/test_hf_kda_tp.py``.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle

from hybridpar.models.hf.mixers.kda import KDA_MARK
from hybridpar.parallel.tensor.hf_plans.dense import register_hf_plan
from hybridpar.parallel.tensor.hf_plans.mla import mla_attention_plan, validate_mla
from hybridpar.parallel.tensor.hf_plans.local_heads import LocalHeadsBlock
from hybridpar.parallel.tensor.hybrid import SplitConv1d
from hybridpar.parallel.tensor.moe import moe_decoder_plan

__all__ = ["split_kda", "KDAHeadParallel", "kimi_linear_plan"]

_BY_HEADS = ("q_proj", "k_proj", "v_proj", "b_proj", "g_b_proj")  # rows: heads in order
_REPLICATED = ("g_a_proj", "o_norm")  # plus forget_gate.f_a_proj


def split_kda(layer: nn.Module) -> None:
    """Store a switched KDA layer's ``conv1d`` per component q, k, v (idempotent)."""
    if not isinstance(layer.conv1d, SplitConv1d):
        width = layer.num_heads * layer.head_dim
        layer.conv1d = SplitConv1d(layer.conv1d, dict(q=width, k=width, v=width))


class KDAHeadParallel(LocalHeadsBlock):
    """Shard a switched Kimi Delta Attention by heads (module docstring); ``sequence_parallel``: the
    output is reduce-scattered to a ``Shard(1)`` DTensor ``[B, S/tp, D]``."""

    out = "o_proj"
    sharded_children = ("conv1d", "forget_gate.f_b_proj", *_BY_HEADS)
    summed_children = ("forget_gate.f_a_proj", *_REPLICATED)
    localized_children = ("forget_gate",)  # A_log [1, 1, H, 1] and dt_bias [H d], sharded in _apply
    lora_kinds: dict[str, str] = {}  # no LoRA pairing yet: refused at tp > 1 (parallel/lora.py)

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        if not getattr(module, KDA_MARK, False):
            raise ValueError(f"TP plan entry for {name!r}: KDAHeadParallel shards a Kimi Delta Attention switched by "
                             f"install_kda_core(model) (parallelize calls it), got {type(module).__name__}")
        if module.num_heads % tp:
            raise ValueError(f"Kimi Delta Attention {name!r}: {module.num_heads} heads are not divisible by tp={tp}; "
                             f"choose a tp that divides {module.num_heads}.")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(type(module).__name__, module, device_mesh.size())
        split_kda(module)
        self._shard(module.forget_gate, "A_log", device_mesh, Shard(2))
        self._shard(module.forget_gate, "dt_bias", device_mesh, Shard(0))
        return super()._apply(module, device_mesh)


def _validate(model: nn.Module, tp: int) -> None:
    validate_mla(model, tp)
    heads = getattr(model.config, "linear_num_heads", None)
    if isinstance(heads, int) and heads % tp:
        raise ValueError(f"{type(model).__name__}: {heads} Kimi Delta Attention heads are not divisible by tp={tp}; "
                         f"use a tp that divides {heads}")


@register_hf_plan("kimi_linear", "KimiLinearForCausalLM", validate=_validate)
def kimi_linear_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Kimi Linear: per layer index, MLA (``model.layers.i.self_attn`` with ``kv_b_proj``) or KDA by heads;
    dense MLPs and MoE blocks (``model.layers.i.mlp``) on their intermediate dim."""
    every = "model.layers.*."
    mla_q = "q_proj" if getattr(model.config, "q_lora_rank", None) is None else "q_b_proj"
    decoder = moe_decoder_plan(model, sequence_parallel, qkv=(mla_q,))
    plan = {k: v for k, v in decoder.items() if not k.startswith(every + "self_attn")}
    attention = {k[len(every):]: v for k, v in decoder.items() if k.startswith(every + "self_attn")}
    for index, layer in enumerate(model.model.layers):
        path = f"model.layers.{index}.self_attn"
        if hasattr(layer.self_attn, "kv_b_proj"):
            plan.update({f"model.layers.{index}.{k}": v for k, v in attention.items()})
            plan.update(mla_attention_plan(model, path))
        else:
            plan[path] = KDAHeadParallel(sequence_parallel=sequence_parallel)
    if getattr(model.model, "rotary_emb", None) is None:
        plan.pop("model.rotary_emb", None)
    return plan
