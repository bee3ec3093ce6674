"""Deterministic packed batches for training and evaluation.

Step ``k`` always receives the same packs, whatever the layout, the world size or
``train.steps``, so a resumed run (the data position is just the step), a run at another
layout and a run extended to more steps see the same tokens:

- a synthetic task draws documents from one seeded generator, in windows of a fixed
  number of documents (``WINDOW_PACKS`` packs' worth); each window is packed on its own
  and windows are appended as steps need them, so pack ``j`` depends only on the data
  settings, never on how many steps will run;
- a file is read and packed whole, and steps cycle over its packs. File tasks (text, jsonl,
  chat, prompt_completion, hf_dataset: ``data/documents.file_documents``; python_stdlib, a
  directory of Python files: ``data/stdlib.py``) read it through the tokenizer of
  ``data_tokenizer`` (``data.tokenizer`` against ``model.hf_path``; ``bpe`` is resolved to the
  run's trained tokenizer first: ``train/run/tokenizer.py``).

Packs are padded per document to ``pad_to_multiple_of`` (default ``2*cp``); a resumed run
keeps the padding its checkpoint recorded. Each data-parallel rank takes its share of a
step's packs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import warnings
from pathlib import Path

import numpy as np

from hybridpar.config_rules import Notice, bounded_message, did_you_mean, quoted
from hybridpar.config import DataConfig
from hybridpar.data.documents import FILE_TASKS, file_documents
from hybridpar.data.hf_datasets import HF_KINDS, hf_options_problem
from hybridpar.data.packing import pack_documents
from hybridpar.data.sources import TASKS, TEXT_SPLITS, _document_at
from hybridpar.data.stdlib import check_stdlib_options, stdlib_corpus, stdlib_root
from hybridpar.data.tokenizers import TOKENIZER_SPECS, ByteTokenizer, Tokenizer, resolve_tokenizer, ships_tokenizer


class DataError(ValueError):
    """A data setting that cannot produce batches, with the fix (one bounded line)."""

    def __init__(self, message="", *args):
        super().__init__(bounded_message(message), *args)


EVAL_FRACTION = 0.1  # of a file's documents, held out for evaluation
WINDOW_PACKS = 64  # synthetic documents are packed in windows of about this many packs
MAX_PACK_SIZE = 2**31 - 1  # cu_seqlens are int32


def pack_size_fix(pack_size: int, multiple: int) -> int:
    """The multiple of ``multiple`` nearest above ``pack_size``, or below it past ``MAX_PACK_SIZE``; a ValueError when
    ``multiple`` itself is past it (no pack size holds a padded document: was "use data.pack_size=0")."""
    if multiple > MAX_PACK_SIZE:
        raise DataError(f"the document padding {multiple} is more than the largest data.pack_size (2**31-1), so no pack "
                        "holds a document; use a smaller parallel.cp or data.pad_to_multiple_of (2*cp by default).")
    up = -(-pack_size // multiple) * multiple
    return up if up <= MAX_PACK_SIZE else pack_size // multiple * multiple


def sequence_parallel_pack_problem(pack_size: int, multiple: int, cp: int, tp: int) -> str | None:
    """Sequence parallelism splits each context-parallel rank's ``pack_size/cp`` tokens evenly over ``tp``: the
    rule of ``data.pack_size`` (it passed the launcher, ``--dry-run`` and ``plan``, then failed on every rank)."""
    if tp < 2 or pack_size % (cp * tp) == 0:
        return None
    fix = pack_size_fix(pack_size, math.lcm(multiple, cp * tp))
    return (f"data.pack_size={pack_size} gives {pack_size / cp:g} tokens per context-parallel rank (cp={cp}), which "
            f"parallel.sequence_parallel=true cannot split evenly over parallel.tp={tp}; use data.pack_size={fix} (a "
            f"multiple of cp*tp={cp * tp} and of the document padding {multiple}) or parallel.sequence_parallel=false.")


MAX_TASK_INT = 2**31 - 1  # every integer of a synthetic task's options (ids, lengths, counts)


def pad_multiple(config: DataConfig, cp_size: int) -> int:
    """The per-document padding multiple: ``data.pad_to_multiple_of`` or ``2*cp``."""
    return config.pad_to_multiple_of or 2 * cp_size


def _check_option_type(name: str, value, default) -> None:
    """DataError unless a synthetic task option has its default's kind: an integer (not a float or
    a boolean, which were truncated or read as 0/1), an integer or ``[low, high]`` for a range, an
    integer or null for an optional count, a string for a string."""
    def integer(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if isinstance(default, str):
        holds, rule = isinstance(value, str), "a string"
    elif isinstance(default, tuple):
        holds = integer(value) or (isinstance(value, (list, tuple)) and len(value) == 2 and all(map(integer, value)))
        rule = "an integer or a range [low, high] of two integers"
    else:
        holds = integer(value) or (default is None and value is None)
        rule = "an integer" + (" or null" if default is None else "")
    if not holds:
        raise DataError(f"data.task_options.{name}={quoted(value)} is invalid: it must be {rule}; e.g. "
                        f"data.task_options.{name}={quoted(list(default) if isinstance(default, tuple) else default)} "
                        "(the default).")


def make_task(config: DataConfig, vocab_size: int, seed_offset: int = 0):
    """The synthetic task of ``data.task`` with ``data.task_options``; DataError names the option."""
    allowed = {f.name: f.default for f in dataclasses.fields(TASKS[config.task]) if f.name != "seed"}
    unknown = sorted(set(config.task_options) - set(allowed))
    if unknown:
        seed = " (the seed is data.seed)" if "seed" in unknown else ""
        raise DataError(f"data.task_options {unknown} do not apply to data.task={quoted(config.task)}{seed}"
                        f"; its options are {allowed} (shown with their defaults); remove the others"
                        f"{did_you_mean(unknown[0], allowed, end='.')}")
    for name, value in config.task_options.items():
        _check_option_type(name, value, allowed[name])
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= MAX_TASK_INT for v in values):
            raise DataError(f"data.task_options.{name}={quoted(value)} is invalid: its integers must be in [0, 2**31-1] "
                            f"(token ids and document lengths); e.g. data.task_options.{name}={quoted(allowed[name])} "
                            "(the default).")
    options = {"vocab_size": vocab_size, **config.task_options, "seed": config.seed + seed_offset}
    try:
        task = TASKS[config.task](**options)
    except (TypeError, ValueError, IndexError, KeyError) as error:
        raise DataError(f"data.task_options={quoted(config.task_options)} do not fit data.task={quoted(config.task)}: {error}") from None
    if task.vocab_size > vocab_size:
        raise DataError(f"data.task_options.vocab_size={task.vocab_size} is larger than the model's vocabulary "
                        f"({vocab_size}), so token ids would not exist; use data.task_options.vocab_size <= {vocab_size} "
                        "or a model with a larger vocab_size.")
    return task


def data_tokenizer(config: DataConfig, vocab_size: int, model_path: str | None = None) -> Tokenizer:
    """The tokenizer of a file task: ``data.tokenizer`` resolved against ``model.hf_path``
    (``data/tokenizers.resolve_tokenizer``: ``auto`` is the checkpoint's own tokenizer when it ships
    one, so fine-tuning never silently trains on byte ids) and checked against the embedding."""
    spec = config.tokenizer
    if spec == "bpe":
        raise DataError("data.tokenizer='bpe' is the tokenizer trained for the run in <output_dir>/tokenizer; resolve "
                        "it first with hybridpar.train.run.tokenizer.prepare_data(config, vocab_size), as "
                        "hybridpar train does.")
    if spec not in TOKENIZER_SPECS and not Path(spec).is_dir():
        raise DataError(f"data.tokenizer={quoted(spec)} is neither 'auto', 'bytes' nor an existing directory; pass one of "
                        f"{list(TOKENIZER_SPECS)} or the directory of a saved tokenizer (tokenizer.json, ...).")
    if spec == "bytes" or (spec == "auto" and not ships_tokenizer(model_path)):
        if vocab_size < ByteTokenizer.vocab_size:
            raise DataError(f"data.task={quoted(config.task)} reads bytes (ids 0-255) but the model's vocab_size is "
                            f"{vocab_size}; use a model with vocab_size >= 256 or a tokenizer that fits "
                            "(data.tokenizer=<directory>).")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # asking for bytes next to a shipped tokenizer is explicit here
            tokenizer = resolve_tokenizer(spec, model_path=model_path, vocab_size=vocab_size)
    except ImportError as error:
        raise DataError(f"data.tokenizer={quoted(spec)}: {error}") from None
    except ValueError as error:
        raise DataError(f"data.tokenizer={quoted(spec)}: {error}") from None
    needs_template = config.task == "chat" or (config.task == "hf_dataset"
                                                and config.task_options.get("kind") == "messages")
    named = getattr(getattr(tokenizer, "hf", None), "chat_template", None)  # named templates: a dict, read as 'default'
    if needs_template and tokenizer.chat_template is None and isinstance(named, dict) and named:
        raise DataError(f"data.task={quoted(config.task)} renders conversations with the tokenizer's default chat template, "
                        f"but tokenizer {tokenizer.name} has only named ones ({quoted(sorted(named))}); write the one to "
                        "train with into its chat_template.jinja (or name it 'default').")
    if needs_template and tokenizer.chat_template is None:
        raise DataError(f"data.task={quoted(config.task)} renders conversations with the tokenizer's chat template, but "
                        f"tokenizer {tokenizer.name} has none; set data.tokenizer to a directory whose "
                        "tokenizer_config.json or chat_template.jinja defines one.")
    return tokenizer


def validate_data(config: DataConfig, vocab_size: int, model_path: str | None = None) -> Tokenizer | None:
    """Every data rule that needs no file contents (the launcher checks these before starting);
    returns the tokenizer of a file task (None for a synthetic one)."""
    if config.task in TASKS:
        if config.tokenizer != "auto":
            raise DataError(f"data.tokenizer={quoted(config.tokenizer)} has no effect on data.task={quoted(config.task)}, which "
                            "makes its own token ids; leave data.tokenizer=auto (or use a file task).")
        if config.path is not None:  # the file would be silently ignored: the run would train on synthetic data
            raise DataError(f"data.path={quoted(config.path)} is not read by data.task={quoted(config.task)}, which makes "
                            f"its own documents; set data.task to the file's task ({', '.join(FILE_TASKS)}) or "
                            "data.path=null.")
        make_task(config, vocab_size)
        return None
    if config.task not in FILE_TASKS:
        raise DataError(f"data.task={quoted(config.task)} is unknown; choose one of {sorted(TASKS) + sorted(FILE_TASKS)}.")
    allowed = FILE_TASKS[config.task]
    unknown = sorted(set(config.task_options) - set(allowed))
    if unknown:
        raise DataError(f"data.task_options {unknown} do not apply to data.task={quoted(config.task)}"
                        f"; its options are {allowed} (shown with their defaults); clear the others with "
                        f"data.task_options={{}}{did_you_mean(unknown[0], allowed, end='.')}")
    names = [] if config.task in ("text", "python_stdlib") else list(allowed)  # options that name a field or column
    for name in names:
        value = config.task_options.get(name, allowed[name])
        if not (isinstance(value, str) and value.strip()) and not (value is None and allowed[name] is None):
            raise DataError(f"data.task_options.{name}={quoted(value)} is invalid: it must be a non-empty string (a "
                            f"{'name' if name in ('kind', 'split', 'builder') else 'field or column name'})"
                            f"{' or null' if allowed[name] is None else ''}; e.g. data.task_options.{name}="
                            f"{quoted(allowed[name] or {'builder': 'csv'}.get(name, 'text'))}.")
    pair = [config.task_options.get(name, allowed.get(name)) for name in ("prompt_field", "completion_field")]
    kind = config.task_options.get("kind", "prompt_completion")  # hf_dataset's; prompt_completion has none
    if "prompt_field" in allowed and kind == "prompt_completion" and pair[0] == pair[1]:  # a prompt as its completion
        raise DataError(f"data.task_options.prompt_field and completion_field both name {quoted(pair[0])}: the prompt "
                        "would be trained on as its own completion; name the completion's field in completion_field.")
    if config.task == "hf_dataset" and config.task_options.get("kind", "text") not in HF_KINDS:
        raise DataError(f"data.task_options.kind={quoted(config.task_options['kind'])} is invalid: it must be one of "
                        f"{sorted(HF_KINDS)} (what each row holds); e.g. data.task_options.kind='text' (the default).")
    split = config.task_options.get("split", "paragraph")
    if config.task == "text" and split not in TEXT_SPLITS:
        raise DataError(f"data.task_options.split={quoted(split)} is invalid: it must be one of {list(TEXT_SPLITS)} "
                        "(paragraph: documents separated by blank lines, line: one per line, file: the whole file).")
    if config.task == "python_stdlib":
        try:
            check_stdlib_options(config.task_options)
            stdlib_root(config.path)
        except ValueError as error:
            raise DataError(str(error)) from None
    elif config.task == "hf_dataset":
        if not config.path or not Path(config.path).exists():
            raise DataError(f"data.path={quoted(config.path) + ' does not exist' if config.path else 'null names no file'}"
                            "; data.task='hf_dataset' needs a local data file or a save_to_disk directory.")
        if importlib.util.find_spec("datasets") is None:
            raise DataError("data.task='hf_dataset' needs the optional 'datasets' package: pip install "
                            "'hybridpar[data]'; plain text and JSONL files work without it (tasks text, jsonl, chat).")
        if problem := hf_options_problem(**config.task_options):
            raise DataError(f"data.task_options: {problem}")
    elif not config.path or not Path(config.path).is_file():
        raise DataError(f"data.path={quoted(config.path) + ' is not a file' if config.path else 'null names no file'}; data.task={quoted(config.task)} needs an existing local file.")
    return data_tokenizer(config, vocab_size, model_path)


def load_documents(config: DataConfig, num_docs: int, seed_offset: int, vocab_size: int,
                   tokenizer: Tokenizer | None = None) -> list:
    """Documents of the configured task or file; ``seed_offset`` separates train from eval.

    Synthetic tasks give their first ``num_docs`` documents (eval from another seed); a
    file keeps its last 10% of documents (at least one) for evaluation. ``tokenizer``: a file
    task's tokenizer (default: ``data.tokenizer`` resolved without a model directory).
    """
    if config.task in TASKS:
        validate_data(config, vocab_size)
        task = make_task(config, vocab_size, seed_offset)
        return task.documents(num_docs)
    if tokenizer is None:
        tokenizer = validate_data(config, vocab_size)
    if config.task == "python_stdlib":
        return _stdlib_documents(config, tokenizer, held_out=bool(seed_offset))
    docs = file_documents(config.task, config.path, tokenizer, config.task_options)
    held_out = max(1, int(len(docs) * EVAL_FRACTION)) if len(docs) > 1 else 0
    if seed_offset and not held_out:
        how = (f"under data.task_options.split={config.task_options.get('split', 'paragraph')!r}"
               if config.task == "text" else "(one per record)")
        raise DataError(
            f"data.path={quoted(config.path)} holds {len(docs)} document(s) {how}; evaluation holds out the last 10% and "
            "needs at least 2. Add documents (text: separate them by blank lines, or use data.task_options.split=line "
            "for one per line), or set train.eval_every=0."
        )
    return docs[len(docs) - held_out:] if seed_offset else docs[:len(docs) - held_out] or docs


def _stdlib_documents(config: DataConfig, tokenizer: Tokenizer, held_out: bool) -> list:
    """The training or held-out files of ``python_stdlib`` (split by a hash of each path), one document each."""
    try:
        corpus = stdlib_corpus(config.path, **config.task_options)
        files = corpus.held_out if held_out else corpus.train
        if held_out and not files:
            raise ValueError(f"data.task='python_stdlib' holds out no file of {len(corpus.train)} under {corpus.root} "
                             f"(data.task_options.eval_fraction={config.task_options.get('eval_fraction', 0.1)}); "
                             "raise eval_fraction or max_bytes, or set train.eval_every=0.")
        return [_document_at(tokenizer, f.text, corpus.root / f.path, 1, None, None) for f in files]
    except ValueError as error:
        raise DataError(str(error)) from None


class PackStream:
    """The packs of step ``k`` (``packs_per_step`` of them), independent of how many steps run."""

    _warned = False  # the packer's split/drop notice is shown once per run (cli.main resets it: worker.process_state_kept)

    def __init__(self, config: DataConfig, cp_size: int, vocab_size: int, seed_offset: int = 0,
                 pad_to_multiple_of: int | None = None, tokenizer: Tokenizer | None = None,
                 one_per_row: bool = False):
        self.one_per_row = one_per_row  # one document per row (a model that cannot pack: train/packing_rule.py)
        self.multiple = pad_to_multiple_of or pad_multiple(config, cp_size)
        if self.multiple % (2 * cp_size):
            raise DataError(
                f"data.pad_to_multiple_of={self.multiple} is not a multiple of 2*cp={2 * cp_size}; every padded document "
                f"must split into 2*cp equal chunks: use a multiple of {2 * cp_size} or leave it null."
            )
        if config.pack_size % self.multiple:
            raise DataError(
                f"data.pack_size={config.pack_size} is not a multiple of the document padding {self.multiple} ("
                f"{'data.pad_to_multiple_of' if config.pad_to_multiple_of else f'2*cp={2 * cp_size}'}); context "
                f"parallelism splits every document into 2*cp chunks: use pack_size={pack_size_fix(config.pack_size, self.multiple)}."
            )
        self.config, self.packs_per_step, self.pool, self.pack_notice = config, config.packs_per_step, [], None
        self._offset = 0  # global index of pool[0] (synthetic tasks)
        if config.task in TASKS:
            self._task = make_task(config, vocab_size, seed_offset)
            self._rng = np.random.default_rng(self._task.seed)
            mean_length = (self._task.min_len + self._task.max_len) / 2
            self._window = max(8, math.ceil(WINDOW_PACKS * config.pack_size / mean_length))
            self._extend()
        else:
            self._task = None
            self._pack(load_documents(config, 0, seed_offset, vocab_size, tokenizer))
        if not self.pool:
            where = f"data.path={quoted(config.path)} holds no document (it is empty or blank)" if self._task is None else \
                f"data.task={quoted(config.task)} produced no tokens"
            raise DataError(f"{where}; check data.path and data.task_options.")
        if self._task is None and not seed_offset and len(self.pool) < self.packs_per_step:  # eval: eval_repeat_note
            warnings.warn(f"data.path={quoted(config.path)} fills {len(self.pool)} pack(s) of data.pack_size="
                          f"{config.pack_size}, fewer than data.packs_per_step={self.packs_per_step}: every step trains "
                          "some packs (their documents) more than once, and some more often than others; use "
                          f"data.packs_per_step={len(self.pool)} or fewer (a multiple of the data-parallel size), a smaller "
                          "data.pack_size, or more data",
                          Notice, stacklevel=2)

    def _pack(self, documents: list) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.pool += pack_documents(documents, self.config.pack_size, overlong="split", pad_to_multiple_of=self.multiple,
                                       one_per_row=self.one_per_row)
        if caught and not PackStream._warned:  # once per run (train and eval streams, every window)
            PackStream._warned, self.pack_notice = True, str(caught[0].message)
            warnings.warn(self.pack_notice, Notice, stacklevel=3)  # one notice line

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


def missing_eos(config: DataConfig, tokenizer: Tokenizer | None) -> str | None:
    """A notice when a text task's tokenizer defines no EOS (e.g. its tokenizer_config.json is missing):
    every document then ends without an end token, and the model never learns to stop."""
    kind = config.task_options.get("kind", "text") if config.task == "hf_dataset" else config.task
    text_task = kind in ("text", "jsonl", "python_stdlib")  # chat: a template that ends turns with {{ eos_token }}
    chat = kind in ("chat", "messages") and "eos_token" in (getattr(tokenizer, "chat_template", None) or "")
    if not (text_task or chat) or tokenizer is None or tokenizer.eos_id is not None:
        return None
    return (f"data.tokenizer: tokenizer {tokenizer.name} defines no EOS token (is its tokenizer_config.json missing, "
            f"or does it name no eos_token?): {'the chat template ends each turn with eos_token, which renders as nothing: replies' if chat else 'documents'} "
            "are trained without an end token, so the model will not learn to stop; restore the tokenizer's files, or "
            "use one that defines an EOS token")


def eval_repeat_note(stream: PackStream) -> str | None:
    """A warning when ``train.eval_packs`` asks for more packs than the held-out documents of a file
    task fill: every evaluation cycles through them again (``eval_packs=100000`` on a small file ran
    for minutes, like a hang, for the loss of a few packs)."""
    have, want = len(stream.pool), stream.packs_per_step
    if stream._task is not None or want <= max(8, 2 * have):  # the default 8 is never said
        return None
    return (f"train.eval_packs={want} asks for {want} packs per evaluation, but the held-out documents fill {have}: each "
            f"evaluation goes through them about {want // have:,} times, taking that much longer for the same "
            f"documents; use train.eval_packs={have} (a multiple of the data-parallel size) or fewer")


def labelled_tokens(packs: list[dict]) -> int:
    """How many tokens of ``packs`` carry a label (-100 marks one that does not)."""
    return sum(int((np.asarray(pack["labels"]) != -100).sum()) for pack in packs)


def check_eval_labels(stream: PackStream, pack_size: int) -> None:
    """Refuse held-out packs without a labelled token (every evaluation reads the same ones): their mean loss and
    accuracy are over zero tokens, which was printed as ``eval_loss 0.0000 | eval_acc 0.000``."""
    if labelled_tokens(stream.step_packs(0)) == 0:
        raise DataError(f"the held-out packs of an evaluation (train.eval_packs={stream.packs_per_step}) hold no labelled "
                        f"token, so no eval loss or accuracy can be taken (a mean over zero tokens): documents longer than "
                        f"data.pack_size={pack_size} are split and a piece may hold none; raise train.eval_packs or "
                        "data.pack_size, or set train.eval_every=0.")
