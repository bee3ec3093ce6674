"""``parallelize()``: lay a model over the 4-D mesh in one fixed order.

    validate everything (no collective before this passes)
    -> split Mamba2 projections per component (always: parameter names never depend on layout)
    -> tensor / sequence parallel           (tp > 1)            tp_hybrid / tp plans
    -> context parallel                     (cp > 1)            cp_attention, cp_mamba; transformers models: cp_hf
    -> activation checkpointing per block   (none|full|selective) checkpointing
    -> torch.compile per block              (optional)          torchtitan's order: after AC, before FSDP
    -> FSDP2 over dp_shard x cp, HSDP with dp_replicate          fsdp
       (no FSDP and mixed_precision: the forward under torch.autocast, precision)

FSDP runs whenever a rank shares parameters with another rank that sees different tokens
(``dp_shard * cp > 1`` or ``dp_replicate > 1``): CP ranks and DP ranks hold partial gradients,
and FSDP sums them (divide factor 1; the loss divides by the global token count). So after
``loss.backward()`` every configuration holds fully reduced gradients. TP ranks see the same
tokens and need no data-parallel reduction.

Compile (``compiled_blocks.py``): each block is compiled in place with the TP hooks, the CP core
calls and the ``PackedSeqParams`` reads inside the graph and FSDP's hooks outside it. Checks that
need a host sync run once per batch, before the model (``PackedSeqParams``, ``shard_inputs``), so a
block compiles without graph breaks.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from hybridpar.models.attention.mixer import Attention
from hybridpar.models.hf.mixers.gdn import install_gdn_core
from hybridpar.models.hf.mixers.kda import install_kda_core
from hybridpar.models.hf.mixers.mamba1 import install_mamba1_core, mamba1_tp_problem
from hybridpar.models.hf.mixers.mamba2 import install_mamba_core
from hybridpar.models.hf.mixers.rglru import install_rglru_core, rglru_tp_problem
from hybridpar.models.hf.mixers.short_conv import install_short_conv
from hybridpar.models.hybrid import HybridLM
from hybridpar.models.mamba.mixer import Mamba2Mixer, tp_groups
from hybridpar.parallel.context import attention as attention_cp
from hybridpar.parallel.context.recurrent import gdn as gdn_cp, kda as kda_cp
from hybridpar.parallel.context import hf as hf_cp
from hybridpar.parallel.context.recurrent import mamba as mamba_cp
from hybridpar.parallel.context.recurrent.mamba_state import apply_mamba1_cp
from hybridpar.parallel.context.recurrent.rglru import apply_rglru_cp
from hybridpar.parallel.context.recurrent.short_conv import apply_short_conv_cp
from hybridpar.parallel.checkpointing import (
    apply_activation_checkpointing,
    checkpointing_policy,
    model_blocks,
)
from hybridpar.parallel.compiled_blocks import apply_compile, compile_options
from hybridpar.parallel.dims import MESH_DIMS, ParallelDims
from hybridpar.parallel.data.fsdp import apply_fsdp, check_reshard_after_forward
from hybridpar.parallel.precision import apply_autocast, check_autocast_model
from hybridpar.parallel.tensor.apply import apply_tp, check_tp_plan, get_tp_plan
from hybridpar.parallel.tensor.hybrid import split_mamba_mixers, validate_hybrid_tp
from hybridpar.parallel.tensor.hf_plans.moe_hybrid import split_hf_mixers

__all__ = [
    "parallelize", "validate_parallelize", "apply_cp", "apply_activation_checkpointing", "apply_compile",
    "needs_fsdp", "cp_cores_at", "cp_head_checks", "CPHeadError",
]


def needs_fsdp(dims: ParallelDims) -> bool:
    """Whether gradients must be reduced over data/context-parallel ranks (FSDP does it)."""
    return dims.size("dp_shard_cp") > 1 or dims.dp_replicate > 1


def _check_mesh(mesh, dims: ParallelDims) -> None:
    names = tuple(mesh.mesh_dim_names or ())
    if names != MESH_DIMS or tuple(mesh.shape) != (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp):
        raise ValueError(
            f"mesh has dims {names} and shape {tuple(mesh.shape)} but {dims} needs dims {MESH_DIMS} with shape "
            f"{(dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)}; pass mesh=dims.build_mesh() or mesh=None."
        )


class CPHeadError(ValueError):
    """A HybridLM module's heads or groups that a CP strategy cannot split; ``rule``: the message without the layout."""

    def __init__(self, message: str, rule: str):
        super().__init__(message)
        self.rule = rule


def cp_head_checks(model: nn.Module, tp: int, attention_core, mamba_core, at: str = "") -> None:
    """The CP strategies' head/group rules on the heads each TP rank will hold (transformers' models too; the
    strategy objects do no communication); raises ``ValueError`` (a HybridLM's: ``CPHeadError``) naming the module
    (``at``: after its name)."""
    if not isinstance(model, HybridLM):
        hf_cp.validate_hf_cp(model, attention_core, tp, mamba_core)
        return
    for name, module in model.named_modules():
        try:
            if isinstance(module, Mamba2Mixer):
                mamba_core.validate(module.num_heads // tp, tp_groups(module.n_groups, tp))
            elif isinstance(module, Attention):
                attention_core.validate_heads(module.num_heads // tp, module.num_kv_heads // tp)
        except ValueError as error:
            raise CPHeadError(f"module {name!r}{at}: {error}", f"module {name!r}: {error}") from None


def cp_cores_at(cp: int, attention: str, mamba: str) -> tuple:
    """Group-less CP cores sized as the CP group will be, for head checks before any group exists (a
    core of ``None`` has size 1: cp=4 ulysses over 6 heads passed the launcher, then failed on the ranks)."""
    attention_core, mamba_core = attention_cp.STRATEGIES[attention](None), mamba_cp.STRATEGIES[mamba](None)
    attention_core.cp_size = mamba_core.cp_size = cp
    return attention_core, mamba_core


def validate_parallelize(model: nn.Module, dims: ParallelDims, *, cp_attention_strategy: str = "allgather",
                         cp_mamba_strategy: str = "a2a", sequence_parallel: bool = False, mixed_precision=None,
                         tp_plan=None, activation_checkpointing: str | bool = "none",
                         reshard_after_forward: bool | int = True, compile=False) -> None:
    """Every rule ``parallelize`` needs that can be checked without a mesh; raises ``ValueError``."""
    checkpointing_policy(activation_checkpointing)
    if not isinstance(dims, ParallelDims):
        raise ValueError(f"dims must be a ParallelDims, got {type(dims).__name__}; e.g. ParallelDims(cp=2, tp=2).")
    if dist.is_initialized():
        dims.validate(dist.get_world_size())
    if cp_attention_strategy not in attention_cp.STRATEGIES:
        raise ValueError(f"unknown cp_attention={cp_attention_strategy!r}; choose one of {sorted(attention_cp.STRATEGIES)}.")
    if cp_mamba_strategy not in mamba_cp.STRATEGIES:
        raise ValueError(f"unknown cp_mamba={cp_mamba_strategy!r}; choose one of {sorted(mamba_cp.STRATEGIES)}.")
    gdn_cp.validate_gdn_parallel(model, dims.cp, dims.tp, cp_mamba_strategy)  # gated DeltaNets: heads over tp, cp
    kda_cp.validate_kda_parallel(model, dims.cp, dims.tp, cp_mamba_strategy)  # Kimi Delta Attention: cp or tp by heads
    problem = mamba1_tp_problem(model, dims.tp)  # Mamba1 mixers: channels over tp (any cp: state passing)
    problem = problem or rglru_tp_problem(model, dims.tp)  # RG-LRU blocks: heads over tp (any cp: state passing)
    if problem:
        raise ValueError(problem + ".")
    if mixed_precision is not None and not (needs_fsdp(dims) and isinstance(mixed_precision, MixedPrecisionPolicy)):
        if needs_fsdp(dims) and mixed_precision != "bf16":
            raise ValueError(f"mixed_precision={mixed_precision!r} is not supported; use None, 'bf16' or a "
                             "torch MixedPrecisionPolicy.")
        check_autocast_model(model, mixed_precision)  # 'bf16': float32 masters of what trains, at every layout
    if not isinstance(reshard_after_forward, bool) and not needs_fsdp(dims):
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r} sets FSDP's resharding group, but {dims} "
                         "does not use FSDP; leave it true or false.")
    check_reshard_after_forward(reshard_after_forward, dims.size("dp_shard_cp"))
    if compile:
        compile_options(compile)
        model_blocks(model, "compile", "Set compile=False.")
    if dims.tp > 1:
        check_tp_plan(model, dims.tp, tp_plan, sequence_parallel, needs_fsdp(dims))  # tp_check, before the mesh
    elif tp_plan is not None:
        get_tp_plan(model, tp_plan)  # unknown names raise here
    if dims.tp > 1:
        validate_hybrid_tp(model, dims.tp)  # hybridpar mixers inside any model, whatever plan was given
    if dims.cp > 1:  # after the TP rules, so heads tp cannot split are named by parallel.tp (not "query heads 1 ...
        # of kv heads 2"); a HybridLM's heads here too, not only once the mesh exists (round 21)
        cp_head_checks(model, dims.tp, *cp_cores_at(dims.cp, cp_attention_strategy, cp_mamba_strategy),
                       at=f" at tp={dims.tp}, cp={dims.cp}")


def apply_cp(model: nn.Module, cp_group, attention_strategy: str = "allgather", mamba_strategy: str = "a2a") -> nn.Module:
    """Install the context-parallel cores on every attention and Mamba2 mixer (transformers models: ``cp_hf``)."""
    if not isinstance(model, HybridLM):  # transformers' Mamba2 mixers on hybridpar's core share mixer.core
        mamba_cp.apply_mamba_cp(model, cp_group, mamba_strategy)
        apply_short_conv_cp(model, cp_group)  # LFM2's short convs: a halo exchange at the seams
        apply_mamba1_cp(model, cp_group)  # Mamba1 mixers (Jamba, FalconMamba, Mamba): state passing
        apply_rglru_cp(model, cp_group)  # RecurrentGemma's RG-LRU blocks: state passing
        gdn_cp.apply_gdn_cp(model, cp_group, mamba_strategy)
        kda_cp.apply_kda_cp(model, cp_group, mamba_strategy)  # Kimi Linear's KDA layers: same strategies
        return hf_cp.apply_hf_cp(model, attention_cp.STRATEGIES[attention_strategy](cp_group))
    attention_cp.apply_attention_cp(model, cp_group, attention_strategy)
    mamba_cp.apply_mamba_cp(model, cp_group, mamba_strategy)
    return model


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    mesh=None,
    cp_attention: str = "allgather",
    cp_mamba: str = "a2a",
    sequence_parallel: bool = False,
    activation_checkpointing: str | bool = "none",
    compile: bool | str | dict = False,
    mixed_precision=None,
    reshard_after_forward: bool | int = True,
    tp_plan=None,
) -> nn.Module:
    """Parallelize ``model`` in place over ``dims`` and return it (see the module docstring).

    ``mesh``: the root mesh from ``dims.build_mesh()`` (built here when None; needs an
    initialized process group unless every degree is 1). ``tp_plan``: a plan dict, callable
    or registered name (default: the registry entry for the model class).
    ``activation_checkpointing``: ``"none"``, ``"full"`` or ``"selective"`` (``checkpointing.py``;
    True/False mean full/none). ``mixed_precision``: None, ``"bf16"`` or a ``MixedPrecisionPolicy``
    (FSDP's; without FSDP ``"bf16"`` runs the forward under autocast, ``precision.py``). ``compile``: True (inductor), a ``torch.compile`` backend name or a dict of its
    options (``apply_compile``). ``reshard_after_forward``: FSDP's, for the blocks
    (``fsdp.check_reshard_after_forward``). The mesh is kept on ``model._parallel_mesh`` and the
    dims on ``model._parallel_dims``. A transformers model's Mamba2 mixers are switched to
    hybridpar's Mamba core first (``models/hf/mixers/mamba2.install_mamba_core``), the seam of
    the Mamba CP strategies, and it refuses packed documents its attention would not separate
    (``context/hf.refuse_unread_documents``).
    """
    if not isinstance(model, nn.Module):  # parallelize("ckpt/", dims): "'str' object has no attribute 'named_modules'"
        raise ValueError(f"parallelize takes the model (an nn.Module), got {type(model).__name__}; build or load it "
                         "first, e.g. parallelize(load_causal_lm(path), dims).")
    if getattr(model, "_parallel_dims", None) is not None:  # cp=2 twice: CP cores stacked, then FSDP's AssertionError
        raise ValueError(f"{type(model).__name__} is already parallelized ({model._parallel_dims}); parallelize runs once "
                         "per model: build or load a fresh model for another layout.")
    if hf_cp.is_hf_model(model):
        install_mamba_core(model)
        install_mamba1_core(model)  # Jamba, FalconMamba, Mamba: the document-resetting selective scan
        install_rglru_core(model)  # RecurrentGemma: the RG-LRU on the same scan
        install_short_conv(model)
        install_gdn_core(model)  # gated DeltaNets on hybridpar's core (models/hf/mixers/gdn.py)
        install_kda_core(model)  # Kimi Delta Attention (Kimi Linear) on hybridpar's KDA core
        hf_cp.refuse_unread_documents(model)
    validate_parallelize(model, dims, cp_attention_strategy=cp_attention, cp_mamba_strategy=cp_mamba,
                         sequence_parallel=sequence_parallel, mixed_precision=mixed_precision, tp_plan=tp_plan,
                         activation_checkpointing=activation_checkpointing,
                         reshard_after_forward=reshard_after_forward, compile=compile)
    if dims.world_size > 1 or mesh is not None:
        mesh = dims.build_mesh() if mesh is None else mesh
        _check_mesh(mesh, dims)

    split_mamba_mixers(model)  # Mamba2 in_proj/conv1d per component at every layout: the checkpoint's names
    split_hf_mixers(model)  # (DCP) do not depend on tp, so a run resumes at another; LoRA adapters kept
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], plan=tp_plan, sequence_parallel=sequence_parallel)
    if dims.cp > 1:
        apply_cp(model, ParallelDims.group(mesh, "cp"), cp_attention, cp_mamba)
    apply_activation_checkpointing(model, activation_checkpointing)
    if compile:
        apply_compile(model, **compile_options(compile))
    if needs_fsdp(dims):
        apply_fsdp(model, mesh, dims, mixed_precision=mixed_precision, reshard_after_forward=reshard_after_forward)
    elif mixed_precision is not None:
        apply_autocast(model, mixed_precision)
    model._parallel_dims = dims
    model._parallel_mesh = mesh
    return model
