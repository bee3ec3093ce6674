"""Distributed checkpoints (DCP) of packed tensor-parallel weights, under their own names and shapes.

A packed weight holds ``k`` equal parts along dim ``d`` (``[gate | up]`` of transformers' grouped
experts, ``[q | k | v]`` or ``[gate | up]`` under ``PackedColwiseParallel``). Tensor parallelism gives
rank ``r`` of ``tp`` its slice of every part, ``_StridedShard(d, split_factor=k)``::

    global dim d (N rows):  [ part 0 | part 1 | ... | part k-1 ],  part j = rows [j N/k, (j+1) N/k)
    local dim d (k m rows, m = N / (k tp)):  local rows [j m, (j+1) m) = global rows j N/k + r m + [0, m)

DCP describes a rank's share of a DTensor as one box (offset and size per dim), which a strided
shard is not: the save fails ("overlapping chunks"). Within ``with packed_shards(state):`` every
such DTensor of a (nested) state dict is a ``PackedShards``: the same name and global shape, and
this rank's ``k`` boxes, each a view of the local tensor. Saving writes them where one process
would have its rows; loading copies into the views, so into the weights. A checkpoint of a packed
weight is therefore the same at every tp, and resumes at any other. No communication, no copy.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["BoxedTensor", "PackedShards", "packed_boxes", "packed_shards"]


def _packing(tensor: DTensor) -> tuple[int, int, int] | None:
    """``(mesh dim, tensor dim, parts)`` of a tensor-parallel packing, or None. FSDP2's own
    ``_StridedShard`` (a later mesh dim shards the same tensor dim) is a box DCP knows."""
    placements = tensor.placements
    for i, placement in enumerate(placements):
        if not isinstance(placement, _StridedShard):
            continue
        d = placement.dim
        if any(isinstance(p, Shard) and p.dim == d for p in placements[i + 1:]):
            return None
        if any(isinstance(p, Shard) and p.dim == d for p in placements[:i]):
            raise ValueError(f"a packed weight of shape {tuple(tensor.shape)} is sharded twice on dim {d} "
                             f"({placements}); hybridpar cannot checkpoint it: replicate it over the other mesh dims.")
        return i, d, placement.split_factor
    return None


def packed_boxes(tensor: DTensor) -> list[tuple[torch.Size, torch.Size, Tensor]]:
    """``[(global offsets, sizes, local view)]`` for each of the ``k`` parts this rank holds."""
    mesh_dim, d, k = _packing(tensor)
    coordinate = tensor.device_mesh.get_coordinate()
    tp, rank = tensor.device_mesh.size(mesh_dim), coordinate[mesh_dim]
    total = tensor.shape[d]
    if total % (k * tp):
        raise ValueError(f"a packed weight's dim {d} of {total} rows does not split into {k} parts of {tp} equal "
                         "slices; choose a tp that divides each part.")
    others = [Replicate() if i == mesh_dim else p for i, p in enumerate(tensor.placements)]
    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, others)
    rows = total // (k * tp)
    local = tensor._local_tensor.detach()
    boxes = []
    for j, view in enumerate(local.split(rows, dim=d)):
        box_offsets, box_sizes = list(offsets), list(sizes)
        box_offsets[d], box_sizes[d] = j * (total // k) + rank * rows, rows
        boxes.append((torch.Size(box_offsets), torch.Size(box_sizes), view))
    return boxes


class BoxedTensor(Tensor):
    """A tensor as DCP sees it: a global shape, and boxes ``(global offsets, sizes, local view)`` this rank
    holds (DCP reads into and writes from the views). A stand-in inside a checkpoint's state dict only;
    no tensor operation runs on it. ``PackedShards`` and ``train/run/fused_resume.FusedRows`` are two."""

    @staticmethod
    def _wrap(cls, shape: torch.Size, local: Tensor, boxes: list[tuple[torch.Size, torch.Size, Tensor]]):
        self = Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device)
        self._boxes = boxes
        self._properties = TensorProperties.create_from_tensor(local)
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{cls.__name__} stands in for a weight inside a DCP state dict only; {func} cannot run on it.")

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                      properties=self._properties, size=self.shape))
                for offsets, sizes, _ in self._boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for offsets, sizes, _ in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        for offsets, _, view in self._boxes:
            if offsets == index.offset:
                return view
        raise ValueError(f"no part of {index.fqn!r} at offset {tuple(index.offset)} on this rank")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, boxes={[tuple(o) for o, _, _ in self._boxes]})"


class PackedShards(BoxedTensor):
    """A packed DTensor as DCP sees it: global shape, ``k`` boxes per rank (module docstring)."""

    @staticmethod
    def __new__(cls, tensor: DTensor):
        return BoxedTensor._wrap(cls, tensor.shape, tensor._local_tensor, packed_boxes(tensor))


@contextmanager
def packed_shards(state):
    """Within the block, every packed DTensor of ``state`` (nested dicts and lists, as
    ``get_state_dict`` returns) is replaced in place by its ``PackedShards``; on exit the tensors
    are put back. Call ``dcp.save`` or ``dcp.load`` on ``state`` inside: a load fills the tensors
    in place, and the values DCP sets in ``state`` (param groups, steps) stay."""
    swapped = []

    def walk(container):
        for key, value in list(container.items() if isinstance(container, dict) else enumerate(container)):
            if isinstance(value, (dict, list)):
                walk(value)
            elif isinstance(value, DTensor) and _packing(value) is not None:
                container[key] = PackedShards(value)
                swapped.append((container, key, value))

    walk(state)
    try:
        yield state
    finally:
        for container, key, value in swapped:
            container[key] = value
