"""Deterministic packed batches for training and evaluation.

Step ``k`` always receives the same packs, whatever the layout or world size, so a
resumed run (the data position is just the step) and a run at another layout see the
same tokens. Each data-parallel rank takes its share of a step's packs.
"""

from __future__ import annotations

from pathlib import Path

from hybridpar.config import DataConfig
from hybridpar.data.packing import pack_documents
from hybridpar.data.sources import TASKS, jsonl_documents, text_documents


class DataError(ValueError):
    """A data setting that cannot produce batches, with the fix."""


EVAL_FRACTION = 0.1  # of a file's documents, held out for evaluation


def load_documents(config: DataConfig, num_docs: int, seed_offset: int, vocab_size: int) -> list:
    """Documents of the configured task or file; ``seed_offset`` separates train from eval.

    Synthetic tasks draw eval documents from another seed; a file keeps its last 10% of
    documents (at least one, when it has two or more) for evaluation.
    """
    if config.task in TASKS:
        options = {"vocab_size": vocab_size, **config.task_options, "seed": config.seed + seed_offset}
        try:
            task = TASKS[config.task](**options)
        except TypeError as error:
            raise DataError(f"data.task_options {config.task_options} do not fit task {config.task!r}: {error}.") from error
        return task.documents(num_docs)
    if config.task in ("text", "jsonl"):
        if not config.path or not Path(config.path).is_file():
            raise DataError(f"data.path={config.path!r} is not a file; task {config.task!r} needs an existing local file.")
        docs = text_documents(config.path, split="paragraph") if config.task == "text" else jsonl_documents(config.path)
        too_large = [t for d in docs for t in d if t >= vocab_size]
        if too_large:
            raise DataError(f"data file has token id {max(too_large)} >= vocab_size {vocab_size}; use a model with vocab_size >= 256.")
        held_out = max(1, int(len(docs) * EVAL_FRACTION)) if len(docs) > 1 else 0
        return docs[len(docs) - held_out:] if seed_offset else docs[:len(docs) - held_out] or docs
    raise DataError(f"data.task={config.task!r} is unknown; choose one of {sorted(TASKS) + ['jsonl', 'text']}.")


class PackStream:
    """The packs of step ``k`` (``packs_per_step`` of them), cycling over a packed pool."""

    def __init__(self, config: DataConfig, cp_size: int, vocab_size: int, steps: int, seed_offset: int = 0):
        multiple = config.pad_to_multiple_of or 2 * cp_size
        if multiple % (2 * cp_size):
            raise DataError(
                f"data.pad_to_multiple_of={multiple} is not a multiple of 2*cp={2 * cp_size}; every padded document "
                f"must split into 2*cp equal chunks: use a multiple of {2 * cp_size} or leave it null."
            )
        if config.pack_size % (2 * cp_size):
            raise DataError(
                f"data.pack_size={config.pack_size} is not a multiple of 2*cp={2 * cp_size}; context parallelism "
                f"splits every document into 2*cp chunks: use pack_size={-(-config.pack_size // (2 * cp_size)) * 2 * cp_size}."
            )
        self.packs_per_step = config.packs_per_step
        needed_tokens = steps * config.packs_per_step * config.pack_size
        documents = load_documents(config, num_docs=_documents_for(config, needed_tokens), seed_offset=seed_offset, vocab_size=vocab_size)
        self.pool = pack_documents(documents, config.pack_size, cp_size=cp_size, overlong="split", pad_to_multiple_of=multiple)
        if not self.pool:
            raise DataError(f"data source {config.task!r} produced no tokens; check data.path and data.task_options.")

    def step_packs(self, step: int) -> list[dict]:
        """The global packs of ``step``."""
        start = step * self.packs_per_step
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


def _documents_for(config: DataConfig, needed_tokens: int) -> int:
    """How many synthetic documents cover ``needed_tokens`` (files are read whole)."""
    max_len = config.task_options.get("max_len", 512)
    min_len = config.task_options.get("min_len", 128)
    return max(8, int(needed_tokens / ((max_len + min_len) / 2) * 1.1) + 1)
