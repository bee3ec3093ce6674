"""What every context-parallel core shares: its group, and the check of a batch's layout.

A core (attention or Mamba2) owns no parameters; it holds the CP group and reads this
rank's place in the global sequence from ``packed.cp``, checked here without any
communication so a wrong batch fails on every rank before a collective.
"""

from __future__ import annotations

import torch.distributed as dist

from typing import Callable

from torch import nn

from hybridpar.data.thd import ContextParallelLayout, PackedSeqParams
from hybridpar.parallel.context.inputs import group_size_and_rank


def install_core(model: nn.Module, modules: list[tuple[str, nn.Module]], make_core: Callable[[], object]) -> nn.Module:
    """One core from ``make_core()`` as ``core`` of every ``(name, module)`` switched onto a hybridpar core
    (a core owns no parameters: the layers share it); returns ``model``."""
    if modules:
        core = make_core()
        for _, module in modules:
            module.core = core
    return model


class ContextParallelCore:
    """Base of the strategies: the group, its size and this rank's place in it."""

    name = ""

    def __init__(self, cp_group: dist.ProcessGroup | None):
        self.cp_group = cp_group
        self.cp_size, self.cp_rank = group_size_and_rank(cp_group, "cp_group")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cp_size={self.cp_size}, cp_rank={self.cp_rank})"

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
