"""Deterministic packed batches for training and evaluation.

Step ``k`` always receives the same packs, whatever the layout, the world size or
``train.steps``, so a resumed run (the data position is just the step), a run at another
layout and a run extended to more steps see the same tokens:

- a synthetic task draws documents from one seeded generator, in windows of a fixed
  number of documents (``WINDOW_PACKS`` packs' worth); each window is packed on its own
  and windows are appended as steps need them, so pack ``j`` depends only on the data
  settings, never on how many steps will run;
- a file is read and packed whole, and steps cycle over its packs.

Packs are padded per document to ``pad_to_multiple_of`` (default ``2*cp``); a resumed run
keeps the padding its checkpoint recorded. Each data-parallel rank takes its share of a
step's packs.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import numpy as np

from hybridpar.config import DataConfig
from hybridpar.data.packing import pack_documents
from hybridpar.data.sources import TASKS, TEXT_SPLITS, ByteTokenizer, jsonl_documents, text_documents


class DataError(ValueError):
    """A data setting that cannot produce batches, with the fix."""


EVAL_FRACTION = 0.1  # of a file's documents, held out for evaluation
WINDOW_PACKS = 64  # synthetic documents are packed in windows of about this many packs
FILE_TASKS = {"text": {"split": "paragraph"}, "jsonl": {"text_field": "text"}}  # options and defaults


def pad_multiple(config: DataConfig, cp_size: int) -> int:
    """The per-document padding multiple: ``data.pad_to_multiple_of`` or ``2*cp``."""
    return config.pad_to_multiple_of or 2 * cp_size


def make_task(config: DataConfig, vocab_size: int, seed_offset: int = 0):
    """The synthetic task of ``data.task`` with ``data.task_options``; DataError names the option."""
    allowed = {f.name: f.default for f in dataclasses.fields(TASKS[config.task]) if f.name != "seed"}
    unknown = sorted(set(config.task_options) - set(allowed))
    if unknown:
        seed = " (the seed is data.seed)" if "seed" in unknown else ""
        raise DataError(f"data.task_options {unknown} do not apply to data.task={config.task!r}{seed}; its options are "
                        f"{allowed} (shown with their defaults); remove the others.")
    options = {"vocab_size": vocab_size, **config.task_options, "seed": config.seed + seed_offset}
    try:
        task = TASKS[config.task](**options)
    except (TypeError, ValueError, IndexError, KeyError) as error:
        raise DataError(f"data.task_options={config.task_options} do not fit data.task={config.task!r}: {error}") from None
    if task.vocab_size > vocab_size:
        raise DataError(f"data.task_options.vocab_size={task.vocab_size} is larger than the model's vocabulary "
                        f"({vocab_size}), so token ids would not exist; use data.task_options.vocab_size <= {vocab_size} "
                        "or a model with a larger vocab_size.")
    return task


def validate_data(config: DataConfig, vocab_size: int) -> None:
    """Every data rule that needs no file contents (the launcher checks these before starting)."""
    if config.task in TASKS:
        make_task(config, vocab_size)
        return
    if config.task not in FILE_TASKS:
        raise DataError(f"data.task={config.task!r} is unknown; choose one of {sorted(TASKS) + sorted(FILE_TASKS)}.")
    allowed = FILE_TASKS[config.task]
    unknown = sorted(set(config.task_options) - set(allowed))
    if unknown:
        raise DataError(f"data.task_options {unknown} do not apply to data.task={config.task!r}; its options are "
                        f"{allowed} (shown with their defaults); clear the others with data.task_options={{}}.")
    split = config.task_options.get("split", "paragraph")
    if config.task == "text" and split not in TEXT_SPLITS:
        raise DataError(f"data.task_options.split={split!r} is invalid: it must be one of {list(TEXT_SPLITS)} "
                        "(paragraph: documents separated by blank lines, line: one per line, file: the whole file).")
    if not config.path or not Path(config.path).is_file():
        raise DataError(f"data.path={config.path!r} is not a file; data.task={config.task!r} needs an existing local file.")
    if vocab_size < ByteTokenizer.vocab_size:
        raise DataError(f"data.task={config.task!r} reads bytes (ids 0-255) but the model's vocab_size is {vocab_size}; "
                        "use a model with vocab_size >= 256.")


def load_documents(config: DataConfig, num_docs: int, seed_offset: int, vocab_size: int) -> list:
    """Documents of the configured task or file; ``seed_offset`` separates train from eval.

    Synthetic tasks give their first ``num_docs`` documents (eval from another seed); a
    file keeps its last 10% of documents (at least one) for evaluation.
    """
    validate_data(config, vocab_size)
    if config.task in TASKS:
        task = make_task(config, vocab_size, seed_offset)
        return task.documents(num_docs)
    options = {**FILE_TASKS[config.task], **config.task_options}
    docs = text_documents(config.path, **options) if config.task == "text" else jsonl_documents(config.path, **options)
    held_out = max(1, int(len(docs) * EVAL_FRACTION)) if len(docs) > 1 else 0
    if seed_offset and not held_out:
        how = (f"under data.task_options.split={options['split']!r}" if config.task == "text" else "(one per line)")
        raise DataError(
            f"data.path={config.path!r} holds {len(docs)} document(s) {how}; evaluation holds out the last 10% and "
            "needs at least 2. Add documents (text: separate them by blank lines, or use data.task_options.split=line "
            "for one per line), or set train.eval_every=0."
        )
    return docs[len(docs) - held_out:] if seed_offset else docs[:len(docs) - held_out] or docs


class PackStream:
    """The packs of step ``k`` (``packs_per_step`` of them), independent of how many steps run."""

    _warned = False  # the packer's split/drop notice is shown once per process

    def __init__(self, config: DataConfig, cp_size: int, vocab_size: int, seed_offset: int = 0,
                 pad_to_multiple_of: int | None = None):
        self.multiple = pad_to_multiple_of or pad_multiple(config, cp_size)
        if self.multiple % (2 * cp_size):
            raise DataError(
                f"data.pad_to_multiple_of={self.multiple} is not a multiple of 2*cp={2 * cp_size}; every padded document "
                f"must split into 2*cp equal chunks: use a multiple of {2 * cp_size} or leave it null."
            )
        if config.pack_size % self.multiple:
            raise DataError(
                f"data.pack_size={config.pack_size} is not a multiple of the document padding {self.multiple} (2*cp="
                f"{2 * cp_size}); context parallelism splits every document into 2*cp chunks: use pack_size="
                f"{-(-config.pack_size // self.multiple) * self.multiple}."
            )
        self.config, self.packs_per_step, self.pool = config, config.packs_per_step, []
        self._offset = 0  # global index of pool[0] (synthetic tasks)
        if config.task in TASKS:
            self._task = make_task(config, vocab_size, seed_offset)
            self._rng = np.random.default_rng(self._task.seed)
            mean_length = (self._task.min_len + self._task.max_len) / 2
            self._window = max(8, math.ceil(WINDOW_PACKS * config.pack_size / mean_length))
            self._extend()
        else:
            self._task = None
            self._pack(load_documents(config, 0, seed_offset, vocab_size))
        if not self.pool:
            where = f"data.path={config.path!r} holds no document (it is empty or blank)" if self._task is None else \
                f"data.task={config.task!r} produced no tokens"
            raise DataError(f"{where}; check data.path and data.task_options.")

    def _pack(self, documents: list) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.pool += pack_documents(documents, self.config.pack_size, overlong="split", pad_to_multiple_of=self.multiple)
        if caught and not PackStream._warned:  # once per process (train and eval streams, every window)
            PackStream._warned = True
            warnings.warn(str(caught[0].message), stacklevel=3)

    def _extend(self) -> None:
        self._pack([self._task.sample(self._rng) for _ in range(self._window)])

    def step_packs(self, step: int) -> list[dict]:
        """The global packs of ``step``."""
        start = step * self.packs_per_step
        if self._task is not None:
            if start < self._offset:  # an earlier step than the last one asked for: draw again from the seed
                self._rng, self.pool, self._offset = np.random.default_rng(self._task.seed), [], 0
            while self._offset + len(self.pool) < start + self.packs_per_step:
                self._extend()
            del self.pool[:start - self._offset]  # packs no later step needs
            self._offset = start
            return self.pool[:self.packs_per_step]
        return [self.pool[(start + i) % len(self.pool)] for i in range(self.packs_per_step)]

    def rank_packs(self, step: int, dp_rank: int, dp_size: int) -> list[dict]:
        """This data-parallel rank's packs of ``step`` (a contiguous share)."""
        packs = self.step_packs(step)
        if len(packs) % dp_size:
            raise DataError(
                f"data.packs_per_step={len(packs)} is not divisible by the data-parallel size {dp_size}; "
                f"use a multiple of {dp_size}."
            )
        share = len(packs) // dp_size
        return packs[dp_rank * share:(dp_rank + 1) * share]
