"""Tensor/sequence-parallel plans for transformers' Mamba1 models: Jamba (with attention and MoE),
FalconMamba and Mamba, their Mamba1 mixers sharded by channel (``Mamba1ChannelParallel``).

A switched Mamba1 mixer (``models/hf/mixers/mamba1.py``) is per channel ``c`` of ``d_inner = Cd``
from ``in_proj`` to ``out_proj`` except for one projection: ``x_proj`` reads every channel to make
the per-token ``[dt_low | B | C]`` (``R + 2N`` wide) that every channel then reads. So rank ``r`` of
``tp`` holds channels ``[r Cd/tp, (r+1) Cd/tp)`` of everything and ``x_proj`` is row-parallel, its
small output all-reduced::

    u [B, S, D] (SP: all-gathered from [B, S/tp, D]; backward: the input gradient, a partial sum
      over TP, all-reduced / reduce-scattered)
      -> in_proj (components x, z; rows of this rank's channels)  x_l, z_l [B, S, Cd/tp]
      -> conv1d (depthwise, weight [Cd/tp, 1, K]) and act    x_l [B, S, Cd/tp]
      -> x_proj (weight [R + 2N, Cd/tp]): partial [B, S, R + 2N] -> all-reduce -> [B, S, R + 2N]
         (backward: every rank's channels read all of it, so its gradient, a partial sum over TP,
         is all-reduced too)
      -> dt_low, B, C [B, S, R | N | N] and their norms (Jamba: RMSNorm weights [R], [N], [N],
         replicated, their gradient summed over TP; FalconMamba: weightless)
      -> dt_proj (column-parallel: weight [Cd/tp, R], bias [Cd/tp]) -> dt [B, S, Cd/tp]
      -> scan with A_log [Cd/tp, N], D [Cd/tp] (or CP state passing on the local channels)
      -> y_l * silu(z_l) [B, S, Cd/tp] -> out_proj rowwise: partial [B, S, D]
      -> all-reduce [B, S, D]   (SP: reduce-scatter [B, S/tp, D])

Per layer and step that adds one all-reduce of ``[B, S, R + 2N]`` forward and one backward to the
row-parallel ``out_proj``'s. ``in_proj`` is stored per component (``in_proj.weight_x``,
``weight_z``: ``split_mamba1``, at every layout through ``moe_hybrid.split_hf_mixers``, so DCP names
do not depend on tp; ``canonical_state_dict`` and exports fuse them back). Every sharded parameter
is a plain ``Shard(0)`` (``x_proj``'s ``Shard(1)``, as any row-parallel weight), so FSDP composes.
Under TP only hybridpar's core runs (a cache or a padding mask is refused).

Jamba's attention layers are sharded by heads, its dense MLPs on the intermediate dim and its MoE
blocks (``router`` replicated) with their experts on the intermediate dim (``moe.moe_block_plan``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from hybridpar.models.hf.mixers.mamba1 import MAMBA1_MARK, mamba1_channel_problem, mamba1_mixers
from hybridpar.parallel.lora import split_lora_components
from hybridpar.parallel.tensor.check import validate_tp_sizes
from hybridpar.parallel.tensor.decoder import decoder_plan, embedding_style, lm_head_style
from hybridpar.parallel.tensor.hf_plans.dense import register_hf_plan
from hybridpar.parallel.tensor.hybrid import MambaHeadParallel, SplitInProj
from hybridpar.parallel.tensor.moe import is_moe_block, moe_block_plan
from hybridpar.parallel.tensor.styles import (AllReduceGrad, LocalReplicateParallel, SequenceParallelAllGatherActivation,
                                             local_mixer_input, row_parallel_exit)

__all__ = ["split_mamba1", "Mamba1ChannelParallel", "validate_mamba1_tp", "jamba_plan", "mamba_plan"]

_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")
CHANNEL_SHARDED = "_hybridpar_channel_sharded"  # read by mixers.mamba1.mamba1_training_forward


def split_mamba1(mixer: nn.Module) -> None:
    """Store a switched Mamba1 mixer's ``in_proj`` per component ``x, z`` (idempotent; a LoRA adapter follows)."""
    if isinstance(mixer.in_proj, SplitInProj):
        return
    channels = mixer.A_log.shape[0]
    sizes = dict(x=channels, z=channels)
    fused, mixer.in_proj = mixer.in_proj, SplitInProj(mixer.in_proj, sizes)
    split_lora_components(fused, mixer.in_proj, sizes)


class _SumOverTP(torch.autograd.Function):
    """Sum of the per-rank partial ``x_proj`` outputs; read by every rank's channels, so the gradient
    (a partial sum) is summed as well: ``[B, S, R + 2N]`` both ways."""

    @staticmethod
    def forward(ctx, partial_sum, group):
        ctx.group = group
        total = partial_sum.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _norms(mixer: nn.Module) -> list[nn.Module]:
    return [getattr(mixer, n) for n in _NORMS if isinstance(getattr(mixer, n, None), nn.Module)]


class Mamba1ChannelParallel(MambaHeadParallel):
    """Shard a switched Mamba1 mixer by channel (module docstring); ``sequence_parallel``: the output is
    reduce-scattered to a ``Shard(1)`` DTensor ``[B, S/tp, D]``."""

    def __init__(self, *, sequence_parallel: bool = False):
        super().__init__(sequence_parallel=sequence_parallel)
        self.use_local_output = not sequence_parallel  # read by tp_check's SP rules

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        if not getattr(module, MAMBA1_MARK, False):
            raise ValueError(f"TP plan entry for {name!r}: Mamba1ChannelParallel shards a Mamba1 mixer switched by "
                             f"install_mamba1_core(model) (parallelize calls it), got {type(module).__name__}.")
        if module.x_proj.bias is not None:
            raise ValueError(f"TP plan entry for {name!r}: its x_proj has a bias, which a row-parallel x_proj would "
                             "add once per rank; use parallel.tp=1 for this model (context parallelism and FSDP apply).")
        problem = mamba1_channel_problem(name, module, tp)
        if problem:
            raise ValueError(problem + ".")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(type(module).__name__, module, device_mesh.size())
        split_mamba1(module)
        for sub in (module, module.in_proj, module.conv1d, module.dt_proj):  # A_log, D; x, z; conv; dt_proj rows
            for name in list(sub._parameters):
                self._shard(sub, name, device_mesh, Shard(0))
        self._shard(module.x_proj, "weight", device_mesh, Shard(1))  # [R + 2N, Cd] -> [R + 2N, Cd/tp]
        for norm in _norms(module):  # Jamba's [R], [N], [N]: every rank's channels read them
            for name in list(norm._parameters):
                self._shard(norm, name, device_mesh, Replicate())
        module.x_proj.register_forward_hook(partial(self._sum_x_proj, device_mesh.get_group()))
        row_parallel_exit(module.out_proj, device_mesh, self.sequence_parallel)  # y_l [B, S, Cd/tp]
        module.register_forward_pre_hook(partial(self._enter, device_mesh), with_kwargs=True)
        module.register_forward_hook(self._exit, always_call=True)  # restore even if forward raises
        setattr(module, CHANNEL_SHARDED, True)
        return module

    @staticmethod
    def _sum_x_proj(group, x_proj: nn.Module, args, output):
        # partial [B, S, R + 2N] over this rank's Cd/tp channels -> all-reduce -> [B, S, R + 2N]
        return _SumOverTP.apply(output, group)

    @staticmethod
    def _enter(mesh: DeviceMesh, mixer: nn.Module, args, kwargs):
        args, kwargs = local_mixer_input(mesh, args, kwargs)
        saved, norms = [], _norms(mixer)
        for sub in (mixer, mixer.in_proj, mixer.conv1d, mixer.x_proj, mixer.dt_proj, *norms):
            for name, param in list(sub._parameters.items()):
                if isinstance(param, DTensor):
                    saved.append((sub, name, param))
                    local = param.to_local()  # this rank's channels (norms: the whole replicated weight)
                    sub._parameters[name] = AllReduceGrad.apply(local, mesh.get_group()) if sub in norms else local
        mixer.__dict__.setdefault("_tp_saved_parameters", []).append(saved)
        return args, kwargs


def validate_mamba1_tp(model: nn.Module, tp: int) -> None:
    """The usual config sizes (heads, MLP) and every Mamba1 mixer's ``d_inner`` divisible by ``tp``."""
    validate_tp_sizes(model, tp)
    for name, mixer in mamba1_mixers(model):
        problem = mamba1_channel_problem(name, mixer, tp)
        if problem:
            raise ValueError(problem + ".")


@register_hf_plan("jamba", "JambaForCausalLM", validate=validate_mamba1_tp)
def jamba_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Jamba: per layer a Mamba1 mixer (by channel) or attention (by heads), then a dense MLP or a MoE
    block (``feed_forward``: experts on their intermediate dim, ``router`` replicated)."""
    sp = sequence_parallel
    plan = decoder_plan(sp, mlp="feed_forward", in_norms=("input_layernorm", "pre_ff_layernorm"),
                        final_norm="final_layernorm", rotary=None, shared_norm_output=True)
    for index, layer in enumerate(model.model.layers):
        if getattr(layer, "mamba", None) is not None:
            plan[f"model.layers.{index}.mamba"] = Mamba1ChannelParallel(sequence_parallel=sp)
        block = getattr(layer, "feed_forward", None)
        if block is not None and is_moe_block(block):
            path = f"model.layers.{index}.feed_forward"
            plan.update(moe_block_plan(path, block, sp))
            plan[f"{path}.router"] = LocalReplicateParallel()
    return plan


@register_hf_plan("falcon_mamba", "FalconMambaForCausalLM", validate=validate_mamba1_tp)
@register_hf_plan("mamba", "MambaForCausalLM", validate=validate_mamba1_tp)
def mamba_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Mamba, FalconMamba: vocab-parallel embeddings and head, each layer's norm then its Mamba1 mixer
    (by channel); under SP the norm all-gathers the sequence shard once."""
    sp = sequence_parallel
    norm = SequenceParallelAllGatherActivation(use_local_output=False) if sp else LocalReplicateParallel()
    return {"backbone.embeddings": embedding_style(sp), "backbone.layers.*.norm": norm,
            "backbone.layers.*.mixer": Mamba1ChannelParallel(sequence_parallel=sp),
            "backbone.norm_f": SequenceParallel() if sp else LocalReplicateParallel(), "lm_head": lm_head_style(sp)}
