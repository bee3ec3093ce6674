"""Custom DTensor ParallelStyles used by the tensor-parallel plans (seed 004).

- ``SequenceParallelAllGatherActivation``: a norm under sequence parallelism whose output
  is all-gathered once, so the column-parallel projections after it read a replicated input.
- ``RotaryEmbedParallel``: rotary modules called as ``rotary(x, position_ids[, ...])`` that
  return a tuple ``(cos, sin)``; runs the module on plain tensors and returns plain tensors.
- ``VocabParallelEmbedding``: ``RowwiseParallel`` for ``nn.Embedding`` (ids replicated, vocab
  sharded) that repairs an empty ``MaskPartial`` mask buffer before the reduction.
- ``LocalReplicateParallel``: parameters become replicated DTensors (so optimizers and
  ``clip_grad_norm_`` see one tensor type), but the module computes on plain local tensors;
  with ``grad_allreduce=True`` the parameter gradients are summed over the TP group (for
  modules fed head-sharded activations, e.g. Qwen3's per-head ``q_norm``); with
  ``output_layouts=Shard(1)`` a replicated module (a Mamba mixer, a position embedding) joins
  the sequence-sharded residual stream under sequence parallelism.

Two conversions used by the styles that compute on local shards (``tp_linear_styles``,
``tp_moe``), written with DTensor so the backward collective is DTensor's own:

    replicated_local(x):  x [B, S, D] (plain, or a DTensor in any layout) -> plain [B, S, D]
        forward: all-gather if x is sequence-sharded; backward: the local gradient is a
        partial sum over TP ranks -> all-reduce (reduce-scatter if x was Shard(1))
    reduce_partial(y, p): y [..., D] partial sum on each rank -> DTensor in layout p
        forward: all-reduce (p = Replicate) or reduce-scatter (p = Shard(1)); backward: none
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import Placement

from hybridpar.models.lm_head_loss import check_token_values

__all__ = [
    "local_mixer_input", "map_first_input", "replicated_input", "row_parallel_exit",
    "SequenceParallelAllGatherActivation",
    "RotaryEmbedParallel",
    "VocabParallelEmbedding",
    "LocalReplicateParallel",
    "TokenwiseParallel",
    "repair_mask_partial",
    "replicated_local",
    "reduce_partial",
    "swap_in_local_params",
    "restore_params",
    "AllReduceGrad",
]


class SequenceParallelAllGatherActivation(SequenceParallel):
    """``SequenceParallel`` norm whose output is all-gathered to ``Replicate``.

    The norm runs on its sequence shard; its output is gathered once here instead of
    once per consuming projection (q, k, v or gate, up).
    """

    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):
            raise ValueError(
                f"{type(mod).__name__} under sequence parallelism returned {type(outputs).__name__}, "
                "expected a DTensor; put SequenceParallel on this module only if it maps a "
                "sequence-sharded input to a same-shaped output"
            )
        if any(isinstance(p, Shard) for p in outputs.placements):
            # [B, S/tp, D] -> [B, S, D]
            outputs = outputs.redistribute(device_mesh=device_mesh, placements=[Replicate()])
        return outputs.to_local() if use_local_output else outputs


def _to_plain(value):
    """A DTensor argument as a plain tensor holding the full value (others unchanged)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value


class RotaryEmbedParallel(ParallelStyle):
    """Rotary embedding modules with tuple inputs and tuple outputs under sequence parallelism.

    Hugging Face rotary modules are called as ``rotary(x, position_ids)`` (Gemma3 adds
    ``layer_type``; Llama passes ``position_ids=`` as a keyword) and return ``(cos, sin)``.
    ``x`` is only read for its dtype and device, and ``position_ids`` covers the full
    sequence, so the module runs on plain tensors: a DTensor ``x`` is replaced by its local
    shard, DTensor position ids by their full value, and ``cos``/``sin`` come back as plain
    tensors for the full sequence (replicated on every TP rank). Buffers (``inv_freq``) are
    left as plain tensors.
    """

    def _prepare_inputs(self, mod, args, kwargs):
        args = list(args)
        if args and isinstance(args[0], DTensor):
            args[0] = args[0].to_local()  # only dtype and device are read
        args[1:] = [_to_plain(a) for a in args[1:]]
        kwargs = {k: _to_plain(v) for k, v in kwargs.items()}
        return tuple(args), kwargs

    @staticmethod
    def _prepare_outputs(mod, args, kwargs, outputs):
        if isinstance(outputs, tuple):
            return tuple(_to_plain(o) for o in outputs)
        return _to_plain(outputs)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(self._prepare_inputs, with_kwargs=True)
        module.register_forward_hook(self._prepare_outputs, with_kwargs=True)
        return module


def _vocab_shard_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(offset, size) of this rank's rows under torch's (possibly uneven) Shard(0) chunking."""
    size, offset = Shard.local_shard_size_and_offset(vocab_size, tp_size, tp_rank)
    return int(offset), int(size)


def repair_mask_partial(output: DTensor, input_ids: torch.Tensor, vocab_size: int, device_mesh: DeviceMesh) -> bool:
    """Fill an empty ``MaskPartial`` mask buffer of a vocab-parallel embedding output.

    Some torch versions leave ``mask_buffer.data`` empty after the embedding dispatch and the
    later reduction fails with ``assert self.mask_buffer.data is not None``. The mask is
    "id outside this rank's vocab rows"; it is rebuilt from the original ids. Returns True
    when a repair was made (False: nothing to repair).
    """
    for placement in output.placements:
        buffer = getattr(placement, "mask_buffer", None)
        if buffer is None or buffer.data is not None:
            continue
        offset, size = _vocab_shard_range(vocab_size, device_mesh.size(), device_mesh.get_local_rank())
        ids = input_ids.to_local() if isinstance(input_ids, DTensor) else input_ids
        buffer.materialize_mask((ids < offset) | (ids >= offset + size))
        return True
    return False


class VocabParallelEmbedding(RowwiseParallel):
    """``RowwiseParallel`` for ``nn.Embedding`` (vocab rows sharded) with a mask-buffer repair.

    ``input_layouts`` defaults to ``Replicate()``: token ids are never sharded (torch's
    ``RowwiseParallel`` default ``Shard(-1)`` would silently treat them as sequence shards).
    The pre-hook keeps a reference to the original ids (no copy: the DTensor embedding op
    does not modify them); the post-hook rebuilds the mask if torch left it empty.
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True):
        super().__init__(input_layouts=input_layouts or Replicate(), output_layouts=output_layouts,
                         use_local_output=use_local_output)

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        if isinstance(inputs[0], torch.Tensor):  # an id no shard holds would embed as zeros, silently
            check_token_values(inputs[0], mod.num_embeddings)
        mod._vocab_parallel_ids = inputs[0]
        return RowwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        input_ids = mod.__dict__.pop("_vocab_parallel_ids", None)
        if isinstance(outputs, DTensor) and input_ids is not None:
            repair_mask_partial(outputs, input_ids, mod.weight.shape[0], device_mesh)
        return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def swap_in_local_params(module: nn.Module, transform=None) -> None:
    """For one forward: every DTensor parameter of ``module``'s subtree is replaced by its
    local tensor (``to_local()``, differentiable, optionally passed through ``transform``),
    so single-device module code runs on the shard. ``restore_params`` puts them back."""
    saved = []
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if isinstance(param, DTensor):
                local = param.to_local()
                saved.append((sub, name, param))
                sub._parameters[name] = transform(local) if transform else local
    module.__dict__.setdefault("_tp_saved_params", []).append(saved)


def restore_params(module: nn.Module) -> None:
    """Undo the latest ``swap_in_local_params`` on ``module``."""
    for sub, name, param in module.__dict__["_tp_saved_params"].pop():
        sub._parameters[name] = param


class AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over a process group."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class LocalReplicateParallel(ParallelStyle):
    """Replicated parameters (DTensor ``Replicate``) with the module computing on local tensors.

    For modules that TP leaves whole (norms without sequence parallelism, Falcon-H1's Mamba
    branch, per-head q/k norms). During the module's forward every parameter of its subtree
    is swapped for ``param.to_local()`` (differentiable, so gradients reach the DTensor
    parameter) and restored afterwards; DTensor inputs are gathered to full plain tensors.

    - ``grad_allreduce=False``: the inputs are replicated over TP, so each rank's local
      gradient already is the full gradient.
    - ``grad_allreduce=True``: the inputs are sharded over TP (e.g. per-head norms on local
      heads); each rank holds a partial gradient, summed over the TP group in backward.
    - ``output_layouts``: None returns plain tensors; a placement turns every tensor output
      (replicated on every rank) into a DTensor in that layout: ``Replicate()`` to add it to
      sequence-sharded DTensors (``output_as_dtensor=True`` is the same), ``Shard(1)`` to
      join the residual stream under sequence parallelism ([B, S, D] -> local [B, S/tp, D],
      a slice; its backward all-gathers the gradient).

    Must be applied to the outermost module that uses the parameters (a parameter read as an
    attribute by a parent would otherwise bypass the swap).
    """

    def __init__(self, *, grad_allreduce: bool = False, output_as_dtensor: bool = False,
                 output_layouts: Placement | None = None):
        super().__init__()
        self.grad_allreduce = grad_allreduce
        self.output_layouts = output_layouts or (Replicate() if output_as_dtensor else None)

    def _swap_in_local(self, mesh: DeviceMesh, mod, args, kwargs):
        if self.grad_allreduce:
            swap_in_local_params(mod, lambda local: AllReduceGrad.apply(local, mesh.get_group())
                                 if local.requires_grad else local)
        else:
            swap_in_local_params(mod)
        args = tuple(_to_plain(a) for a in args)
        kwargs = {k: _to_plain(v) for k, v in kwargs.items()}
        return args, kwargs

    def _restore(self, mesh: DeviceMesh, mod, args, outputs):
        restore_params(mod)
        if self.output_layouts is None:
            return outputs

        def wrap(tensor):
            replicated = DTensor.from_local(tensor, mesh, [Replicate()], run_check=False)
            return replicated if self.output_layouts == Replicate() else replicated.redistribute(mesh, [self.output_layouts])

        if isinstance(outputs, torch.Tensor):
            return wrap(outputs)
        if isinstance(outputs, tuple):
            return tuple(wrap(o) if isinstance(o, torch.Tensor) else o for o in outputs)
        return outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for sub in module.modules():
            for name, param in list(sub._parameters.items()):
                if param is None or isinstance(param, DTensor):
                    continue
                replicated = distribute_tensor(param.data, device_mesh, [Replicate()], src_data_rank=self.src_data_rank)
                sub.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(partial(self._swap_in_local, device_mesh), with_kwargs=True)
        module.register_forward_hook(partial(self._restore, device_mesh), always_call=True)
        return module

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(grad_allreduce={self.grad_allreduce}, "
                f"output_layouts={self.output_layouts})")


class TokenwiseParallel(LocalReplicateParallel):
    """A per-token module (an ``nn.Linear``) on this rank's tokens of a sequence-sharded input:
    ``[B, S/tp, D_in]`` (DTensor ``Shard(1)``) -> local compute with replicated parameters ->
    ``[B, S/tp, D_out]`` as ``Shard(1)``. Each rank's parameter gradient covers its own tokens, so
    it is summed over TP in backward. No all-gather, no repeated work (Zamba2's ``linear`` under SP).
    """

    def __init__(self):
        super().__init__(grad_allreduce=True, output_layouts=Shard(1))

    def _swap_in_local(self, mesh: DeviceMesh, mod, args, kwargs):
        swap_in_local_params(mod, lambda local: AllReduceGrad.apply(local, mesh.get_group())
                             if local.requires_grad else local)

        def local(value):
            if not isinstance(value, DTensor):
                return value
            if value.placements != (Shard(1),):
                raise ValueError(f"{type(mod).__name__} under TokenwiseParallel needs a sequence-sharded input "
                                 f"(Shard(1)), got {value.placements}")
            return value.to_local()

        return tuple(local(a) for a in args), {k: local(v) for k, v in kwargs.items()}

    def _restore(self, mesh: DeviceMesh, mod, args, outputs):
        restore_params(mod)
        if isinstance(outputs, torch.Tensor):
            return DTensor.from_local(outputs, mesh, [Shard(1)], run_check=False)
        return outputs

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def replicated_local(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` whole on every rank as a plain tensor whose gradient is summed over TP in backward.

    For the input of a column-parallel computation on local shards: each rank's input
    gradient covers only its columns (a partial sum). A plain ``x`` is taken as replicated;
    a sequence-sharded DTensor is all-gathered first ([B, S/tp, D] -> [B, S, D]).
    """
    return replicated_input(x, mesh).to_local(grad_placements=[Partial()])


def reduce_partial(y: torch.Tensor, mesh: DeviceMesh, placement: Placement = Replicate()) -> DTensor:
    """Sum the per-rank partial results ``y`` over TP into a DTensor in ``placement``
    (all-reduce for ``Replicate()``, reduce-scatter for ``Shard(d)``)."""
    return DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, [placement])


# ----------------------------------------------------------------------------- seams of a head/channel-parallel mixer


def replicated_input(x, mesh: DeviceMesh):
    """A mixer input as a ``Replicate`` DTensor: plain tensors are wrapped (backward all-reduces
    the partial input gradient), sequence shards are all-gathered ``[B, S/tp, D] -> [B, S, D]``
    (backward reduce-scatters)."""
    if isinstance(x, DTensor):
        return x.redistribute(mesh, [Replicate()]) if x.placements != (Replicate(),) else x
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False)


def map_first_input(args: tuple, kwargs: dict, name: str, fn) -> tuple[tuple, dict]:
    """Apply ``fn`` to the first positional argument, or to keyword ``name`` when given so."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if kwargs.get(name) is not None:
        return args, {**kwargs, name: fn(kwargs[name])}
    return args, kwargs


def local_mixer_input(mesh: DeviceMesh, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A head/channel-parallel mixer's input ``[B, S, D]`` (``[B, S/tp, D]`` under SP) as a plain
    ``[B, S, D]`` whose gradient is a partial sum over TP (``replicated_local``)."""
    return map_first_input(args, kwargs, "hidden_states", lambda x: replicated_local(x, mesh))


def row_parallel_exit(out_proj: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """The mixer's out projection, row-parallel: its one collective. ``y_local [B, S, W/tp]`` -> partial
    ``[B, S, D]`` -> all-reduce ``[B, S, D]`` (SP: reduce-scatter ``[B, S/tp, D]``, left a DTensor)."""
    output = Shard(1) if sequence_parallel else Replicate()
    RowwiseParallel(output_layouts=output, use_local_output=not sequence_parallel)._apply(out_proj, mesh)
