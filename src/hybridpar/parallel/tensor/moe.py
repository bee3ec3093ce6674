"""Tensor parallelism for Hugging Face mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE,
NemotronH): every expert is split over TP on its intermediate dim, the router is replicated.

transformers 5.23 stores the experts of one layer as 3-D parameters (``@use_experts_implementation``):

    gate_up_proj [E, 2I, D] = [gate | up] per expert (``is_concatenated``; interleaved pairs otherwise)
    up_proj      [E, I, D]  (``has_gate=False``: NemotronH)
    down_proj    [E, D, I]
    (``is_transposed``: [E, D, 2I] / [E, I, D], so I is the last / middle dim; Llama 4's without the flag,
    ``models/lora_experts.experts_transposed``)

Rank ``r`` of ``tp`` holds intermediate rows ``[r I/tp, (r+1) I/tp)`` of every expert: of gate and
of up (``_StridedShard(I dim, 2)`` of the packed weight, so ``chunk(2)`` finds the local halves)
and the matching columns of ``down_proj`` (``Shard(I dim)``). For the tokens routed to expert e,

    y_e = sum_r  act(x G_e^r) * (x U_e^r) @ D_e^r         (one partial term per rank)
    out = sum_e w_e y_e  -> partial [T, D] on each rank -> all-reduce -> [T, D]

so the experts' own forward runs unchanged on the local shards (any experts implementation:
eager loop, batched or grouped mm). Expert biases (GPT-OSS, ``has_bias``) follow their rows:
``gate_up_proj_bias [E, 2I]`` like gate_up's intermediate dim, and ``down_proj_bias [E, D]``,
replicated, enters each rank's partial sum as ``b / tp`` (its gradient unchanged), so the
all-reduce adds it once. The router (``gate``) runs replicated on every rank and
picks the same experts everywhere. In backward, the gradients of the expert input ``x`` and
of the routing weights ``w`` are partial sums over TP. ``w``'s ``[T, k]`` is all-reduced
(``replicated_local``), so the router sees its full gradient; ``x``'s ``[T, D]`` is too when ``x``
is a plain tensor, and when it is a replicated DTensor (a shared norm output) it is handed back
``Partial`` to be summed with the other readers' before the norm's one all-reduce (``expert_input``).

Without SP a block with shared experts leaves both terms partial and sums them before one
all-reduce at its exit (``PartialBlockExit``): ``[T, D]`` once per block, not once per term.

Under sequence parallelism the MoE block reads the all-gathered norm output and leaves its
experts' (and shared experts') terms partial; their sum is reduce-scattered once to the sequence
shard as it leaves the block (``moe_block_sp_style``): ``[B, S, D] -> [B, S/tp, D]``, not an
all-reduce of ``[T, D]`` per term then a slice. A block with latent projections (NemotronH) still
all-reduces and slices.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInputOutput,
                                               PrepareModuleOutput, RowwiseParallel)
from torch.distributed.tensor.placement_types import _StridedShard

from hybridpar.models.lora_experts import experts_transposed
from hybridpar.parallel.tensor.linear_styles import _distribute, _require
from hybridpar.parallel.tensor.decoder import PARTIAL_EXIT, decoder_plan
from hybridpar.parallel.tensor.styles import (LocalReplicateParallel, reduce_partial, replicated_local, restore_params,
                                              swap_in_local_params)

__all__ = ["is_grouped_experts", "is_moe_block", "expert_placements", "expert_input", "GroupedExpertsParallel",
           "PartialBlockExit",
           "moe_block_sp_style",
           "moe_block_plan", "moe_blocks_plan", "moe_decoder_plan"]


def is_grouped_experts(module: nn.Module) -> bool:
    """A transformers experts module: 3-D ``down_proj`` plus ``gate_up_proj`` or ``up_proj``."""
    down = module._parameters.get("down_proj")
    up = module._parameters.get("gate_up_proj", module._parameters.get("up_proj"))
    return down is not None and up is not None and down.ndim == 3 and up.ndim == 3


def expert_placements(module: nn.Module) -> dict[str, object]:
    """TP placement of each expert parameter (see the module docstring); ValueError if unknown."""
    name = type(module).__name__
    if not is_grouped_experts(module):
        raise ValueError(f"{name} is not a grouped experts module (3-D down_proj and gate_up_proj/up_proj)")
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(f"{name} has a post-expert norm; GroupedExpertsParallel shards gated/ungated experts "
                         "(with or without biases) only. Leave the experts replicated (plan entry "
                         "LocalReplicateParallel()) or use tp=1")
    transposed = experts_transposed(module)
    up_dim, down_dim = (2, 1) if transposed else (1, 2)
    placements: dict[str, object] = {"down_proj": Shard(down_dim)}
    up = "gate_up_proj" if "gate_up_proj" in module._parameters else "up_proj"
    concatenated = up == "gate_up_proj" and getattr(module, "is_concatenated", True)
    placements[up] = _StridedShard(up_dim, split_factor=2) if concatenated else Shard(up_dim)
    if getattr(module, "has_bias", False):  # [E, 2I] / [E, I] with their rows; down's [E, D] once (_once_over_tp)
        placements[f"{up}_bias"] = _StridedShard(1, split_factor=2) if concatenated else Shard(1)
        placements["down_proj_bias"] = Replicate()
    extra = sorted(set(n for n, p in module._parameters.items() if p is not None) - set(placements))
    if extra:
        raise ValueError(f"{name} has parameters {extra} that GroupedExpertsParallel does not know how to shard")
    return placements


def _intermediate_size(module: nn.Module) -> int:
    return module.down_proj.shape[1 if experts_transposed(module) else 2]


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _once_over_tp(bias: torch.Tensor, tp: int) -> torch.Tensor:
    """``bias / tp`` in the forward, gradient unchanged: each rank adds its share to its partial
    ``[T, D]``, so the all-reduced output holds the bias once, and each rank's gradient (of the
    replicated output) is already the full one, as a ``Replicate`` parameter's must be."""
    return bias + (bias / tp - bias).detach()


def expert_input(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The experts' input ``x [T, D]`` as a plain tensor whose gradient is a partial sum over TP.

    A ``Replicate`` DTensor (a shared norm output, ``decoder_plan(shared_norm_output=True)``) hands
    its partial gradient back as ``Partial``: it adds up with the router's, the shared experts' and
    the attention's before the norm's one all-reduce. A plain ``x`` all-reduces it here."""
    if isinstance(x, DTensor) and x.placements == (Replicate(),):
        return x.to_local(grad_placements=[Partial()])
    return replicated_local(_full(x), mesh)


class GroupedExpertsParallel(ParallelStyle):
    """Experts sharded on the intermediate dim; called as ``experts(x [T, D], top_k_index
    [T, k], top_k_weights [T, k])``, returns the all-reduced ``[T, D]`` (``partial_output``: the
    ``Partial`` DTensor, summed with the shared experts' before one all-reduce: ``PartialBlockExit``)."""

    def __init__(self, *, partial_output: bool = False):
        super().__init__()
        self.partial_output = partial_output

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        try:
            expert_placements(module)
        except ValueError as err:
            raise ValueError(f"TP plan entry for {name!r}: {err}") from None
        size = _intermediate_size(module)
        _require(size % tp == 0, name, f"expert intermediate size {size} is not divisible by tp={tp}")

    def _forward_pre(self, mesh: DeviceMesh, module, args, kwargs):
        args, kwargs = list(args), dict(kwargs)
        swap_in_local_params(module)
        if isinstance(module._parameters.get("down_proj_bias"), torch.Tensor):  # added once after the all-reduce
            module._parameters["down_proj_bias"] = _once_over_tp(module._parameters["down_proj_bias"], mesh.size())
        # x [T, D] whole on every rank; its gradient (a partial sum over ranks) is all-reduced
        if args:
            args[0] = expert_input(args[0], mesh)
        else:
            kwargs["hidden_states"] = expert_input(kwargs["hidden_states"], mesh)
        args = [_full(a) for a in args]
        kwargs = {k: _full(v) for k, v in kwargs.items()}
        # routing weights [T, k]: same all-reduce of their partial gradient
        if len(args) >= 3:
            args[2] = replicated_local(args[2], mesh) if args[2].is_floating_point() else args[2]
        elif "top_k_weights" in kwargs:
            kwargs["top_k_weights"] = replicated_local(kwargs["top_k_weights"], mesh)
        return tuple(args), kwargs

    def _forward_post(self, mesh: DeviceMesh, module, args, output):
        restore_params(module)
        if output is None:
            return output
        if self.partial_output:  # partial [T, D], left to the block's exit
            return DTensor.from_local(output, mesh, [Partial()], run_check=False)
        # partial [T, D] on each rank -> all-reduce -> [T, D]
        return reduce_partial(output, mesh, Replicate()).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(type(module).__name__, module, device_mesh.size())
        _distribute(module, expert_placements(module), device_mesh, self.src_data_rank)
        module.register_forward_pre_hook(partial(self._forward_pre, device_mesh), with_kwargs=True)
        module.register_forward_hook(partial(self._forward_post, device_mesh), always_call=True)
        return module


class PartialBlockExit(ParallelStyle):
    """A MoE block's output ``[B, S, D]``, the ``Partial`` sum of its experts' and shared experts'
    terms, all-reduced once as it leaves the block (a plain tensor), not once per term."""

    @staticmethod
    def _exit(mod, args, output):
        if isinstance(output, DTensor):  # partial [B, S, D] -> all-reduce -> [B, S, D]
            return output.redistribute(placements=[Replicate()]).to_local()
        return output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(self._exit)
        return module


def moe_block_sp_style(extra_outputs: int = 0, partial_output: bool = True) -> ParallelStyle:
    """A MoE block under sequence parallelism. ``partial_output``: it reads the all-gathered norm
    output as the ``Replicate`` DTensor it is (its input gradient comes back ``Partial`` and the
    all-gather's backward reduce-scatters it: ``expert_input``) and its output, the ``Partial`` sum
    of its terms, is reduce-scattered to the sequence shard [B, S/tp, D] (backward: all-gather).
    Else it reads it as a plain tensor and its replicated output (the experts all-reduce) is sliced
    to the shard. ``extra_outputs`` more outputs (GPT-OSS's router scores) pass through as they are."""
    keep = (None,) * extra_outputs
    if partial_output:  # partial [B, S, D] -> reduce-scatter -> [B, S/tp, D]
        return PrepareModuleOutput(output_layouts=(Partial(), *keep), desired_output_layouts=(Shard(1), *keep),
                                   use_local_output=False)
    return PrepareModuleInputOutput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(), *keep), desired_output_layouts=(Shard(1), *keep), use_local_output=False,
    )


def is_moe_block(module: nn.Module) -> bool:
    """A block holding a grouped-experts child named ``experts``."""
    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.Module) and is_grouped_experts(experts)


def moe_block_plan(path: str, block: nn.Module, sequence_parallel: bool,
                   partial_output: bool = False) -> dict[str, ParallelStyle]:
    """Entries for one MoE block at ``path``: experts, router, shared experts and their gate. Without SP
    a block with shared experts (and no latent projection) sums its two partial ``[T, D]`` terms before
    one all-reduce at its exit (``PartialBlockExit``); with SP (no latent projection) every block sums its
    terms before one reduce-scatter at its exit (``moe_block_sp_style``). ``partial_output``
    (no latent projection): the block reads the norm's ``Replicate`` DTensor output (SP too) and returns
    its ``Partial`` sum for the decoder layer to reduce with another branch (``SummedBranchesLayer``)."""
    latents = [n for n in ("fc1_latent_proj", "fc2_latent_proj")  # NemotronH's optional latent projections
               if any(True for _ in getattr(block, n, nn.Identity()).parameters())]  # an Identity passes DTensors on
    shared_mlps = [n for n in ("shared_expert", "shared_experts") if getattr(block, n, None) is not None]
    summed = (bool(shared_mlps) or sequence_parallel or partial_output) and not latents
    partial_out = PARTIAL_EXIT if summed else {}
    plan: dict[str, ParallelStyle] = {f"{path}.experts": GroupedExpertsParallel(partial_output=summed),
                                      f"{path}.gate": LocalReplicateParallel()}
    for shared in shared_mlps:
        mlp = getattr(block, shared)
        plan.update({f"{path}.{shared}.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj") if hasattr(mlp, p)})
        plan[f"{path}.{shared}.down_proj"] = RowwiseParallel(**partial_out)  # partial [T, D], all-reduced unless summed
    # its sigmoid gate [T, 1] scales the partial shared term: a Replicate DTensor when summed
    plan[f"{path}.shared_expert_gate"] = LocalReplicateParallel(output_layouts=Replicate() if summed else None)
    plan.update({f"{path}.{latent}": LocalReplicateParallel() for latent in latents})
    if sequence_parallel and not partial_output:  # partial [B, S, D] -> reduce-scatter (latents: all-reduce, slice)
        plan[path] = moe_block_sp_style(partial_output=summed)
    elif summed and not partial_output:  # partial [B, S, D] -> all-reduce
        plan[path] = PartialBlockExit()
    return plan


def moe_blocks_plan(model: nn.Module, sequence_parallel: bool, block: str = "mlp") -> dict[str, ParallelStyle]:
    """``moe_block_plan`` of every layer whose ``block`` (``model.layers.i.<block>``) is a MoE block."""
    plan: dict[str, ParallelStyle] = {}
    for index, layer in enumerate(model.model.layers):
        if is_moe_block(getattr(layer, block)):
            plan.update(moe_block_plan(f"model.layers.{index}.{block}", getattr(layer, block), sequence_parallel))
    return plan


def moe_decoder_plan(model: nn.Module, sequence_parallel: bool, **decoder) -> dict[str, ParallelStyle]:
    """``decoder_plan`` (attention, dense MLP layers, norms) plus every MoE block ``model.layers.i.mlp``.
    Without SP each norm's output is one replicated DTensor (``shared_norm_output``): q, k, v, the
    router (full gradient), the experts and the shared experts (partial gradients) add their input
    gradients before one all-reduce per norm."""
    decoder.setdefault("shared_norm_output", True)
    return {**decoder_plan(sequence_parallel, **decoder), **moe_blocks_plan(model, sequence_parallel)}
