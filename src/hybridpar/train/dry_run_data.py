"""``--dry-run`` reads the data as training will, when that is cheap.

Training reads and tokenizes every document at start; faults in the records (a line that is not
JSON, a wrong role, non-UTF-8 bytes, documents with nothing to learn, too few documents to hold
some out for evaluation) are found there. A dry run does the same reading, through the same
``PackStream`` (same errors, same notices), when the data is at most ``READ_BYTES`` on disk;
larger data (and a BPE tokenizer not trained yet) is not read, and one notice says so.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

from hybridpar.config import RunConfig

READ_BYTES = 8 * 2**20  # data a dry run reads in full (a few seconds of tokenizing)

__all__ = ["READ_BYTES", "data_bytes", "read_like_training"]


def data_bytes(path: str | os.PathLike | None) -> int:
    """Bytes of a data file, or of the files under a data directory (symbolic links not followed)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def read_like_training(config: RunConfig, data, vocab_size: int, tokenizer, bpe_pending: bool) -> str | None:
    """Build the training (and evaluation) packs of a file task as the trainer does (raising its
    errors, warning its notices); returns a notice when the data was not read, else None."""
    from hybridpar.train.batches import TASKS, PackStream

    if data.task in TASKS:
        return None  # synthetic: its options were checked, there is no file
    if data.task == "python_stdlib":
        size = int(data.task_options.get("max_bytes", 4_000_000))
    else:
        size = data_bytes(data.path)
    if bpe_pending or size > READ_BYTES:
        why = "the BPE tokenizer is trained at the start of training" if bpe_pending else \
            f"it is {size / 2**20:.1f} MiB, above the {READ_BYTES // 2**20} MiB a dry run reads"
        return (f"dry run: the records of data.path={str(data.path)!r} were not read ({why}); training reads them at "
                "start and refuses a malformed record or data with nothing to learn there")
    cp = config.parallel.cp
    PackStream(data, cp, vocab_size, tokenizer=tokenizer)
    if config.train.eval_every:
        eval_data = dataclasses.replace(data, packs_per_step=config.train.eval_packs)
        with warnings.catch_warnings():  # the same documents: their notices were said once above
            warnings.simplefilter("ignore")
            PackStream(eval_data, cp, vocab_size, seed_offset=10_000, tokenizer=tokenizer)
    return None
