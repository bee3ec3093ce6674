"""What every context-parallel core shares: its group, the check of a batch's layout, and the
per-batch plans built before the blocks run.

A core (attention or Mamba2) owns no parameters; it holds the CP group and reads this
rank's place in the global sequence from ``packed.cp``, checked here without any
communication so a wrong batch fails on every rank before a collective.

**Per-batch plans under ``torch.compile``.** A state-passing core indexes with a plan derived
from the batch's document boundaries (segment starts, halo indices, chunk alignment), built on
the host (``.tolist()``, ``int(...)``): inside a compiled block that is a graph break and a host
sync per layer. So ``install_core`` registers a forward pre-hook on the module that runs the
blocks (the owner of ``parallel.checkpointing.find_blocks``, never compiled itself): before the
blocks of every batch it asks each core to ``prepare`` its layers' plans, which ``batch_cached``
stores in ``packed.cache``; inside a compiled block ``batch_cached`` only reads them (dynamo
guards on the cache's keys and lifts the plan's tensors as graph inputs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from typing import Callable

from torch import nn

from hybridpar.data.thd import ContextParallelLayout, PackedSeqParams
from hybridpar.parallel.checkpointing import find_blocks
from hybridpar.parallel.context.inputs import group_size_and_rank

PREPARED = "_hybridpar_batch_plans"  # on the module whose pre-hook prepares the cores' plans: {id(core): (core, layers)}


def batch_cached(packed: PackedSeqParams, key: tuple, build: Callable[[], object]):
    """``packed.cache[key]``, built on first use; while ``torch.compile`` traces, a stored entry is read
    (the batch hook built it before the blocks) and a missing one built afresh, not stored."""
    if key in packed.cache:
        return packed.cache[key]
    value = build()
    if not torch.compiler.is_compiling():
        packed.cache[key] = value
    return value


def _batch_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for x in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args):
        if isinstance(x, torch.Tensor):
            return x
    return None


def _prepare_plans(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: every core's plans for this batch, built eagerly into ``packed.cache``."""
    found = [kwargs.get("packed_seq_params"), kwargs.get("packed"), *args]
    packed = next((x for x in found if isinstance(x, PackedSeqParams)), None)
    tokens = _batch_of(args, kwargs)
    if packed is None or packed.cp is None or tokens is None:
        return
    for core, layers in getattr(module, PREPARED).values():
        for layer in layers:
            core.prepare(layer, packed, tokens.shape[0], tokens.device)


def install_core(model: nn.Module, modules: list[tuple[str, nn.Module]], make_core: Callable[[], object]) -> nn.Module:
    """One core from ``make_core()`` as ``core`` of every ``(name, module)`` switched onto a hybridpar core
    (a core owns no parameters: the layers share it); returns ``model``. A core with per-batch plans
    (``prepare``) gets them built before the blocks run (module docstring)."""
    if modules:
        core = make_core()
        for _, module in modules:
            module.core = core
        prepare_batch_plans(model, core, [m for _, m in modules])
    return model


def prepare_batch_plans(model: nn.Module, core: "ContextParallelCore", layers: list[nn.Module]) -> None:
    """Have ``core.prepare`` build the plans of ``layers`` for every batch before ``model``'s blocks run,
    from a forward pre-hook on the module that runs them (module docstring); nothing for a core
    without per-batch plans."""
    if type(core).prepare is ContextParallelCore.prepare or not layers:
        return
    blocks = find_blocks(model)
    owner = next((m for m in model.modules() if any(c is blocks for c in m.children())), model)
    if not hasattr(owner, PREPARED):
        setattr(owner, PREPARED, {})
        owner.register_forward_pre_hook(_prepare_plans, with_kwargs=True)
    getattr(owner, PREPARED)[id(core)] = (core, layers)


class ContextParallelCore:
    """Base of the strategies: the group, its size and this rank's place in it."""

    name = ""

    def __init__(self, cp_group: dist.ProcessGroup | None):
        self.cp_group = cp_group
        self.cp_size, self.cp_rank = group_size_and_rank(cp_group, "cp_group")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cp_size={self.cp_size}, cp_rank={self.cp_rank})"

    def prepare(self, layer: nn.Module, packed: PackedSeqParams, batch: int, device) -> None:
        """Build (``batch_cached``) the plans ``layer`` reads for this batch of ``batch`` rows; none by default."""

    def checked_layout(self, packed: PackedSeqParams | None, local_tokens: int, cp_size: int | None = None,
                       cp_rank: int | None = None) -> ContextParallelLayout:
        """This rank's layout, checked against the group and the number of local tokens."""
        cp_size = self.cp_size if cp_size is None else cp_size
        cp_rank = self.cp_rank if cp_rank is None else cp_rank
        who = f"{self.name} core"
        layout = packed.cp if packed is not None else None
        if layout is None:
            raise ValueError(
                f"{who} runs on a context-parallel group of size {cp_size} but got packed params without a CP "
                "layout (packed is None or packed.cp is None); pass the PackedSeqParams that "
                "shard_inputs(..., cp_group=...) returns for this rank (dense batches get one too)."
            )
        if layout.cp_size != cp_size or layout.cp_rank != cp_rank:
            raise ValueError(
                f"{who}: packed params were localized for cp_size={layout.cp_size}, cp_rank={layout.cp_rank} but "
                f"the cp_group has size {cp_size} and this rank is {cp_rank}; shard the batch with the same "
                "cp_group the model was parallelized with."
            )
        if layout.local_indices.numel() != local_tokens:
            raise ValueError(
                f"{who}: the inputs hold {local_tokens} tokens per row but this rank's layout holds "
                f"{layout.local_indices.numel()}; pass the packed params built for this batch."
            )
        return layout
