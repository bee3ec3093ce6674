"""Vocabulary-parallel LM head + cross entropy: no rank holds another rank's logits.

Rank ``r`` of the tensor-parallel group holds LM head rows ``[o_r, o_r + V_r)`` in torch's
``Shard(0)`` chunking (``V_r = ceil(V/tp)`` for the first ranks, the rest for the last ones;
the layout of ``ColwiseParallel`` / ``VocabParallelEmbedding``), and the full hidden states of
its tokens (replicated over TP). Each rank runs the blockwise passes of
``models/lm_head_loss.py`` on its own rows and gets, per token ``t``:

    m_t^r = max_{v in r} z_tv      s_t^r = sum_{v in r} exp(z_tv - m_t^r)
    z_t^r = z_{t,y_t} if y_t in r else 0          a_t^r = first argmax over r (global id)

and combines them with two all-reduces of ``O(T)`` numbers:

    M_t = max_r m_t^r                                   all-reduce MAX   [T]
    S_t = sum_r s_t^r exp(m_t^r - M_t),  Z_t = sum_r z_t^r
                                                        all-reduce SUM   [2, T]
    lse_t = M_t + log S_t          loss = sum_{valid t} (lse_t - Z_t)   (equal on every rank)

Predictions (only when asked): ``argmax_t = min_r {a_t^r : m_t^r = M_t}`` (all-reduce MIN
``[T]``): the lowest global id among the maxima, as ``torch.argmax``.

Scaled or soft-capped logits (``scale``, ``softcap``): every ``z`` above is the transformed
``z'`` of ``models/lm_head_loss.py`` (an elementwise map, so the vocabulary split is unchanged),
and the backward multiplies by ``dz'/dz``; the predictions are ``z'``'s argmax (``z``'s for ``s > 0``).

Backward: each rank recomputes its blocks with the global ``lse`` and gets the exact
``dW`` of its own rows and a partial ``dh_t = sum_{v in r} dz_tv W_v``; all-reduce SUM
``[T, D]`` gives every rank the full input gradient (the input is replicated over TP). When the
input was a DTensor (sequence parallel ``Shard(1)``), the partial gradient is handed to DTensor
as ``Partial`` instead, which reduce-scatters it back to ``[B, S/tp, D]``.

Under autocast (mixed precision without FSDP) the block matmuls run in bf16 and the statistics in
float32, as ``chunked_lm_head_loss`` does on one process (they ran in float32 here before round 30).

The passes and the collectives are one ``torch.library.custom_op`` (forward and backward), so
``torch.compile`` sees one node and no host sync happens. Inputs are checked before any
collective. ``VocabParallelLMHeadLoss`` is the ``HybridLM.loss_core`` the TP plan installs
(``VocabParallelLoss`` style, plan key ``""``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from hybridpar.models.arguments import python_number
from hybridpar.models.lm_head_loss import (
    IGNORE_INDEX, LMHeadLoss, autocast_matmul_dtype, chunked_lm_head_loss, check_label_values, check_lm_head_inputs,
    compute_dtype, check_logit_transform, local_gradients, local_statistics, loss_from_statistics,
)

__all__ = ["vocab_parallel_lm_head_loss", "VocabParallelLMHeadLoss", "VocabParallelLoss", "vocab_shard"]


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``(offset, rows)`` of rank ``tp_rank`` under ``Shard(0)`` of ``vocab_size`` rows (uneven allowed)."""
    rows, offset = Shard.local_shard_size_and_offset(vocab_size, tp_size, tp_rank)
    return int(offset), int(rows)


# ---------------------------------------------------------------- the op


@torch.library.custom_op("hybridpar::vocab_parallel_lm_head_loss", mutates_args=())
def _vocab_parallel_op(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int, vocab_size: int,
                       group_name: str, with_predictions: bool, reduce_grad_hidden: bool, scale: float = 1.0,
                       softcap: float | None = None, matmul_dtype: torch.dtype | None = None
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss_sum, lse [T], argmax [T])``; ``hidden [T, D]`` whole, ``weight [V_r, D]`` this rank's rows."""
    group = _resolve_process_group(group_name)
    offset, _ = vocab_shard(vocab_size, dist.get_world_size(group), dist.get_rank(group))
    check_label_values(labels, vocab_size)  # before the first collective
    row_max, sum_exp, target, argmax = local_statistics(hidden, weight, labels, chunk_size, offset, matmul_dtype,
                                                        scale=scale, softcap=softcap)
    global_max = row_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)  # [T] -> [T]
    # [2T + 1]: rescaled sums of exponentials, target logits, and the rows (must add up to V)
    sums = torch.cat([sum_exp * torch.exp(row_max - global_max), target, target.new_full((1,), weight.shape[0])])
    dist.all_reduce(sums, group=group)
    tokens = hidden.shape[0]
    lse = global_max + sums[:tokens].log()
    loss_sum = loss_from_statistics(lse, sums[tokens:2 * tokens], labels, vocab_size)
    loss_sum = torch.where(sums[-1] == vocab_size, loss_sum, float("nan"))  # shards inconsistent with vocab_size
    if with_predictions:
        argmax = torch.where(row_max == global_max, argmax, vocab_size)
        dist.all_reduce(argmax, op=dist.ReduceOp.MIN, group=group)  # [T] -> [T]
    return loss_sum, lse, argmax


@_vocab_parallel_op.register_fake
def _(hidden, weight, labels, chunk_size, vocab_size, group_name, with_predictions, reduce_grad_hidden, scale=1.0,
      softcap=None, matmul_dtype=None):
    dtype = compute_dtype(hidden, weight)
    tokens = hidden.shape[0]
    return hidden.new_empty((), dtype=dtype), hidden.new_empty((tokens,), dtype=dtype), labels.new_empty((tokens,))


@torch.library.custom_op("hybridpar::vocab_parallel_lm_head_loss_backward", mutates_args=())
def _vocab_parallel_backward_op(grad_loss: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor,
                                chunk_size: int, vocab_size: int, group_name: str, reduce_grad_hidden: bool,
                                scale: float = 1.0, softcap: float | None = None,
                                matmul_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    group = _resolve_process_group(group_name)
    offset, _ = vocab_shard(vocab_size, dist.get_world_size(group), dist.get_rank(group))
    grad_hidden, grad_weight = local_gradients(grad_loss, hidden, weight, labels, lse, chunk_size, offset, matmul_dtype,
                                               scale=scale, softcap=softcap)
    if reduce_grad_hidden:
        dist.all_reduce(grad_hidden, group=group)  # partial over vocabulary shards [T, D] -> full [T, D]
    return grad_hidden.to(hidden.dtype), grad_weight


@_vocab_parallel_backward_op.register_fake
def _(grad_loss, hidden, weight, labels, lse, chunk_size, vocab_size, group_name, reduce_grad_hidden, scale=1.0,
      softcap=None, matmul_dtype=None):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, labels, chunk_size, vocab_size, group_name, _, reduce_grad_hidden, scale, softcap, mm = inputs
    ctx.save_for_backward(hidden, weight, labels, output[1])
    ctx.options = (chunk_size, vocab_size, group_name, reduce_grad_hidden, scale, softcap, mm)


def _backward(ctx, grad_loss, _grad_lse, _grad_argmax):
    hidden, weight, labels, lse = ctx.saved_tensors
    grad_hidden, grad_weight = torch.ops.hybridpar.vocab_parallel_lm_head_loss_backward(
        grad_loss, hidden, weight, labels, lse, *ctx.options)
    return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("hybridpar::vocab_parallel_lm_head_loss", _backward, setup_context=_setup_context)


# ---------------------------------------------------------------- inputs: plain tensors or DTensors


def _group_of(mesh: DeviceMesh, what: str, placements) -> dist.ProcessGroup:
    if mesh.ndim != 1:
        raise ValueError(f"{what} is a DTensor on a {mesh.ndim}-D mesh {mesh.mesh_dim_names} (placements "
                         f"{tuple(placements)}); the vocab-parallel loss takes tensors on the 1-D TP mesh. Under FSDP "
                         "compute the loss inside the root module's forward, where FSDP has unsharded the weight.")
    return mesh.get_group()


def _same_group(a: dist.ProcessGroup, b: dist.ProcessGroup) -> bool:
    return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def _local_weight(weight: Tensor, tp_group, vocab_size: int | None) -> tuple[Tensor, object, int]:
    """``(this rank's rows, group, V)`` of a plain shard or a ``Shard(0)`` DTensor."""
    if isinstance(weight, DTensor):
        group = _group_of(weight.device_mesh, "weight", weight.placements)
        if weight.placements != (Shard(0),):
            raise ValueError(f"weight is a DTensor with placements {weight.placements}; the vocab-parallel loss "
                             "needs the LM head sharded by vocabulary rows, Shard(0) (ColwiseParallel).")
        if tp_group is not None and not _same_group(group, tp_group):
            raise ValueError(f"weight is sharded over ranks {dist.get_process_group_ranks(group)} but tp_group holds "
                             f"ranks {dist.get_process_group_ranks(tp_group)}; pass the weight's TP group (or none). "
                             "An FSDP-sharded weight is unsharded only inside the root module's forward.")
        if vocab_size is not None and vocab_size != weight.shape[0]:
            raise ValueError(f"vocab_size={vocab_size} but the DTensor weight has {weight.shape[0]} rows; omit "
                             "vocab_size for a DTensor weight.")
        return weight.to_local(), group, weight.shape[0]  # to_local: the gradient reaches the DTensor parameter
    if tp_group is None:
        raise ValueError("the vocab-parallel loss needs tp_group (the group the LM head rows are sharded over) or a "
                         "Shard(0) DTensor weight.")
    size, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    vocab_size = weight.shape[0] * size if vocab_size is None else vocab_size
    offset, rows = vocab_shard(vocab_size, size, rank)
    if weight.shape[0] != rows:
        raise ValueError(f"weight has {weight.shape[0]} rows on tp rank {rank} of {size}, but Shard(0) of "
                         f"vocab_size={vocab_size} gives this rank rows [{offset}, {offset + rows}); pass each rank's "
                         "contiguous shard (torch.chunk of the [V, D] weight) and vocab_size=V for uneven splits.")
    return weight, tp_group, vocab_size


def _local_hidden(hidden: Tensor, group) -> tuple[Tensor, bool]:
    """``(full local-token hidden, reduce the input gradient in the op)``."""
    if not isinstance(hidden, DTensor):
        return hidden, True
    if not _same_group(_group_of(hidden.device_mesh, "hidden", hidden.placements), group):
        raise ValueError("hidden is a DTensor on another mesh than the weight's; pass both on the TP mesh.")
    # sequence parallel: [B, S/tp, D] -> [B, S, D]; backward: Partial -> reduce-scatter to [B, S/tp, D].
    # Already replicated (a transformers LM head's input, gathered by its style): no redistribution,
    # whose backward would all-reduce the partial gradient before the style's own reduction
    replicated = all(p.is_replicate() for p in hidden.placements)
    gathered = hidden if replicated else hidden.redistribute(hidden.device_mesh, [Replicate()])
    return gathered.to_local(grad_placements=[Partial()]), False


def vocab_parallel_lm_head_loss(hidden: Tensor, weight: Tensor, labels: Tensor, *, tp_group=None,
                                chunk_size: int = 4096, vocab_size: int | None = None,
                                return_predictions: bool = False, scale: float = 1.0,
                                softcap: float | None = None) -> LMHeadLoss:
    """The loss of ``hidden [..., D]`` against the vocabulary sharded over ``tp_group`` (module docstring).

    ``weight``: this rank's rows ``[V_r, D]`` (plain; ``vocab_size`` defaults to ``V_r * tp``, pass it for
    uneven splits) or the ``Shard(0)`` DTensor. ``hidden``: plain and replicated over TP, or a DTensor on
    the TP mesh (sequence-sharded ``Shard(1)`` is gathered). ``labels``: the local tokens' labels.
    ``scale``/``softcap``: the logits' transform, as ``chunked_lm_head_loss``'s.
    """
    chunk_size, scale, softcap, vocab_size = map(python_number, (chunk_size, scale, softcap, vocab_size))
    local_weight, group, vocab = _local_weight(weight, tp_group, vocab_size)
    check_lm_head_inputs(hidden, local_weight, labels, chunk_size)  # global hidden shape: no communication
    check_logit_transform(scale, softcap)
    if dist.get_world_size(group) == 1:
        return chunked_lm_head_loss(hidden.full_tensor() if isinstance(hidden, DTensor) else hidden, local_weight,
                                    labels, chunk_size=chunk_size, return_predictions=return_predictions, scale=scale,
                                    softcap=softcap)
    local_hidden, reduce_grad_hidden = _local_hidden(hidden, group)
    flat_labels = labels.reshape(-1).long()
    loss_sum, _, argmax = torch.ops.hybridpar.vocab_parallel_lm_head_loss(
        local_hidden.reshape(-1, local_hidden.shape[-1]), local_weight, flat_labels, chunk_size, vocab,
        group.group_name, return_predictions, reduce_grad_hidden, float(scale), None if softcap is None else float(softcap),
        autocast_matmul_dtype(local_hidden, local_weight))  # bf16 block matmuls under autocast, as on one process
    count = (flat_labels != IGNORE_INDEX).sum()
    return LMHeadLoss(loss_sum, count, argmax.view(labels.shape) if return_predictions else None)


# ---------------------------------------------------------------- the model seam and its plan style


class VocabParallelLMHeadLoss:
    """``HybridLM.loss_core`` under tensor parallelism: the vocab-parallel loss on ``tp_group``."""

    def __init__(self, tp_group: dist.ProcessGroup, chunk_size: int = 4096):
        self.tp_group = tp_group
        self.chunk_size = chunk_size

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, return_predictions: bool = False) -> LMHeadLoss:
        return vocab_parallel_lm_head_loss(hidden, weight, labels, tp_group=self.tp_group, chunk_size=self.chunk_size,
                                           return_predictions=return_predictions)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tp={dist.get_world_size(self.tp_group)}, chunk_size={self.chunk_size})"


class VocabParallelLoss(ParallelStyle):
    """Plan entry for the model root (key ``""``): replace its ``loss_core`` with the vocab-parallel
    one on the TP mesh, keeping the chunk size. The LM head itself is sharded by ``ColwiseParallel``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        core = getattr(module, "loss_core", None)
        if core is None:
            raise ValueError(f"{type(module).__name__} has no loss_core to make vocab-parallel; apply VocabParallelLoss "
                             "to a HybridLM (plan key '').")
        module.loss_core = VocabParallelLMHeadLoss(device_mesh.get_group(), chunk_size=core.chunk_size)
        return module
