"""FSDP2 over the data-parallel mesh, and the TP layout of every parameter.

``apply_fsdp`` makes every block (decoder layer / hybrid block) and the root an FSDP2 unit
(submodules whose parameters several blocks share, Zamba2's shared attention block, one unit of
their own first: ``shared_submodules``), sharded over ``dp_shard_cp`` (1-D) or HSDP
``(dp_replicate, dp_shard_cp)`` (2-D). FSDP's own
gradient division is off (divide factor 1, SUM reductions): the loss already divides by the
global token count, and ``ReduceOp.AVG`` on gloo is silently wrong (pytorch#162338).

Traffic per unit and optimizer step with m micro-batches (S = this rank's padded shard bytes
of the unit, P = shard size; ``set_micro_batch`` before each micro-batch):

    reshard_after_forward   all-gathers                         reduce-scatters (+ HSDP all-reduce)
    True                    2m (forward + backward); root m     1, after the last backward
    int k                   m over P + m over k; root m         1
    False                   1 (every unit, root included,       1
                            kept gathered to the last backward)

Without ``set_micro_batch`` FSDP reduces after every backward (m reduce-scatters).

``parameter_layouts`` (every parameter's TP layout, Megatron's rule order) lives in
``param_layouts`` and is re-exported here.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from hybridpar.config_rules import Notice
from hybridpar.parallel.checkpointing import find_blocks
from hybridpar.parallel.dims import ParallelDims
from hybridpar.parallel.precision import float32_owners, read_directly
from hybridpar.parallel.data.param_layouts import MODULE_TP_DIMS, Layout, parameter_layouts

__all__ = [
    "register_first_pre_hook",
    "apply_fsdp", "set_micro_batch", "check_reshard_after_forward", "fsdp_units", "Layout", "parameter_layouts",
    "MODULE_TP_DIMS",
]

# Parameter attributes FSDP2 drops when it re-creates parameters; apply_fsdp copies them back.
_KEPT_PARAM_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel")


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The blocks to shard one by one: ``model._fsdp_units`` (modules or names, or a method
    returning them) if the model gives it, else the blocks of ``checkpointing.find_blocks``
    (``model.layers`` and the like, or a transformers model's ``_no_split_modules`` blocks)."""
    hint = getattr(model, "_fsdp_units", None)
    if hint is not None:
        units = hint() if callable(hint) else hint
        return [model.get_submodule(u) if isinstance(u, str) else u for u in units]
    blocks = find_blocks(model)
    return [] if blocks is None else list(blocks)


FIRST_PRE_HOOKS = "_hybridpar_first_pre_hooks"


def register_first_pre_hook(module: nn.Module, hook) -> None:
    """Register ``hook(module, args, kwargs)`` as ``module``'s first forward pre-hook, ahead of FSDP2's
    too: ``fully_shard`` prepends its own, so ``apply_fsdp`` moves these to the front again."""
    handle = module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
    setattr(module, FIRST_PRE_HOOKS, [*getattr(module, FIRST_PRE_HOOKS, []), (hook, handle)])


def _keep_first_pre_hooks(model: nn.Module) -> None:
    for module in model.modules():
        hooks = getattr(module, FIRST_PRE_HOOKS, [])
        for hook, handle in hooks:
            handle.remove()
        setattr(module, FIRST_PRE_HOOKS, [])
        for hook, _ in reversed(hooks):
            register_first_pre_hook(module, hook)


def shared_submodules(units: list[nn.Module]) -> list[list[nn.Module]]:
    """Groups of the outermost submodules of different units that hold the same shared parameters
    (Zamba2's shared attention block: every hybrid layer has its own copy of the module with the
    parameters tied; LoRA adapters on a copy are its own). FSDP2 refuses a parameter in two groups,
    so each group becomes one FSDP unit of its own (``fully_shard([copy_a, copy_b])``), sharded
    before the units that hold it; a shared parameter's gradient sums over the copies."""
    units_of: dict[int, set[int]] = {}
    for index, unit in enumerate(units):
        for param in unit.parameters():
            units_of.setdefault(id(param), set()).add(index)

    def collect(modules: list[nn.Module]) -> list[list[nn.Module]]:
        groups: dict[frozenset, list[nn.Module]] = {}
        for module in modules:
            for child in module.children():
                shared = frozenset(id(p) for p in child.parameters() if len(units_of[id(p)]) > 1)
                if shared and not any(m is child for m in groups.get(shared, ())):
                    groups.setdefault(shared, []).append(child)
        found = [group for group in groups.values() if len(group) > 1]
        cut_differently = [group[0] for group in groups.values() if len(group) == 1]  # pair them a level down
        return found + (collect(cut_differently) if cut_differently else [])

    return collect(units)


def _mixed_precision(mixed_precision) -> MixedPrecisionPolicy:
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(f"mixed_precision={mixed_precision!r} is not supported; use None, 'bf16' or a MixedPrecisionPolicy")


def float32_units(model: nn.Module, units: list[nn.Module], policy: MixedPrecisionPolicy) -> list[tuple]:
    """``(module or group, policy)`` to shard before the blocks so that what transformers keeps in float32
    (``precision.float32_owners``: MoE routers' ``gate.weight``, ``sinks``, ``dt_bias``, ``expert_bias``, ...) is
    gathered in float32 under a bf16 policy, as one process computes it (round 31: a router gathered in bf16 picked
    other experts for 0.7-1.6% of the tokens). FSDP2's dtype is per unit, so each owner is a unit of its own with
    ``param_dtype=float32``: a linear (its ``weight`` kept) casts its inputs to float32 as its forward does; an
    owner of bare parameters keeps its inputs, and its children that hold parameters are first one unit of the
    block's policy (``fully_shard([child, ...])``), so only the kept parameters change dtype. An owner that is a
    block itself, sits in no block (a kept ``lm_head``) or whose parent reads the kept parameter itself (its own
    forward never runs to gather it: ``precision.read_directly``, or a forward hybridpar replaced inside the block)
    stays in its unit's dtype, with one warning."""
    if policy.param_dtype in (None, torch.float32):
        return []
    owners, direct = float32_owners(model), {*read_directly(model), *_under_replaced_forward(model, units)}
    inside = {id(m) for unit in units for m in unit.modules() if m not in direct} - {id(unit) for unit in units}
    left = sorted({f"{type(m).__name__}.{leaf}" for m, leaves in owners.items() if id(m) not in inside for leaf in leaves})
    if left:
        warnings.warn(f"{type(model).__name__}: FSDP gathers {', '.join(left)} in {policy.param_dtype} though "
                      "transformers keeps them in float32 (they sit in no block, on a block itself, or their parent "
                      "reads them itself); train with parallel.mixed_precision=null to keep them float32.", Notice,
                      stacklevel=3)
    done: set[int] = set()  # parameters already in a unit
    out = []
    # innermost first: an owner inside another is sharded before it
    for owner in sorted((m for m in owners if id(m) in inside), key=lambda m: len(list(m.modules()))):
        matmul = "weight" in owners[owner]
        if not matmul:
            children = [c for c in owner.children() if any(id(p) not in done for p in c.parameters())]
            if children:
                out.append((children if len(children) > 1 else children[0], policy))
                done |= {id(p) for c in children for p in c.parameters()}
        out.append((owner, MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=policy.reduce_dtype,
                                                cast_forward_inputs=matmul)))
        done |= {id(p) for p in owner.parameters()}
    return out


def _under_replaced_forward(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Owners (``float32_owners``) below a module of their block whose forward hybridpar replaced (``switch_forward``:
    Kimi Linear's KDA reads ``forget_gate.dt_bias`` itself): the code that runs may read their parameters without
    their forward, so an FSDP unit of their own would leave them sharded there."""
    modules, owners, unit_ids, found = dict(model.named_modules()), float32_owners(model), {id(u) for u in units}, []
    for name, owner in ((n, m) for n, m in modules.items() if m in owners and n):
        path = name.rsplit(".", 1)[0] if "." in name else ""
        while path and id(modules[path]) not in unit_ids:
            ancestor = modules[path]
            if "forward" in vars(ancestor) and not hasattr(ancestor, "_forward_before_float32"):
                found.append(owner)
                break
            path = path.rsplit(".", 1)[0] if "." in path else ""
    return found


def check_reshard_after_forward(value, shard_size: int) -> bool | int:
    """``value`` as ``fully_shard`` takes it, or ``ValueError``: a bool, or an int dividing the
    FSDP shard size ``dp_shard * cp`` (the group size parameters are resharded to after
    forward; 1 means False and ``shard_size`` True)."""
    if isinstance(value, bool):
        return value
    divisors = [k for k in range(1, shard_size + 1) if shard_size % k == 0]
    if not isinstance(value, int) or value not in divisors:
        raise ValueError(
            f"reshard_after_forward={value!r} is neither a bool nor a divisor of the FSDP shard size "
            f"dp_shard*cp = {shard_size}; use true (reshard, least memory), false (keep parameters gathered "
            f"for the whole step) or one of {divisors} (reshard to groups of that size).")
    if value in (1, shard_size):
        return value == shard_size
    return value


def apply_fsdp(model: nn.Module, mesh, dims: ParallelDims, mixed_precision=None,
               reshard_after_forward: bool | int = True) -> nn.Module:
    """``fully_shard`` every block of ``model`` and the root over the data-parallel mesh.

    ``mesh`` is the root mesh from ``dims.build_mesh()``. Blocks reshard after forward as
    ``reshard_after_forward`` says (see the module docstring); the root never does (its
    parameters are needed first in backward). ``mixed_precision``: None (compute in the
    parameter dtype), ``"bf16"`` (bf16 parameters in compute, fp32 gradient reduction) or a
    ``MixedPrecisionPolicy``. Apply after tensor parallelism; TP parameters become 2-D DTensors (dp, tp).
    """
    if tuple(mesh.mesh_dim_names or ()) != ("dp_replicate", "dp_shard", "cp", "tp"):
        raise ValueError(f"apply_fsdp needs the root mesh from ParallelDims.build_mesh(), got dims "
                         f"{mesh.mesh_dim_names}")
    if tuple(mesh.shape) != (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp):
        raise ValueError(f"mesh shape {tuple(mesh.shape)} does not match {dims}; build the mesh from these dims")
    reshard_after_forward = check_reshard_after_forward(reshard_after_forward, dims.size("dp_shard_cp"))
    dp_mesh = dims.fsdp_mesh(mesh)
    policy = _mixed_precision(mixed_precision)
    kept = {name: {a: getattr(p, a) for a in _KEPT_PARAM_ATTRS if hasattr(p, a)}
            for name, p in model.named_parameters()}
    units = fsdp_units(model)
    if not units:
        warnings.warn(f"{type(model).__name__} has no model.layers / backbone.layers / layers / _fsdp_units; "
                      "sharding the root as one FSDP unit", Notice, stacklevel=2)
    for unit, unit_policy in [*float32_units(model, units, policy), *(
            (unit, policy) for unit in [group if len(group) > 1 else group[0] for group in shared_submodules(units)] + units)]:
        fully_shard(unit, mesh=dp_mesh, mp_policy=unit_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
    _keep_first_pre_hooks(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    for name, param in model.named_parameters():
        for attr, value in kept.get(name, {}).items():
            setattr(param, attr, value)
    model._fsdp_keep_gathered = reshard_after_forward is False
    return model


def set_micro_batch(model: nn.Module, index: int, count: int) -> None:
    """Call before micro-batch ``index`` (0-based) of the ``count`` that make one optimizer step.

    FSDP reduces gradients (reduce-scatter, and HSDP's all-reduce) only in the last one's
    backward; until then every rank accumulates unsharded gradients of the units it runs
    (more memory, one reduction per step). With ``reshard_after_forward=False`` parameters
    also stay gathered until that last backward. A model without FSDP is left alone.
    """
    if not isinstance(model, FSDPModule):
        return
    if not 0 <= index < count:
        raise ValueError(f"micro-batch index {index} is outside 0..{count - 1}; pass index < count.")
    last = index == count - 1
    model.set_requires_gradient_sync(last)
    if getattr(model, "_fsdp_keep_gathered", False):
        model.set_reshard_after_backward(last)
