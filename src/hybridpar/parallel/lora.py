"""LoRA adapters laid out like their base layer's tensor-parallel style (``models/lora.py``).

The adapter ``(alpha/r) B(A x)`` runs in a forward hook of the base module, after the style's
input conversion and before its output conversion, so it shares the base layer's collective:

- column-parallel base (``ColwiseParallel``; the Mamba ``in_proj`` split per component):
  ``A [r, in]`` replicated, ``B [out, r]`` sharded by output rows (``Shard(0)``; per component
  ``z, x, B, C, dt`` for the Mamba ``in_proj``, like its weights)::

      x [B, S, D] (replicated, SP: gathered by the base's input conversion)
        -> A: h [B, S, r] (replicated) -> B_local: [B, S, out/tp] + base output shard

- row-parallel base (``RowwiseParallel``, the Mamba ``out_proj``): ``A`` sharded by input
  columns (``Shard(1)``), ``B`` replicated::

      x [B, S, in/tp] -> A_local: h [B, S, r] partial -> B: [B, S, D] partial
        + base partial -> the base's all-reduce (SP: reduce-scatter) -> [B, S, D]

- a base TP leaves whole (``LocalReplicateParallel``, left-over modules): ``A``, ``B``
  replicated, computed on local tensors;
- a base on this rank's tokens (``TokenwiseParallel``, Zamba2's ``linear`` under SP): ``A``, ``B``
  replicated, computed on the local tokens ``[B, S/tp, in]``; each rank's gradient covers its own
  tokens, so both are summed over TP in backward (``AllReduceGrad``, like the base weight's).

No forward collective is added. The replicated factor's gradient is a partial sum over TP
(column: ``dA = sum_r (dy_r B_r)^T x``; row: ``dB = dy^T sum_r h_r``), reduced once in
backward ([r, in] or [out, r] elements, like a replicated norm weight's under SP). Packed
(``PackedColwiseParallel``), ``Conv1D``, embedding and MoE styles are refused with a
``ValueError`` by ``check_lora_pairing`` before any collective.

Stacked MoE experts (``models/lora_experts.py``; ``GroupedExpertsParallel`` shards every expert on
its intermediate dim ``I``): the factor on ``I`` is sharded like the weight, the other replicated
with its gradient summed over TP in backward (``AllReduceGrad``; [r*E, D] or [D, r*E] elements)::

    gate_up_proj / up_proj (I = out): B [2I, r*E] rows like the weight (gate and up rows each
        ``Shard(0)``, ``GateUpB``: [gate_r | up_r]), A [r*E, D] replicated -> delta_e [2I/tp, D] = B_e^r A_e
    down_proj (I = in):               A [r*E, I] ``Shard(1)``, B [D, r*E] replicated
        -> delta_e [D, I/tp] = B_e A_e^r

so each rank adds its shard of the update to its shard of the weight inside the experts' call;
the experts' own all-reduce of the output is the only forward collective. Other styles on adapted
experts are refused by ``check_lora_pairing``.

A gated DeltaNet sharded by heads (``GDNHeadParallel``) pairs its projections as components (``B``
sharded by rows, as stored or per component; ``A`` replicated) and ``out_proj`` row-wise.

``split_lora_components`` moves an adapter onto the per-component Mamba ``in_proj``
(``parallel/tensor/hybrid.py``); ``LoRAComponentsB`` fuses back to ``in_proj.lora_B.weight`` in
``canonical_state_dict``.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from hybridpar.models.hf.mixers.gdn import MARK as GDN_MARK
from hybridpar.models.lora import LORA_PARAMETERS, lora_forward_hook, lora_modules
from hybridpar.models.lora_experts import GateUpB, adapter_child, expert_lora_modules
from hybridpar.models.hf.mixers.mamba1 import MAMBA1_MARK
from hybridpar.models.hf.mixers.mamba2 import MARK as MAMBA_CORE_MARK
from hybridpar.models.hf.mixers.short_conv import SHORT_CONV_MARK
from hybridpar.models.mamba.mixer import Mamba2Mixer
from hybridpar.parallel.tensor.check import matches
from hybridpar.parallel.tensor.linear_styles import Conv1DColwiseParallel, Conv1DRowwiseParallel
from hybridpar.parallel.tensor.moe import GroupedExpertsParallel
from hybridpar.parallel.tensor.styles import (AllReduceGrad, LocalReplicateParallel, TokenwiseParallel,
                                              VocabParallelEmbedding)

__all__ = ["LoRAComponentsB", "split_lora_components", "lora_pairings", "check_lora_pairing",
           "detached_adapters", "pair_lora"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class LoRAComponentsB(nn.Module):
    """LoRA ``B`` of the Mamba ``in_proj`` stored per component (``weight_z ... weight_dt``),
    rows in fused order; the forward concatenates the (local) components like ``SplitInProj``."""

    def __init__(self, weight: torch.Tensor, sizes: dict[str, int]):
        super().__init__()
        self.component_sizes = dict(sizes)
        for name, part in zip(sizes, weight.detach().split(list(sizes.values()), dim=0)):
            self.register_parameter(f"weight_{name}", nn.Parameter(part.clone(), requires_grad=weight.requires_grad))

    def fused_parameters(self) -> dict[str, list[str]]:
        return {"weight": [f"weight_{name}" for name in self.component_sizes]}

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # [B, S, r] @ [c_l, r]^T -> [B, S, c_l] per component, cat -> [B, S, z_l | x_l | B_l | C_l | dt_l]
        return torch.cat([F.linear(h, _local(getattr(self, f"weight_{n}"))) for n in self.component_sizes], dim=-1)


def split_lora_components(fused: nn.Module, split: nn.Module, sizes: dict[str, int]) -> None:
    """Carry ``fused``'s adapter (if any) to its per-component replacement ``split``."""
    if getattr(fused, "lora_scaling", None) is None:
        return
    split.lora_A = fused.lora_A
    split.lora_B = LoRAComponentsB(fused.lora_B.weight, sizes)
    split.lora_dropout = fused.lora_dropout
    split.lora_scaling, split.lora_rank = fused.lora_scaling, fused.lora_rank
    split.register_forward_hook(lora_forward_hook)


# ----------------------------------------------------------------------------- pairing rules


def _style_kind(style: ParallelStyle, module: nn.Module) -> str | None:
    if isinstance(style, (Conv1DColwiseParallel, Conv1DRowwiseParallel, VocabParallelEmbedding)):
        return None
    if not isinstance(module, nn.Linear):
        return None
    if isinstance(style, ColwiseParallel):
        return "colwise"
    if isinstance(style, RowwiseParallel):
        return "rowwise"
    if isinstance(style, TokenwiseParallel):
        return "tokenwise"
    if isinstance(style, LocalReplicateParallel) and not style.grad_allreduce and style.output_layouts is None \
            and getattr(style, "pairs_lora", True):  # (mla.LatentDownParallel: its output gradient is summed in a hook)
        return "replicated"
    return None


def _pairing(name: str, module: nn.Module, styles: dict[str, ParallelStyle],
             modules: dict[str, nn.Module]) -> tuple[str | None, str]:
    """(kind or None, the style that decided it) for the adapter on module ``name``."""
    own = [s for p, s in styles.items() if p and matches(name, p)]
    if own:
        return _style_kind(own[-1], module), repr(own[-1])
    atoms = name.split(".")
    for cut in range(len(atoms) - 1, -1, -1):
        prefix = ".".join(atoms[:cut])
        above = [s for p, s in styles.items() if (matches(prefix, p) if p else cut == 0)]
        for style in above:
            mixer = modules.get(prefix)
            kinds = getattr(style, "lora_kinds", None)
            if kinds is not None:  # a block style naming its children's pairings (hf_plans/local_heads.py)
                return (kinds.get(atoms[-1]) if cut == len(atoms) - 1 else None), repr(style)
            ours = isinstance(mixer, Mamba2Mixer) or getattr(mixer, MAMBA_CORE_MARK, False)
            if getattr(mixer, GDN_MARK, False) and not isinstance(style, LocalReplicateParallel):
                # GDNHeadParallel: every projection sharded by rows (per component or as stored), out_proj rowwise
                kind = ("rowwise" if atoms[-1] in ("out_proj", "o_proj") else "components") \
                    if cut == len(atoms) - 1 else None
                return kind, repr(style)
            if getattr(mixer, MAMBA1_MARK, False) and not isinstance(style, LocalReplicateParallel):
                # Mamba1ChannelParallel: in_proj per component, dt_proj by rows (on local tensors), out_proj
                # rowwise; x_proj (row-parallel, its output all-reduced inside the mixer) has no pairing
                kinds = {"in_proj": "components", "dt_proj": "components", "out_proj": "rowwise"}
                return (kinds.get(atoms[-1]) if cut == len(atoms) - 1 else None), repr(style)
            if (ours or getattr(mixer, SHORT_CONV_MARK, False)) and not isinstance(style, LocalReplicateParallel):
                # our mixers' styles (MambaHeadParallel, ShortConvChannelParallel): in_proj per component,
                # out_proj rowwise
                leaf = atoms[-1]
                kind = {"in_proj": "components", "out_proj": "rowwise"}.get(leaf) if cut == len(atoms) - 1 else None
                return kind, repr(style)
            if isinstance(style, LocalReplicateParallel):
                return ("replicated" if not style.grad_allreduce else None), repr(style)
    return "replicated", "none (replicated as a left-over module)"


def lora_pairings(model: nn.Module, styles: dict[str, ParallelStyle]) -> dict[str, str]:
    """``{adapter module name: colwise | rowwise | components | replicated | tokenwise}``; raises ``ValueError``
    for an adapter whose base layer's style has no pairing."""
    out = {}
    modules = dict(model.named_modules())
    for name, module in lora_modules(model).items():
        kind, style = _pairing(name, module, styles, modules)
        if kind is None:
            raise ValueError(f"LoRA target {name!r} ({type(module).__name__}) is tensor-parallel with {style}, "
                             "which LoRA cannot pair (packed, Conv1D, embedding or per-head styles); drop it from "
                             "peft.target_modules or use parallel.tp=1.")
        out[name] = kind
    for name in expert_lora_modules(model):
        own = [s for p, s in styles.items() if p and matches(name, p)]
        if not own or not isinstance(own[-1], GroupedExpertsParallel):
            style = repr(own[-1]) if own else "no plan entry (replicated as a left-over module)"
            raise ValueError(f"LoRA expert adapters on {name!r} need its experts sharded by GroupedExpertsParallel "
                             f"under TP, but it has {style}; drop them from peft.target_parameters or use parallel.tp=1.")
        out[name] = "experts"
    return out


def check_lora_pairing(model: nn.Module, styles: dict[str, ParallelStyle]) -> None:
    """``lora_pairings`` for its error only (no mesh, no collective)."""
    lora_pairings(model, styles)


@contextlib.contextmanager
def detached_adapters(model: nn.Module):
    """Take the adapter children off their base modules while the base plan is applied
    (torch's styles distribute every parameter of the module they shard), then put them back."""
    taken = []
    for module in lora_modules(model).values():
        children = {n: module._modules.pop(n) for n in (*LORA_PARAMETERS, "lora_dropout")}
        taken.append((module, children))
    for module in expert_lora_modules(model).values():
        taken.append((module, {n: module._modules.pop(n) for n in map(adapter_child, module.lora_parameters)}))
    try:
        yield
    finally:
        for module, children in taken:
            module._modules.update(children)


def _distribute(module: nn.Module, placement, mesh: DeviceMesh) -> None:
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                dist = distribute_tensor(param.data, mesh, [placement])
                sub.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


def _shared_components(split_in_proj: nn.Module) -> list[str]:
    """Components of a per-component ``in_proj`` that tensor parallelism left replicated."""
    names = getattr(split_in_proj.lora_B, "component_sizes", {})
    return [n for n in names if isinstance(w := getattr(split_in_proj, f"weight_{n}", None), DTensor)
            and w.placements == (Replicate(),)]


def _distribute_one(module: nn.Module, name: str, placement, mesh: DeviceMesh) -> None:
    param = module._parameters[name]
    module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, mesh, [placement]),
                                                 requires_grad=param.requires_grad))


def _local_params_pre(reduce_grad_group, module, args, only: set[str] | None = None):
    """Plain input: run on local shards; the gradient of every parameter (or of those named in
    ``only``) is summed over ``reduce_grad_group`` (``A`` when B is sharded; B's replicated rows)."""
    if isinstance(args[0], DTensor) or not any(isinstance(p, DTensor) for p in module._parameters.values()):
        module.__dict__.setdefault("_lora_saved", []).append(())
        return None
    saved = []
    for name, param in list(module._parameters.items()):
        if isinstance(param, DTensor):
            local = param.to_local()
            if reduce_grad_group is not None and local.requires_grad and (only is None or name in only):
                local = AllReduceGrad.apply(local, reduce_grad_group)
            saved.append((name, param))
            module._parameters[name] = local
    module.__dict__.setdefault("_lora_saved", []).append(tuple(saved))
    return None


def _local_params_post(module, args, output):
    for name, param in module.__dict__["_lora_saved"].pop():
        module._parameters[name] = param
    return output


def _replicate_partial_grad(param: nn.Parameter) -> None:
    """The replicated factor's partial-sum gradient -> ``Replicate`` (one all-reduce, [r, in] or [out, r])."""
    grad = param.grad
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        param.grad = grad.redistribute(grad.device_mesh, param.placements)


def pair_lora(model: nn.Module, tp_mesh: DeviceMesh, styles: dict[str, ParallelStyle]) -> dict[str, str]:
    """Distribute every adapter over ``tp_mesh`` to match its base layer (see the module docstring)."""
    kinds = lora_pairings(model, styles)
    modules = lora_modules(model)
    for name, module in expert_lora_modules(model).items():
        pair_expert_lora(module, tp_mesh)
    for name, kind in kinds.items():
        if kind == "experts":
            continue
        module = modules[name]
        a, b = module.lora_A, module.lora_B
        a_place, b_place = {"colwise": (Replicate(), Shard(0)), "rowwise": (Shard(1), Replicate()),
                            "components": (Replicate(), Shard(0)), "replicated": (Replicate(), Replicate()),
                            "tokenwise": (Replicate(), Replicate())}[kind]
        _distribute(a, a_place, tp_mesh)
        shared = _shared_components(module) if kind == "components" else []
        for part in shared:  # one B/C group read by every rank's heads (n_groups < tp): replicated like the base
            _distribute_one(b, f"weight_{part}", Replicate(), tp_mesh)
        _distribute(b, b_place, tp_mesh)
        if shared:  # each rank's heads add to the shared rows' gradient: summed over TP
            b.register_forward_pre_hook(partial(_local_params_pre, tp_mesh.get_group(), only={f"weight_{p}" for p in shared}))
            b.register_forward_hook(_local_params_post, always_call=True)
        for param in (*a.parameters(), *b.parameters()):  # without FSDP (FSDP2 reduces TP-partial grads itself)
            if param.requires_grad and isinstance(param, DTensor) and param.placements == (Replicate(),):
                param.register_post_accumulate_grad_hook(_replicate_partial_grad)
        if kind in ("components", "replicated", "tokenwise"):  # the base computes on plain local tensors
            group = tp_mesh.get_group() if kind in ("components", "tokenwise") else None
            a.register_forward_pre_hook(partial(_local_params_pre, group))
            a.register_forward_hook(_local_params_post, always_call=True)
            if kind != "components" or not isinstance(b, LoRAComponentsB):  # B as a plain Linear: rows local
                b.register_forward_pre_hook(partial(_local_params_pre, group if kind == "tokenwise" else None))
                b.register_forward_hook(_local_params_post, always_call=True)
    return kinds


def pair_expert_lora(experts: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Lay out the factors of each adapted stacked weight of ``experts`` (sharded by
    ``GroupedExpertsParallel``) as the module docstring says."""
    group = tp_mesh.get_group()
    for parameter in experts.lora_parameters:
        adapter = getattr(experts, adapter_child(parameter))
        placement = experts._parameters[parameter].placements[0]  # the weight's, on its I dim
        out_dim = 2 if adapter.transposed else 1  # [E, out, in]; transposed [E, in, out]
        if placement.dim == out_dim:  # I = out: B's rows like the weight's, A replicated
            if isinstance(placement, _StridedShard) and not isinstance(adapter.lora_B, GateUpB):
                raise ValueError(f"{type(experts).__name__}.{parameter}: a strided TP shard needs the gate/up "
                                 "rows of LoRA's B stored apart (GateUpB); use parallel.tp=1 for this model.")
            sharded, replicated, shard_placement = "lora_B", "lora_A", Shard(0)  # GateUpB: gate and up each by rows
        else:  # I = in: A's columns, B replicated (Llama 4's gate_up as peft reads it: strided like the weight)
            shard_placement = _StridedShard(1, split_factor=placement.split_factor) \
                if isinstance(placement, _StridedShard) else Shard(1)
            sharded, replicated = "lora_A", "lora_B"
        _distribute(getattr(adapter, sharded), shard_placement, tp_mesh)
        _distribute(getattr(adapter, replicated), Replicate(), tp_mesh)
        # the replicated factor's gradient is a partial sum over TP: [r*E, D] or [D, r*E] all-reduced in backward
        adapter.factor_hooks = {replicated: partial(_all_reduce_grad, group=group)}


def _all_reduce_grad(tensor: torch.Tensor, group) -> torch.Tensor:
    return AllReduceGrad.apply(tensor, group) if tensor.requires_grad else tensor
