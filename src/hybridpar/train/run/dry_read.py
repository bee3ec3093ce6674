"""What ``--dry-run`` reads of the data: the records as training reads them, when that is cheap.

Training reads and tokenizes every document at start; faults in the records (a line that is not
JSON, a wrong role, non-UTF-8 bytes, documents with nothing to learn, too few documents to hold
some out) are found there. ``--dry-run`` does the same reading, through the same ``PackStream``
(same errors, same notices), when the data is at most ``READ_BYTES`` on disk and a synthetic task's
packs are at most 4,096 tokens; larger data (and a BPE tokenizer not trained yet) is not read, and
one notice says so. A synthetic task's packs too large to build are still held to its documents'
longest length (``split_note``), the one thing their building would say.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

from hybridpar.config import DataConfig
from hybridpar.config_rules import Notice
from hybridpar.data.sources import TASKS
from hybridpar.train.batches import WINDOW_PACKS, PackStream, eval_repeat_note, make_task

__all__ = ["READ_BYTES", "data_bytes", "read_like_training", "split_note"]

READ_BYTES = 8 * 2**20  # data a dry run reads in full (a few seconds of tokenizing)


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


def split_note(data: DataConfig, vocab_size: int) -> str | None:
    """The packer's split notice, foretold from the task's ``max_len`` when a synthetic task's documents can be longer
    than a pack (their lengths are uniform in ``[min_len, max_len]``: over a run, some are)."""
    task = make_task(data, vocab_size)
    if task.max_len <= data.pack_size:
        return None
    share = (task.max_len - max(task.min_len, data.pack_size + 1) + 1) / (task.max_len - task.min_len + 1)
    return (f"data.task={data.task!r} draws documents of {task.min_len}-{task.max_len} tokens (data.task_options "
            f"min_len, max_len), so {share:.0%} of them are longer than data.pack_size={data.pack_size} and training splits "
            "each into pieces, a document's later tokens in another row than the earlier ones they recall; use "
            f"data.pack_size >= {task.max_len} or data.task_options.max_len <= {data.pack_size}")


def read_like_training(config, data: DataConfig, vocab_size: int, tokenizer, bpe_pending: bool) -> str | None:
    """Build the training (and evaluation) packs as the trainer does (raising its errors, warning its
    notices; a synthetic task's up to 4,096-token packs); a notice when the data was not read, else None."""
    if data.task in TASKS:  # synthetic: no file; its packs are built as training builds them (the split notice)
        if data.pack_size * WINDOW_PACKS > READ_BYTES // 32:  # 64 packs of 4,096 tokens: about a second
            return split_note(data, vocab_size)
        size = 0
    elif data.task == "python_stdlib":
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
        with warnings.catch_warnings():  # the same file: its notices were said once above; the packer's may be new
            warnings.simplefilter("ignore")
            stream = PackStream(eval_data, cp, vocab_size, seed_offset=10_000, tokenizer=tokenizer)
        for note in (stream.pack_notice, eval_repeat_note(stream)):
            if note:
                warnings.warn(note, Notice, stacklevel=2)
    return None
