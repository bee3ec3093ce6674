"""Tensor-parallel styles for projections torch's ``ColwiseParallel``/``RowwiseParallel`` do not fit.

- ``Conv1DColwiseParallel`` / ``Conv1DRowwiseParallel``: Hugging Face's ``Conv1D`` (GPT-2) is a
  linear layer with a transposed weight ``[in, out]`` (``y = x W + b``), so its column split is
  ``Shard(1)`` of the weight (bias ``Shard(0)``) and its row split ``Shard(0)`` (bias
  replicated, added once after the reduction). The module's own forward runs on DTensors,
  as torch's styles do for ``nn.Linear``.
- ``PackedColwiseParallel(split_factor=k)``: a fused projection whose output packs ``k``
  equal parts (``[gate | up]``, ``[q | k | v]``). A plain column split would give rank 0 all
  of ``gate``; instead rank ``r`` holds rows ``r`` of every part
  (``_StridedShard(out_dim, split_factor=k)``), so code that splits the output into ``k``
  parts finds its local parts::

      x [B, S, D] (replicated; SP: all-gathered) -> local linear -> [B, S, k n / tp]
      backward: dx is a partial sum over TP -> all-reduce (SP: reduce-scatter)

  The bias stays replicated (each rank slices its rows of every part; its gradient, nonzero
  on those rows only, is all-reduced). FSDP shards dim 0, so an ``nn.Linear`` weight packed
  on dim 0 cannot also be FSDP-sharded (``tp_check`` refuses that); ``Conv1D`` packs dim 1.

- ``HeadGateParallel``: column-parallel gate with one output per head (LFM3's ``g_proj``), outside
  the head-size rule.
- ``LocalHeadCounts(names)``: attention modules that reshape with their own head-count
  attributes (``view(b, s, self.num_heads, d)``: StableLM, GPT-2's ``split_size``) get those
  attributes divided by ``tp``; the projections are sharded by the plan's other entries.

Every style has ``check(name, module, tp)``, which ``tp_check`` calls before any sharding.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from hybridpar.parallel.tensor.styles import AllReduceGrad, replicated_local, restore_params, swap_in_local_params

__all__ = ["is_conv1d", "Conv1DColwiseParallel", "Conv1DRowwiseParallel", "PackedColwiseParallel", "LocalHeadCounts",
           "HeadGateParallel", "HeadShardedSinks"]


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D``: weight ``[nx, nf]`` (in, out), bias ``[nf]``."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and hasattr(module, "nf") and weight is not None
            and tuple(weight.shape) == (module.nx, module.nf))


def _distribute(module: nn.Module, placements: dict[str, object], mesh: DeviceMesh, src_data_rank) -> None:
    for name, placement in placements.items():
        param = module._parameters.get(name)
        if param is not None:
            dist = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
            module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"TP plan entry for {name!r}: {message}")


class Conv1DColwiseParallel(ColwiseParallel):
    """Column-parallel ``Conv1D``: weight ``[D, n]`` -> ``Shard(1)``, bias -> ``Shard(0)``;
    output ``[B, S, n/tp]`` (or ``output_layouts``)."""

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        _require(is_conv1d(module), name, f"Conv1DColwiseParallel needs a Hugging Face Conv1D, got {type(module).__name__}")
        _require(module.nf % tp == 0, name, f"Conv1D output features nf={module.nf} are not divisible by tp={tp}")

    def _partition_conv1d(self, name, module, mesh):
        _distribute(module, {"weight": Shard(1), "bias": Shard(0)}, mesh, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(type(module).__name__, module, device_mesh.size())
        return distribute_module(module, device_mesh, self._partition_conv1d,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwiseParallel(RowwiseParallel):
    """Row-parallel ``Conv1D``: weight ``[n, D]`` -> ``Shard(0)``, bias replicated; input
    ``[B, S, n/tp]``, output the partial sums reduced to ``output_layouts`` (default
    ``Replicate``: all-reduce; ``Shard(1)``: reduce-scatter)."""

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        _require(is_conv1d(module), name, f"Conv1DRowwiseParallel needs a Hugging Face Conv1D, got {type(module).__name__}")
        _require(module.nx % tp == 0, name, f"Conv1D input features nx={module.nx} are not divisible by tp={tp}")

    def _partition_conv1d(self, name, module, mesh):
        _distribute(module, {"weight": Shard(0), "bias": Replicate()}, mesh, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(type(module).__name__, module, device_mesh.size())
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh, self._partition_conv1d,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class PackedColwiseParallel(ParallelStyle):
    """Column-parallel fused projection (``nn.Linear`` or ``Conv1D``) packing ``split_factor``
    equal parts; computes on local shards (see the module docstring)."""

    def __init__(self, split_factor: int = 2):
        super().__init__()
        self.split_factor = split_factor

    def _out_dim(self, module: nn.Module) -> int:
        return 1 if is_conv1d(module) else 0

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        _require(isinstance(module, nn.Linear) or is_conv1d(module), name,
                 f"PackedColwiseParallel needs nn.Linear or Conv1D, got {type(module).__name__}")
        out = module.weight.shape[self._out_dim(module)]
        _require(out % (self.split_factor * tp) == 0, name,
                 f"{out} output features packing {self.split_factor} parts cannot give every one of tp={tp} "
                 f"ranks an equal slice of each part (needs a multiple of {self.split_factor * tp})")

    def _local_bias(self, bias: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """This rank's rows of every part of the replicated bias [k n] -> [k n / tp]."""
        bias = AllReduceGrad.apply(bias, mesh.get_group()) if bias.requires_grad else bias
        tp, rank = mesh.size(), mesh.get_local_rank()
        parts = bias.view(self.split_factor, -1)
        rows = parts.shape[1] // tp
        return parts[:, rank * rows:(rank + 1) * rows].reshape(-1)

    def _forward_pre(self, mesh: DeviceMesh, conv1d: bool, module, args, kwargs):
        swap_in_local_params(module)
        if module.bias is not None:
            module._parameters["bias"] = self._local_bias(module.bias, mesh)
        if conv1d:
            module.nf = module.weight.shape[1]  # the local width; Conv1D.forward reshapes with nf
        # [B, S, D] (SP: [B, S/tp, D] all-gathered) whole on every rank; dx summed in backward
        return (replicated_local(args[0], mesh), *args[1:]), kwargs

    def _forward_post(self, mesh: DeviceMesh, conv1d: bool, module, args, output):
        restore_params(module)
        if conv1d:
            module.nf = module.weight.shape[1]
        return output  # [B, S, k n / tp], plain: this rank's slice of every part

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(type(module).__name__, module, device_mesh.size())
        packed = _StridedShard(self._out_dim(module), split_factor=self.split_factor)
        _distribute(module, {"weight": packed, "bias": Replicate()}, device_mesh, self.src_data_rank)
        conv1d = is_conv1d(module)
        module.register_forward_pre_hook(partial(self._forward_pre, device_mesh, conv1d), with_kwargs=True)
        module.register_forward_hook(partial(self._forward_post, device_mesh, conv1d), always_call=True)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(split_factor={self.split_factor})"


class LocalHeadCounts(ParallelStyle):
    """Divide the integer attributes ``names`` of a module (head counts, packed widths) by tp."""

    def __init__(self, names: tuple[str, ...]):
        super().__init__()
        self.names = tuple(names)

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        for attr in self.names:
            value = getattr(module, attr, None)
            _require(isinstance(value, int), name, f"{type(module).__name__} has no integer attribute {attr!r}")
            _require(value % tp == 0, name, f"{attr}={value} is not divisible by tp={tp}; choose a tp that divides it")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        self.check(type(module).__name__, module, tp)
        for attr in self.names:
            setattr(module, attr, getattr(module, attr) // tp)
        module._tp_local_attributes = self.names
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.names})"


class HeadGateParallel(ParallelStyle):
    """``ColwiseParallel`` for a gate with one output per attention head (LFM3's ``g_proj``
    ``[H, D]``): rank ``r`` computes the gates of its heads ``[B, S, H/tp]``. Not a head-dim
    projection, so the plan check's head-size rule does not apply; ``H % tp`` is checked."""

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        if not isinstance(module, nn.Linear) or module.out_features % tp:
            raise ValueError(f"TP plan entry for {name!r}: a per-head gate needs an nn.Linear whose "
                             f"{getattr(module, 'out_features', '?')} heads are divisible by tp={tp}")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(type(module).__name__, module, device_mesh.size())
        return ColwiseParallel()._apply(module, device_mesh)


class HeadShardedSinks(ParallelStyle):
    """An attention module's ``sinks [Hq]`` (GPT-OSS: one logit per query head,
    ``models/attention/sinks.py``) sharded with its query heads: column-parallel q/k/v give rank
    ``r`` the heads ``[r Hq/tp, (r+1) Hq/tp)``, so ``sinks`` is ``Shard(0)``, and during the
    module's forward it holds the local ``[Hq/tp]`` (differentiable ``to_local``), which
    transformers hands its attention as ``s_aux``. A head's gradient comes from its rank alone."""

    shards_sinks = True  # check.refuse_attention_sinks: this entry takes the module's sinks

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        sinks = getattr(module, "sinks", None)
        _require(isinstance(sinks, nn.Parameter) and sinks.dim() == 1, name,
                 f"HeadShardedSinks needs an attention module with a 1-D sinks parameter, got {type(module).__name__}")
        _require(sinks.numel() % tp == 0, name, f"{sinks.numel()} attention sinks (one per query head) are not "
                 f"divisible by tp={tp}")

    @staticmethod
    def _local(module: nn.Module, args) -> None:
        sinks = module._parameters["sinks"]
        if isinstance(sinks, DTensor):
            module.__dict__["_tp_sinks"] = sinks
            module._parameters["sinks"] = sinks.to_local()  # [Hq] Shard(0) -> local [Hq/tp]

    @staticmethod
    def _restore(module: nn.Module, args, output):
        saved = module.__dict__.pop("_tp_sinks", None)
        if saved is not None:
            module._parameters["sinks"] = saved
        return output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(type(module).__name__, module, device_mesh.size())
        _distribute(module, {"sinks": Shard(0)}, device_mesh, self.src_data_rank)
        module.register_forward_pre_hook(self._local)
        module.register_forward_hook(self._restore, always_call=True)
        return module
