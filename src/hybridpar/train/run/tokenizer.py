"""``data.tokenizer: bpe``: a byte-level BPE trained for the run, once, on its training documents.

    <output_dir>/tokenizer/        a transformers tokenizer directory (``train_bpe_tokenizer``)
        hybridpar_bpe.json         what it was trained for: vocabulary, corpus, training files' sha256

``prepare_data(config, vocab_size)`` returns ``config.data`` with ``bpe`` replaced by that
directory, training it first when it is absent (into a temporary directory renamed into
place, so a half-written tokenizer is never loaded). The vocabulary is the model's
``vocab_size``; only the training files are read (never the held-out ones). The launcher
does this before any worker starts; a worker started otherwise (a user's torchrun) gets the
directory from rank 0 (``shared_data``), which trains it if needed.

The directory belongs to ``output_dir`` (every run there, ``run-NNN`` subdirectories
included, and every resume use it), and it is never replaced: when the settings it records
differ from the run's (another vocabulary, corpus or option, or a changed standard library),
the run is refused naming the differences, because checkpoints in that directory were trained
with it. ``hybridpar generate --checkpoint`` and ``model.export_hf`` find it there too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

from hybridpar.config import ConfigError, DataConfig, RunConfig
from hybridpar.strict_json import load_file as load_json

__all__ = ["BPE", "STAMP", "MIN_BPE_VOCAB", "bpe_dir", "find_run_tokenizer", "prepare_data", "shared_data"]

BPE = "bpe"
STAMP = "hybridpar_bpe.json"
MIN_BPE_VOCAB = 512  # 256 byte symbols + 4 specials leave room for at least ~250 merges
BPE_TASKS = ("python_stdlib",)


def bpe_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "tokenizer"


def _refuse_bpe(config: RunConfig, vocab_size: int) -> None:
    """ConfigError for a combination a run-trained BPE cannot serve."""
    data = config.data
    if data.task not in BPE_TASKS:
        raise ConfigError(f"data.tokenizer=bpe trains a tokenizer on the training documents of data.task in "
                          f"{list(BPE_TASKS)}, but data.task={data.task!r}; for another file, train one with "
                          "hybridpar.data.tokenizers.train_bpe_tokenizer and set data.tokenizer to its directory "
                          "(synthetic tasks make their own ids: leave data.tokenizer=auto).")
    if config.model.hf_path:
        raise ConfigError(f"data.tokenizer=bpe with model.hf_path={config.model.hf_path!r}: the checkpoint's embedding "
                          "was trained with its own tokenizer, and a new BPE would give its ids other meanings; use "
                          "data.tokenizer=auto (the checkpoint's tokenizer), or train from a preset.")
    if vocab_size < MIN_BPE_VOCAB:
        raise ConfigError(f"data.tokenizer=bpe trains a vocabulary of the model's vocab_size={vocab_size}, less than "
                          f"{MIN_BPE_VOCAB} (256 byte symbols, 4 special tokens and room for merges); set e.g. "
                          "model.overrides.vocab_size=4096.")


def _stamp(config: RunConfig, vocab_size: int):
    """``(stamp, training texts)``: the settings the run's tokenizer must have been trained for."""
    from hybridpar.data.stdlib import check_stdlib_options, stdlib_corpus

    data = config.data
    try:
        options = check_stdlib_options(data.task_options)
        corpus = stdlib_corpus(data.path, **options)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    stamp = {"format": 1, "vocab_size": vocab_size, "task": data.task, "root": str(corpus.root.resolve()),
             "task_options": options, "train_files": len(corpus.train), "train_sha256": corpus.fingerprint()}
    return json.loads(json.dumps(stamp)), [f.text for f in corpus.train]


def prepare_data(config: RunConfig, vocab_size: int, say=print) -> DataConfig:
    """``config.data`` with ``data.tokenizer=bpe`` resolved to the run's tokenizer directory,
    trained there first if absent (module docstring); any other setting is returned as is."""
    data = config.data
    if data.tokenizer != BPE:
        return data
    _refuse_bpe(config, vocab_size)
    stamp, texts = _stamp(config, vocab_size)
    directory = bpe_dir(config.output_dir)
    resolved = dataclasses.replace(data, tokenizer=str(directory))
    if directory.exists():
        try:
            recorded = load_json(directory / STAMP)  # unreadable or a key twice: counted as changed
        except (OSError, ValueError, RecursionError):
            recorded = {}
        changed = [f"{key} {json.dumps(recorded.get(key))} -> {json.dumps(stamp[key])}"
                   for key in stamp if key != "train_sha256" and recorded.get(key) != stamp[key]]
        if not changed and recorded.get("train_sha256") != stamp["train_sha256"]:
            changed = ["the training files' text (train_sha256) differs: the corpus changed"]
        if changed:
            raise ConfigError(f"{directory} holds the data.tokenizer=bpe tokenizer of output_dir "
                              f"{str(config.output_dir)!r}, trained for other settings ({'; '.join(changed)}; recorded "
                              "-> now), and runs there were trained with it; restore those settings, choose another "
                              f"output_dir, or delete {directory} (and the runs that used it) to train a new one.")
        return resolved
    from hybridpar.data.tokenizers import train_bpe_tokenizer

    started = time.perf_counter()
    staging = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        learned = train_bpe_tokenizer(texts, staging, vocab_size=vocab_size).vocab_size
    except ImportError as error:
        raise ConfigError(f"data.tokenizer=bpe: {error}") from None
    (staging / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    staging.rename(directory)
    short = "" if learned >= vocab_size else (f" of the model's {vocab_size}: the files hold too few repeated pieces for "
                                              f"more merges, so {vocab_size - learned} embedding rows are never used")
    say(f"trained a byte-level BPE tokenizer (vocab {learned}{short}) on {len(texts)} files, "
        f"{sum(map(len, texts)) / 1e6:.1f} MB of {stamp['root']}, in {time.perf_counter() - started:.1f} s: {directory}")
    return resolved


def shared_data(config: RunConfig, vocab_size: int) -> DataConfig:
    """``prepare_data`` on rank 0, its result (or its error) on every rank: one broadcast."""
    import torch.distributed as dist

    if config.data.tokenizer != BPE or not dist.is_initialized() or dist.get_world_size() == 1:
        return prepare_data(config, vocab_size)
    outcome: list = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [prepare_data(config, vocab_size)]
        except ValueError as error:
            outcome = [error]
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def find_run_tokenizer(checkpoint: str | Path, recorded_output_dir: str | None = None) -> Path:
    """The ``data.tokenizer=bpe`` directory of the run a checkpoint (``<output_dir>[/run-NNN]/
    checkpoints/step_N``) belongs to."""
    checkpoint = Path(checkpoint).resolve()
    candidates = [bpe_dir(p) for p in checkpoint.parents[1:3]]
    if recorded_output_dir:
        candidates.append(bpe_dir(recorded_output_dir))
    candidates = list(dict.fromkeys(candidates))  # a run's own output_dir is also its recorded one
    for candidate in candidates:
        if (candidate / STAMP).is_file():
            return candidate
    raise ValueError(f"checkpoint {checkpoint} was trained with data.tokenizer=bpe, but its tokenizer is in none of "
                     f"{[str(c) for c in candidates]}; pass --tokenizer <the run's output_dir>/tokenizer.")
