"""Tensor parallelism for ``HybridLM``: the Mamba2 mixer sharded by heads, and the model's plan.

The fused Mamba2 ``in_proj`` weight stacks five components along its rows,
``[z d_inner | x d_inner | B G*N | C G*N | dt H]``, and ``conv1d`` stacks ``[x | B | C]``. A
plain column split (``Shard(0)`` of the fused weight) would give rank 0 all of ``z`` and part
of ``x``. So the mixer's projections are first stored per component (``split_mamba_mixers``:
``in_proj.weight_z ... weight_dt``, ``conv1d.weight_x/B/C`` and their biases), which
``parallelize`` does at every TP size so parameter names never depend on the layout. Under TP
(``MambaHeadParallel``) each component is ``Shard(0)``: rank ``r`` of ``tp`` holds heads
``[r H/tp, (r+1) H/tp)`` of ``z, x, dt`` (and of conv, ``dt_bias``, ``A_log``, ``D``, the gated
norm weight) and groups ``[r G/tp, (r+1) G/tp)`` of ``B, C`` -- exactly the groups its heads
read, and whole norm groups (group size ``d_inner/G``), so no extra collective is needed (with a
single group, ``G = 1 < tp``, B and C are replicated, their gradient summed over TP, and the norm's
sum of squares ``[B, S, 1]`` is all-reduced: ``replicate_shared_groups``, ``spanning_group_norm``):

    u [B, S, D] (replicated; with SP all-gathered from [B, S/tp, D])
      -> in_proj (local cat of components)  [B, S, d/tp | d/tp | G/tp*N | G/tp*N | H/tp]
      -> core (conv + scan, or a CP strategy) on the local heads -> y [B, S, d/tp]
      -> gated grouped norm (local groups) -> out_proj rowwise: partial [B, S, D]
      -> all-reduce -> [B, S, D]   (SP: reduce-scatter -> [B, S/tp, D])

During the mixer's forward its sharded parameters are swapped for their local shards
(``to_local()``, differentiable), so the single-device mixer code and the CP cores run
unchanged on a shard; ``out_proj`` stays a DTensor ``RowwiseParallel`` (bias added once).
The input gradient of the column-parallel part is a partial sum over TP, reduced by the
backward of the input conversion (all-reduce, or reduce-scatter under SP).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from hybridpar.models.attention.mixer import Attention
from hybridpar.models.blocks import MLP, gated_rms_norm
from hybridpar.models.mamba.mixer import Mamba2Mixer, replicated_groups, tp_groups
from hybridpar.models.precision import autocast_narrowing
from hybridpar.parallel.comm.collectives import all_reduce
from hybridpar.parallel.lora import split_lora_components
from hybridpar.parallel.tensor.registry import register_tp_plan
from hybridpar.parallel.tensor.styles import (
    AllReduceGrad,
    LocalReplicateParallel,
    SequenceParallelAllGatherActivation,
    VocabParallelEmbedding,
    local_mixer_input,
    map_first_input,
    replicated_input,
    row_parallel_exit,
)
from hybridpar.parallel.tensor.vocab_parallel_loss import VocabParallelLoss

__all__ = [
    "IN_PROJ_COMPONENTS", "CONV_COMPONENTS", "SplitInProj", "SplitConv1d", "split_mamba_mixers",
    "MambaHeadParallel", "ReplicatedMixerInput", "SequenceShardedInputsEmbeds", "hybrid_lm_plan",
    "validate_hybrid_tp",
]

IN_PROJ_COMPONENTS = ("z", "x", "B", "C", "dt")
CONV_COMPONENTS = ("x", "B", "C")


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The rank-local tensor of a (possibly DTensor) parameter, differentiable."""
    return t.to_local() if isinstance(t, DTensor) else t


class _ComponentSplit(nn.Module):
    """Rows of a fused weight (and bias) stored as one parameter per component.

    ``component_sizes`` holds the full (unsharded) rows of each component, in fused order;
    ``fused_parameters()`` says how ``state.canonical_state_dict`` rebuilds the fused tensors.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: dict[str, int]):
        super().__init__()
        if weight.shape[0] != sum(sizes.values()):
            raise ValueError(f"fused weight has {weight.shape[0]} rows, components {sizes} need {sum(sizes.values())}.")
        self.component_sizes = dict(sizes)
        for kind, tensor in (("weight", weight), ("bias", bias)):
            if tensor is None:
                continue
            for name, part in zip(sizes, tensor.detach().split(list(sizes.values()), dim=0)):
                self.register_parameter(f"{kind}_{name}", nn.Parameter(part.clone(), requires_grad=tensor.requires_grad))
        self.has_bias = bias is not None

    def fused_parameters(self) -> dict[str, list[str]]:
        """``{fused name: component parameter names in fused row order}``."""
        kinds = ("weight", "bias") if self.has_bias else ("weight",)
        return {kind: [f"{kind}_{name}" for name in self.component_sizes] for kind in kinds}

    def _cat(self, kind: str) -> torch.Tensor | None:
        if kind == "bias" and not self.has_bias:
            return None
        return torch.cat([_local(getattr(self, f"{kind}_{name}")) for name in self.component_sizes], dim=0)


class SplitInProj(_ComponentSplit):
    """Mamba2 ``in_proj`` with one weight per component ``z, x, B, C, dt``.

    The output is ``[z | x | B | C | dt]`` of whatever heads and groups this rank holds:

    - where the weights are used as they are (float32 or float64, FSDP's bf16): one matmul per
      (local) component, outputs concatenated. Each saves only its input (shared) and its
      parameter for backward: no fused copy of the weight (``d_in x (2 d_inner + 2 G N + H)``,
      ~290 MiB per layer at 8B widths) is made or kept;
    - under autocast to a narrower dtype (bf16 without FSDP), which copies every component and
      keeps the copies for backward anyway: the copies concatenated, one matmul. The same bytes
      are kept, with four matmuls fewer (``dt``'s has ``H`` columns), no ``[T, c]`` cat and no
      four ``[T, D]`` input-gradient sums in backward (``benchmarks/step_traffic.py``).
    """

    def __init__(self, fused: nn.Linear, sizes: dict[str, int]):
        super().__init__(fused.weight, fused.bias, sizes)
        self.in_features = fused.in_features

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        first = getattr(self, f"weight_{next(iter(self.component_sizes))}")  # components differ per mixer kind
        narrow = autocast_narrowing(hidden_states.device.type, first.dtype)
        if narrow is not None:  # [B, S, D] @ [c_l, D]^T in one matmul on the bf16 copies
            weight = torch.cat([_local(getattr(self, f"weight_{name}")).to(narrow) for name in self.component_sizes])
            bias = None if not self.has_bias else torch.cat(
                [_local(getattr(self, f"bias_{name}")).to(narrow) for name in self.component_sizes])
            return F.linear(hidden_states, weight, bias)
        # [B, S, D] @ [c_l, D]^T -> [B, S, c_l] per component c, then [B, S, z_l | x_l | B_l | C_l | dt_l]
        parts = [F.linear(hidden_states, _local(getattr(self, f"weight_{name}")),
                          _local(getattr(self, f"bias_{name}")) if self.has_bias else None)
                 for name in self.component_sizes]
        return torch.cat(parts, dim=-1)


class SplitConv1d(_ComponentSplit):
    """Mamba2 depthwise ``conv1d`` with one weight per channel block ``x, B, C``.

    ``weight`` ([C_local, 1, K]) and ``bias`` are read-only properties holding the local rows
    in fused order, so Mamba cores keep reading ``mixer.conv1d.weight``.
    """

    def __init__(self, fused: nn.Conv1d, sizes: dict[str, int]):
        super().__init__(fused.weight, fused.bias, sizes)
        self.kernel_size = fused.kernel_size
        self.padding = fused.padding

    @property
    def weight(self) -> torch.Tensor:
        return self._cat("weight")  # [x_l + B_l + C_l, 1, K]

    @property
    def bias(self) -> torch.Tensor | None:
        return self._cat("bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C_local, L], as nn.Conv1d
        weight = self.weight
        return F.conv1d(x, weight, self.bias, padding=self.padding, groups=weight.shape[0])


def split_mamba_mixers(model: nn.Module) -> list[str]:
    """Store every ``Mamba2Mixer``'s ``in_proj`` and ``conv1d`` per component; returns their names.

    Same values and gradients as the fused modules; idempotent. Run before any sharding.
    """
    done = []
    for name, mixer in model.named_modules():
        if not isinstance(mixer, Mamba2Mixer) or isinstance(mixer.in_proj, SplitInProj):
            continue
        d_inner, gn, heads = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size, mixer.num_heads
        if any(isinstance(p, DTensor) for p in mixer.parameters()):
            raise ValueError(f"mamba mixer {name!r} is already sharded; split it before tensor parallelism.")
        sizes = dict(z=d_inner, x=d_inner, B=gn, C=gn, dt=heads)
        fused, mixer.in_proj = mixer.in_proj, SplitInProj(mixer.in_proj, sizes)
        split_lora_components(fused, mixer.in_proj, sizes)  # a LoRA adapter follows, B per component
        mixer.conv1d = SplitConv1d(mixer.conv1d, dict(x=d_inner, B=gn, C=gn))
        done.append(name)
    return done


class ReplicatedMixerInput(ParallelStyle):
    """The mixer's first input becomes a ``Replicate`` DTensor that its column-parallel
    projections share, so its gradient is reduced over TP once, not once per projection."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(mod, args, kwargs):
            return map_first_input(args, kwargs, "hidden_states", partial(replicated_input, mesh=device_mesh))

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class SequenceShardedInputsEmbeds(ParallelStyle):
    """Under sequence parallelism, ``inputs_embeds`` given to the backbone are this rank's
    sequence shard (``shard_inputs(..., sequence_parallel=True)``): wrap them as the
    ``Shard(1)`` DTensor ``[B, S/tp, D]`` the residual stream is. Token ids are untouched."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def wrap(x):
            if x is None or isinstance(x, DTensor):
                return x
            return DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)

        def hook(mod, args, kwargs):
            if len(args) > 1:
                return (args[0], wrap(args[1]), *args[2:]), kwargs
            return args, {**kwargs, "inputs_embeds": wrap(kwargs.get("inputs_embeds"))}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


SHARED_GROUPS = "_hybridpar_shared_groups"


def replicate_shared_groups(mixer: nn.Module, mesh: DeviceMesh) -> list[tuple[nn.Module, str]]:
    """With one B/C group and tp > 1 every rank's heads read the whole group: its ``in_proj`` and
    ``conv1d`` rows (``*_B``, ``*_C``) are replicated (``Replicate`` DTensors, gradient summed over
    TP at each forward, ``SHARED_GROUPS``); returns those ``(module, name)`` slots."""
    if not replicated_groups(mixer.n_groups, mesh.size()):
        return []
    shared = [(sub, name) for sub in (mixer.in_proj, mixer.conv1d) for name in sub._parameters
              if name.endswith(("_B", "_C")) and sub._parameters[name] is not None]
    for sub, name in shared:
        param = sub._parameters[name]
        replicated = distribute_tensor(param.data, mesh, [Replicate()])
        sub.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
    setattr(mixer, SHARED_GROUPS, shared)
    return shared


def spanning_group_norm(norm: nn.Module, group, full_width: int):
    """The forward of a gated RMSNorm whose one group spans every TP rank (``n_groups == 1``): each
    rank holds ``d/tp`` channels, and the group's two means (forward ``mean(u^2)``, backward
    ``mean(g n)``) all-reduce ``[B, S, 1]`` partial sums over TP (``blocks.gated_rms_norm`` with
    ``span``: it saves only its inputs and ``rstd``). Ours (``eps``) and transformers' norms
    (``variance_epsilon``) alike; Falcon-H1's ``norm_before_gate`` (norm, weight, then the gate)
    runs on autograd with the same all-reduce."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    span = (lambda partial_sum: all_reduce(partial_sum, group), full_width)

    def forward(hidden_states, gate=None):
        if not getattr(norm, "norm_before_gate", False):
            return gated_rms_norm(hidden_states, gate, norm.weight, hidden_states.shape[-1], eps, span)
        dtype, compute = hidden_states.dtype, torch.promote_types(hidden_states.dtype, torch.float32)
        hidden = hidden_states.to(compute)
        squares = AllReduceGrad.apply(all_reduce(hidden.pow(2).sum(-1, keepdim=True), group), group)  # [B, S, 1]
        hidden = norm.weight * (hidden * torch.rsqrt(squares / full_width + eps))
        return (hidden * F.silu(gate.to(compute)) if gate is not None else hidden).to(dtype)

    return forward


class MambaHeadParallel(ParallelStyle):
    """Shard a ``Mamba2Mixer`` by heads (see the module docstring); splits it first if needed.

    ``sequence_parallel``: the output is reduce-scattered to a ``Shard(1)`` DTensor
    ``[B, S/tp, D]`` instead of all-reduced to a plain ``[B, S, D]`` tensor.
    """

    def __init__(self, *, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _shard(self, module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
        param = module._parameters[name]
        if param is None or isinstance(param, DTensor):
            return
        sharded = distribute_tensor(param.data, mesh, [placement], src_data_rank=self.src_data_rank)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Mamba2Mixer):
            raise ValueError(f"MambaHeadParallel shards Mamba2Mixer modules, got {type(module).__name__}.")
        _check_mamba_divisible(module, device_mesh.size(), type(module).__name__)
        split_mamba_mixers(module)
        shared = replicate_shared_groups(module, device_mesh)
        for sub in (module, module.in_proj, module.conv1d, module.norm):
            for name in list(sub._parameters):
                if (sub, name) not in shared:  # heads (z, x, dt, conv x, per-head) or groups (B, C)
                    self._shard(sub, name, device_mesh, Shard(0))
        if shared:
            module.norm.forward = spanning_group_norm(module.norm, device_mesh.get_group(), module.intermediate_size)
        row_parallel_exit(module.out_proj, device_mesh, self.sequence_parallel)  # y_local [B, S, d/tp]
        module.register_forward_pre_hook(partial(self._enter, device_mesh), with_kwargs=True)
        module.register_forward_hook(self._exit, always_call=True)  # restore even if forward raises
        return module

    @staticmethod
    def _enter(mesh: DeviceMesh, mixer: nn.Module, args, kwargs):
        args, kwargs = local_mixer_input(mesh, args, kwargs)
        saved = []
        for sub in (mixer, mixer.in_proj, mixer.conv1d, mixer.norm):
            for name, param in list(sub._parameters.items()):
                if isinstance(param, DTensor):
                    saved.append((sub, name, param))
                    sub._parameters[name] = param.to_local()  # local shard for this forward
        for sub, name in getattr(mixer, SHARED_GROUPS, ()):  # every rank's heads give part of their gradient
            sub._parameters[name] = AllReduceGrad.apply(sub._parameters[name], mesh.get_group())
        mixer.__dict__.setdefault("_tp_saved_parameters", []).append(saved)
        return args, kwargs

    @staticmethod
    def _exit(mixer: Mamba2Mixer, args, output):
        stack = mixer.__dict__.get("_tp_saved_parameters")
        for sub, name, param in stack.pop() if stack else ():
            sub._parameters[name] = param
        return output

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_parallel={self.sequence_parallel})"


# --------------------------------------------------------------------------------------
# Validation and the HybridLM plan


def _require(value: int, tp: int, what: str, fix: str) -> None:
    if value % tp:
        raise ValueError(f"{what}={value} is not divisible by tp={tp}; {fix}")


def _check_mamba_divisible(mixer: Mamba2Mixer, tp: int, where: str) -> None:
    valid_tp = [t for t in range(1, mixer.num_heads + 1) if mixer.num_heads % t == 0 and tp_groups(mixer.n_groups, t)]
    fix = f"use a tp dividing mamba_num_heads and mamba_n_groups (one of {valid_tp}) or change the config"
    _require(mixer.num_heads, tp, f"{where}: mamba_num_heads", fix)
    if not tp_groups(mixer.n_groups, tp):
        _require(mixer.n_groups, tp, f"{where}: mamba_n_groups",
                 fix + " (groups are split over TP; a single group is replicated)")


def validate_hybrid_tp(model: nn.Module, tp: int) -> None:
    """Raise ``ValueError`` (field, value, tp and the fix) for sizes the HybridLM plan cannot shard."""
    for name, module in model.named_modules():
        where = f"module {name!r}"
        if isinstance(module, Mamba2Mixer):
            _check_mamba_divisible(module, tp, where)
        elif isinstance(module, Attention):
            _require(module.num_heads, tp, f"{where}: num_attention_heads", "choose a tp dividing the heads.")
            _require(module.num_kv_heads, tp, f"{where}: num_key_value_heads", "choose a tp dividing the kv heads.")
        elif isinstance(module, MLP):
            _require(module.up_proj.out_features, tp, f"{where}: intermediate_size", "choose a tp dividing it.")


def hybrid_lm_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The HybridLM plan: attention q/k/v and MLP up/gate column-parallel, o/down row-parallel,
    the Mamba2 mixer by heads, vocab-parallel embedding, LM head vocab-sharded (``Shard(0)``)
    with a vocab-parallel loss; with ``sequence_parallel`` the residual stream is ``Shard(1)``.

    With labels, ``HybridLM.forward`` computes the loss through ``loss_core``, which the root
    entry ``""`` makes vocab-parallel: no logits and no gather (SP: the final hidden states
    ``[B, S/tp, D]`` are gathered to ``[B, S, D]``). Without labels the ``lm_head`` module
    returns full logits ``[B, S, V/tp] -> [B, S, V]`` (generation, tests)."""
    sp = sequence_parallel
    out = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    plan: dict[str, ParallelStyle] = {"": VocabParallelLoss()}
    if sp:  # ids [B, S] -> [B, S/tp, D]; norms all-gather once; norm_f stays sharded
        plan["backbone"] = SequenceShardedInputsEmbeds()
        plan["backbone.embeddings"] = VocabParallelEmbedding(output_layouts=Shard(1), use_local_output=False)
        plan["backbone.layers.*.norm"] = SequenceParallelAllGatherActivation(use_local_output=False)
        plan["backbone.norm_f"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    else:
        plan["backbone.embeddings"] = VocabParallelEmbedding()
        plan["backbone.layers.*.norm"] = LocalReplicateParallel()
        plan["backbone.norm_f"] = LocalReplicateParallel()
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())  # logits only: [B, S, V/tp] -> [B, S, V]
    for index, layer in enumerate(model.backbone.layers):
        prefix = f"backbone.layers.{index}.mixer"
        mixer = layer.mixer
        if isinstance(mixer, Mamba2Mixer):
            plan[prefix] = MambaHeadParallel(sequence_parallel=sp)
            continue
        plan[prefix] = ReplicatedMixerInput()
        if isinstance(mixer, Attention):
            plan.update({f"{prefix}.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")})
            plan[f"{prefix}.o_proj"] = RowwiseParallel(**out)
        elif isinstance(mixer, MLP):
            plan.update({f"{prefix}.{p}": ColwiseParallel() for p in ("up_proj", "gate_proj") if getattr(mixer, p) is not None})
            plan[f"{prefix}.down_proj"] = RowwiseParallel(**out)
        else:
            raise ValueError(f"{prefix} is a {type(mixer).__name__}; the HybridLM plan knows Mamba2Mixer, Attention "
                             "and MLP mixers. Pass a plan dict for other mixers.")
    return plan


# Replaces the lazy entry in plans.py with the same plan plus the HybridLM size check.
register_tp_plan("hybridpar.models.hybrid.HybridLM", hybrid_lm_plan, aliases=("HybridLM",),
                 validate=validate_hybrid_tp, replace=True)
