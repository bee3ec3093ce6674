"""The loss: per-token cross entropy summed over valid tokens, divided by the global count.

Every rank sums the losses of the tokens it holds; dividing by the number of valid
tokens over all data- and context-parallel ranks makes the sum of the ranks' losses
the loss of the whole batch, so summed gradients (FSDP's divide factor 1) are exact.

``lm_head_loss`` computes that sum from the final hidden states and the LM head weight in
blocks, never holding the ``[T, V]`` logits (``models/lm_head_loss.py``), vocabulary-parallel
over a tensor-parallel group (``parallel/tensor/vocab_parallel_loss.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from hybridpar.models.lm_head_loss import IGNORE_INDEX, LMHeadLoss, chunked_lm_head_loss

__all__ = ["IGNORE_INDEX", "lm_head_loss", "lm_head_loss_output", "token_loss_sum", "valid_token_count", "real_token_mask",
           "global_sum"]


def lm_head_loss(hidden: Tensor, weight: Tensor, labels: Tensor, *, chunk_size: int = 4096, tp_group=None,
                 vocab_size: int | None = None, scale: float = 1.0, softcap: float | None = None
                 ) -> tuple[Tensor, Tensor]:
    """``(loss_sum, valid_count)``: summed cross entropy of ``hidden @ weight.T`` over labels != -100.

    Equals ``F.cross_entropy(hidden @ weight.T, labels, reduction="sum", ignore_index=-100)`` and its
    gradients for ``hidden [..., D]`` and ``weight`` without the logits: blocks of ``chunk_size``
    tokens x ``chunk_size`` vocabulary rows, computed in at least float32. ``valid_count`` is the
    int64 number of labelled tokens (divide by the global count yourself).

    - ``tp_group=None`` and a plain ``weight [V, D]``: one process.
    - ``tp_group``: ``weight`` is this rank's contiguous vocabulary shard (``Shard(0)`` layout;
      pass ``vocab_size=V`` when V does not split evenly) and ``hidden`` the same on every rank
      of the group; ``grad_hidden`` is the full gradient, ``grad_weight`` this shard's.
    - a ``Shard(0)`` DTensor ``weight`` (a ``ColwiseParallel`` LM head) implies its group;
      a ``Shard(1)`` DTensor ``hidden`` (sequence parallel) is gathered first.
    - ``scale``, ``softcap``: the loss of ``softcap * tanh(scale * z / softcap)`` (or ``scale * z``)
      for heads that scale or soft-cap their logits ``z = hidden @ weight.T`` (Gemma 2/3, Granite, ...).
    """
    out = lm_head_loss_output(hidden, weight, labels, chunk_size=chunk_size, tp_group=tp_group, vocab_size=vocab_size,
                              scale=scale, softcap=softcap)
    return out.loss_sum, out.valid_count


def lm_head_loss_output(hidden: Tensor, weight: Tensor, labels: Tensor, *, chunk_size: int = 4096, tp_group=None,
                        vocab_size: int | None = None, return_predictions: bool = False, scale: float = 1.0,
                        softcap: float | None = None) -> LMHeadLoss:
    """``lm_head_loss`` as an ``LMHeadLoss`` (``loss_sum``, ``valid_count``, and the argmax
    ``predictions`` when ``return_predictions``)."""
    sharded = tp_group is not None or any(not p.is_replicate() for p in getattr(weight, "placements", ()))
    if sharded:
        from hybridpar.parallel.tensor.vocab_parallel_loss import vocab_parallel_lm_head_loss

        return vocab_parallel_lm_head_loss(hidden, weight, labels, tp_group=tp_group, chunk_size=chunk_size,
                                           vocab_size=vocab_size, return_predictions=return_predictions, scale=scale,
                                           softcap=softcap)
    return chunked_lm_head_loss(hidden, weight, labels, chunk_size=chunk_size, return_predictions=return_predictions,
                                scale=scale, softcap=softcap)


def token_loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of cross-entropy over tokens whose label is not ``-100``; ``logits [B, S, V]``.

    Materializes the logits: for tests and small models; training uses ``lm_head_loss``."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float() if logits.dtype in (torch.bfloat16, torch.float16) else logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def valid_token_count(labels: Tensor) -> Tensor:
    """Number of tokens that carry a label (int64 scalar)."""
    return (labels != IGNORE_INDEX).sum()


def real_token_mask(pack: dict) -> Tensor:
    """bool ``[T]`` of one pack (``data/packing.pack_documents``): True at its documents' real tokens, False at
    each document's padding (``seq_lens_padded - seq_lens``) and the pack's unfilled tail."""
    real, padded = pack["seq_lens"].long(), pack["seq_lens_padded"].long()  # [n_docs]
    flags = torch.tensor([True, False]).repeat(real.numel())  # real, padding, real, padding, ...
    mask = torch.repeat_interleave(flags, torch.stack([real, padded - real], dim=1).reshape(-1))
    return torch.cat([mask, mask.new_zeros(pack["input_ids"].shape[-1] - mask.numel())])


def global_sum(value: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sum a scalar over ``group`` (no-op for ``None``), without gradient."""
    value = value.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
    return value
