"""Tensor and sequence parallelism: plan selection, checks and ``apply_tp``.

Plan lookup order (``get_tp_plan``):

1. the user's plan: a dict ``{pattern: ParallelStyle or Hugging Face style string}``, a
   callable ``plan_fn(model, sequence_parallel)``, or a registered name (unknown names
   raise ValueError listing the known ones);
2. the registry entry for the model class (``module.qualname``, then the bare class name);
3. the model's Hugging Face ``tp_plan`` (no sequence parallelism);
4. the generic ``"default"`` plan.

``check_tp_plan`` resolves the plan and runs every check that needs no mesh: the plan's
size validation, then ``tp_check.check_plan`` (module types, sharded sizes, whole heads,
head-count attributes, and under sequence parallelism the coverage of every norm and of the
residual stream). ``apply_tp`` runs it first, so a plan that does not fit is refused with a
ValueError before any collective; then it applies the plan with torch's
``parallelize_module``, re-ties tied weights, turns every parameter the plan left alone into
a replicated DTensor (``LocalReplicateParallel``: optimizers and ``clip_grad_norm_`` see one
tensor type), and reports the fraction of parameter elements each rank holds
(``model._tp_shard_report``, ``tp_report``; a warning above 75% at tp >= 2).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from hybridpar.config_rules import Notice
from hybridpar.parallel.tensor.check import (
    check_plan,
    compress_names,
    matched_modules,
    matches,
    refuse_attention_sinks,
    sp_uncovered,
    validate_tp_sizes,
)
from hybridpar.parallel.lora import check_lora_pairing, detached_adapters, pair_lora
from hybridpar.parallel.dropout import shard_token_dropouts
from hybridpar.parallel.tensor.plans import hf_style, hf_tp_plan
from hybridpar.parallel.tensor.registry import (
    PlanEntry,
    class_key,
    known_plan_names,
    lookup_tp_plan,
    register_tp_plan,
    unregister_tp_plan,
)
from hybridpar.parallel.tensor.report import TPShardReport, report_tp_sharding, tp_shard_report
from hybridpar.parallel.tensor.styles import LocalReplicateParallel, restore_params, swap_in_local_params

logger = logging.getLogger(__name__)

__all__ = [
    "TPPlan", "get_tp_plan", "check_tp_plan", "apply_tp", "validate_tp_sizes", "register_tp_plan",
    "unregister_tp_plan", "known_plan_names", "class_key", "TPShardReport", "tp_shard_report",
]

PlanLike = dict | str | Callable | None


@dataclass
class TPPlan:
    """A resolved plan and where it came from ("user", "registry:<key>", "hf", "default")."""

    styles: dict[str, ParallelStyle]
    source: str
    entry: PlanEntry | None = None


def _from_entry(entry: PlanEntry, model: nn.Module, sequence_parallel: bool, source: str) -> TPPlan:
    entry.resolve()
    entry = lookup_tp_plan(entry.key) or entry  # the import may have re-registered the key
    if sequence_parallel and not entry.sequence_parallel:
        raise ValueError(
            f"TP plan {entry.key!r} does not support sequence parallelism; "
            "set sequence_parallel=False or pass a plan that supports it"
        )
    return TPPlan(dict(entry.resolve()(model, sequence_parallel)), source, entry)


def get_tp_plan(model: nn.Module, plan: PlanLike = None, sequence_parallel: bool = False) -> TPPlan:
    """Resolve the plan for ``model`` in the order user, registry, Hugging Face, default."""
    if isinstance(plan, dict):
        styles = {k: hf_style(v) if isinstance(v, str) else v for k, v in plan.items()}
        bad = {k: type(v).__name__ for k, v in styles.items() if not isinstance(v, ParallelStyle)}
        if bad:
            raise ValueError(f"plan values must be ParallelStyles or Hugging Face style strings, got {bad}")
        return TPPlan(styles, "user")
    if isinstance(plan, str):
        entry = lookup_tp_plan(plan)
        if entry is None:
            raise ValueError(f"unknown TP plan {plan!r}; known plans: {known_plan_names()}; "
                             "register one with register_tp_plan or pass a plan dict")
        return _from_entry(entry, model, sequence_parallel, f"registry:{entry.key}")
    if callable(plan):
        return TPPlan(dict(plan(model, sequence_parallel)), "user")
    if plan is not None:
        raise ValueError(f"plan must be a dict, a registered name or a callable, got {type(plan).__name__}")

    for name in (class_key(model), type(model).__name__):
        entry = lookup_tp_plan(name)
        if entry is not None:
            return _from_entry(entry, model, sequence_parallel, f"registry:{entry.key}")
    hf = hf_tp_plan(model)
    if hf is not None:
        if sequence_parallel:
            uncovered = compress_names(sp_uncovered(model, matched_modules(model, hf)))
            raise ValueError(
                f"{type(model).__name__} has no registered TP plan and its Hugging Face plan has no sequence "
                f"parallelism (it leaves {uncovered} off the sequence-sharded stream); set sequence_parallel=False "
                "or register a plan (register_tp_plan)"
            )
        return TPPlan(hf, "hf")
    warnings.warn(f"no TP plan for {class_key(model)}; using the generic 'default' (Llama-shaped) plan", Notice,
                  stacklevel=2)
    return _from_entry(lookup_tp_plan("default"), model, sequence_parallel, "default")


def _matching_plan(model: nn.Module, styles: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """Keep plan entries that match a module (plans list optional names, e.g. ``qkv_proj``)."""
    names = [n for n, _ in model.named_modules() if n]
    return {p: s for p, s in styles.items() if p == "" or any(matches(n, p) for n in names)}


def _parameter_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) sharing one Parameter object (tied weights), size > 1."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, name))
    return [group for group in slots.values() if len(group) > 1]


def _check_tied_slots(model: nn.Module, styles: dict) -> None:
    """ValueError for a tied weight that the plan shards in one module and leaves whole (replicated) in another
    (Bloom, MPT, Falcon, OPT: the HF plan's column-parallel ``lm_head`` shares its weight with an embedding no entry
    names), which ``_retie`` could only refuse after every rank built and sharded the model."""
    names = {id(m): n for n, m in model.named_modules()}
    for group in _parameter_slots(model):
        paths = [f"{names[id(module)]}.{name}" for module, name in group]
        planned = [any(p and matches(names[id(module)], p) for p in styles) for module, _ in group]
        if any(planned) and not all(planned):
            sharded = [path for path, yes in zip(paths, planned) if yes]
            whole = [path for path, yes in zip(paths, planned) if not yes]
            raise ValueError(f"tied weights {', '.join(paths)}: the TP plan shards {', '.join(sharded)} and leaves "
                             f"{', '.join(whole)} whole, so they cannot stay one tensor; use tp=1 (FSDP still shards "
                             "it), or a checkpoint with \"tie_word_embeddings\": false")


def _retie(model: nn.Module, tied_groups) -> None:
    """Point every slot of a tied group at the first slot's (now DTensor) parameter."""
    names = {id(m): n for n, m in model.named_modules()}
    for group in tied_groups:
        first_module, first_name = group[0]
        keep = first_module._parameters[first_name]
        for module, name in group[1:]:
            other = module._parameters[name]
            if other is keep:
                continue
            layout_keep = keep.placements if isinstance(keep, DTensor) else None
            layout_other = other.placements if isinstance(other, DTensor) else None
            if layout_keep != layout_other or keep.shape != other.shape:
                raise ValueError(
                    f"tied weights {names[id(first_module)]}.{first_name} ({layout_keep}) and "
                    f"{names[id(module)]}.{name} ({layout_other}) got different TP layouts; "
                    "shard both on the same dim (e.g. VocabParallelEmbedding + ColwiseParallel lm_head) or untie them"
                )
            module._parameters[name] = keep


def _is_local_tp_shard(param) -> bool:
    """A plain tensor that a module shards itself (Megatron ``tensor_model_parallel`` attribute)."""
    return not isinstance(param, DTensor) and bool(getattr(param, "tensor_model_parallel", False))


def _runs_forward(mod: nn.Module) -> bool:
    """Whether calling ``mod`` runs code of its own: a ``ModuleList``, ``ModuleDict`` or ``ParameterList`` has no
    ``forward`` (its owner indexes it), so a style's forward hooks on it never fire."""
    return type(mod).forward is not nn.Module.forward


def _swap_window(owner: nn.Module, children: list[nn.Module]) -> None:
    """Hooks on ``owner`` that swap in the local tensors of ``children``'s replicated parameters for the whole of
    ``owner``'s forward, so a child read through another method (Gemma 3n's ``self.altup.predict(...)``) or through
    its attributes computes on plain tensors like its own forward does. Nested swaps find nothing left to swap."""
    def swap(module, args):
        for child in children:
            swap_in_local_params(child)

    def restore(module, args, output):
        for child in reversed(children):
            restore_params(child)

    owner.register_forward_pre_hook(swap)  # after FSDP's (prepended) unshard of the owner
    owner.register_forward_hook(restore, always_call=True)


def _replicate_leftovers(module: nn.Module, tp_mesh: DeviceMesh) -> list[str]:
    """Apply ``LocalReplicateParallel`` to the outermost called modules whose parameters are all plain.

    A container without ``forward`` (the ``layers`` ``ModuleList`` of a model whose plan shards only its
    embedding, Gemma 3n's ``altup_projections``) is never called, so its hooks would never swap in the local
    tensors: its children are replicated one by one instead. A module the plan shards in part keeps its
    replicated children's parameters local for its whole forward (``_swap_window``); a container holding
    parameters directly (``ParameterList``, read by the owner that the plan shards) is refused like any other mix.
    Parameters marked ``tensor_model_parallel=True`` are local TP shards owned by their
    module and are left as they are (replicating them would broadcast rank 0's shard).
    """
    done = []

    def replicated_whole(mod: nn.Module) -> bool:
        params = [p for p in mod.parameters() if not _is_local_tp_shard(p)]
        if (not params or not _runs_forward(mod) or any(isinstance(p, DTensor) for p in params)
                or len(params) != len(list(mod.parameters()))):
            return False
        LocalReplicateParallel()._apply(mod, tp_mesh)
        return True

    def visit(prefix: str, mod: nn.Module) -> None:  # mod: not replicated whole
        if not any(True for _ in mod.parameters()):
            return
        plain = [n for n, p in mod._parameters.items()
                 if p is not None and not isinstance(p, DTensor) and not _is_local_tp_shard(p)]
        if plain:
            raise ValueError(
                f"module {prefix or type(mod).__name__} keeps plain parameters {plain} next to "
                "tensor-parallel ones; give the module a plan entry that covers all its parameters"
            )
        whole = []
        for name, child in mod.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if replicated_whole(child):
                done.append(path)
                whole.append(child)
            else:
                visit(path, child)
        if whole and prefix and _runs_forward(mod):
            _swap_window(mod, whole)

    if replicated_whole(module):
        return [""]
    visit("", module)
    return done


def _check_sequence_divisible(tp: int):
    def hook(module, args, kwargs):
        # input_ids arrive whole (the embedding scatters them); inputs_embeds may already be
        # sequence-sharded by shard_inputs, so only token ids are checked here.
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is not None and tokens.shape[1] % tp != 0:
            raise ValueError(
                f"sequence length {tokens.shape[1]} is not divisible by tp={tp} under sequence parallelism; "
                f"pad the batch to a multiple of {tp}"
            )

    return hook


def check_tp_plan(model: nn.Module, tp: int, plan: PlanLike = None, sequence_parallel: bool = False,
                  data_parallel: bool = False) -> TPPlan:
    """Resolve the plan for ``model`` and check it fits at ``tp`` (no mesh, no collective);
    ``data_parallel``: FSDP will shard the parameters too.

    Returns the plan restricted to the entries that match a module; raises ValueError naming
    the module, the rule and the fix otherwise.
    """
    resolved = get_tp_plan(model, plan, sequence_parallel)
    refuse_attention_sinks(model, tp, resolved.styles)
    if resolved.entry is not None and resolved.entry.validate is not None:
        resolved.entry.validate(model, tp)
    else:
        validate_tp_sizes(model, tp)
    styles = _matching_plan(model, resolved.styles)
    if not styles:
        raise ValueError(f"TP plan ({resolved.source}) matches no module of {type(model).__name__}; "
                         "check the module path patterns")
    _check_tied_slots(model, styles)
    with detached_adapters(model):  # LoRA adapters are paired with their base layer's style (parallel/lora.py)
        check_plan(model, styles, tp, sequence_parallel, data_parallel)
    check_lora_pairing(model, styles)
    return TPPlan(styles, resolved.source, resolved.entry)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: PlanLike = None,
             sequence_parallel: bool = False) -> nn.Module:
    """Shard ``model`` over the 1-D ``tp_mesh`` in place and return it.

    Every parameter ends up a DTensor on ``tp_mesh``. With ``sequence_parallel`` the
    residual stream between layers is sequence-sharded (``Shard(1)``) and inputs must have a
    sequence length divisible by the TP size. The resolved plan is kept on
    ``model._tp_plan_applied`` (a ``TPPlan``), the mesh on ``model._tp_mesh``, the shard
    report on ``model._tp_shard_report`` (a ``TPShardReport``).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs a 1-D TP mesh, got {tp_mesh.ndim}-D {tp_mesh.mesh_dim_names}; "
                         "pass mesh['tp']")
    if getattr(model, "_tp_mesh", None) is not None:
        raise ValueError(f"{type(model).__name__} is already tensor-parallel; apply_tp runs once per model")
    tp = tp_mesh.size()
    checked = check_tp_plan(model, tp, plan, sequence_parallel)
    tied_groups = _parameter_slots(model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}  # some torch styles re-create params
    with detached_adapters(model):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*could not be resolved.*")
            parallelize_module(model, tp_mesh, checked.styles)
        _retie(model, tied_groups)
        _replicate_leftovers(model, tp_mesh)
        _retie(model, tied_groups)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    pair_lora(model, tp_mesh, checked.styles)
    shard_token_dropouts(model)  # LoRA's and the checkpoint's keyed dropouts mask DTensor blocks by global index
    if sequence_parallel:
        model.register_forward_pre_hook(_check_sequence_divisible(tp), with_kwargs=True, prepend=True)
    model._tp_plan_applied = checked
    model._tp_mesh = tp_mesh
    model._tp_shard_report = report_tp_sharding(model, logger)
    return model
