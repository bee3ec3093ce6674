"""The unigram baseline of a file task's held-out loss: what a model that ignores context scores.

    p(v) = (c_v + 1) / (N + V)      c_v: how often id v is a training label (N labels in all);
                                    add-one smoothing over the model's V ids
    unigram_loss = -(1/M) sum_{y in held-out labels} ln p(y)        (nats per token, as eval_loss)

The labels are exactly those the losses are taken over (-100 excluded): every pack of the
training stream (each training document once) and the evaluation packs ``Trainer.evaluate``
scores. An ``eval_loss`` below ``unigram_loss`` is what the model gained from context.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from hybridpar.data.packing import IGNORE_INDEX

__all__ = ["label_counts", "unigram_loss"]


def label_counts(packs: Iterable[dict], vocab_size: int) -> np.ndarray:
    """``[V]`` int64: how often each id is a label in ``packs`` (-100 skipped)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for pack in packs:
        labels = np.asarray(pack["labels"], dtype=np.int64).reshape(-1)
        labels = labels[labels != IGNORE_INDEX]
        if labels.size and (labels.min() < 0 or labels.max() >= vocab_size):
            raise ValueError(f"a label id ({labels.min()}..{labels.max()}) is outside the vocabulary [0, {vocab_size}).")
        counts += np.bincount(labels, minlength=vocab_size)
    return counts


def unigram_loss(train_packs: Iterable[dict], eval_packs: Iterable[dict], vocab_size: int) -> float:
    """Cross entropy (nats/token) of the eval labels under the add-one-smoothed unigram
    distribution of the training labels (module docstring); NaN without an eval label."""
    train = label_counts(train_packs, vocab_size).astype(np.float64)
    held_out = label_counts(eval_packs, vocab_size)
    if held_out.sum() == 0:
        return math.nan
    log_p = np.log(train + 1.0) - math.log(train.sum() + vocab_size)
    return float(-(held_out * log_p).sum() / held_out.sum())
