"""The loss: per-token cross entropy summed over valid tokens, divided by the global count.

Every rank sums the losses of the tokens it holds; dividing by the number of valid
tokens over all data- and context-parallel ranks makes the sum of the ranks' losses
the loss of the whole batch, so summed gradients (FSDP's divide factor 1) are exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def token_loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of cross-entropy over tokens whose label is not ``-100``; ``logits [B, S, V]``."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float() if logits.dtype in (torch.bfloat16, torch.float16) else logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def valid_token_count(labels: Tensor) -> Tensor:
    """Number of tokens that carry a label (int64 scalar)."""
    return (labels != IGNORE_INDEX).sum()


def global_sum(value: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sum a scalar over ``group`` (no-op for ``None``), without gradient."""
    value = value.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
    return value
