"""Documents with nothing to learn: skipped with one counted notice, or refused when all are.

``{"text": ""}``, an empty completion or an assistant turn with empty content become documents
whose trained tokens are special tokens only (BOS, EOS, padding; whitespace around them): training on them teaches the
model to end documents at once. A file task's documents are filtered here: some empty ones are
skipped with one notice naming how many and the first; a source where every document is empty
is refused (there is nothing to train on).
"""

from __future__ import annotations

import warnings

from hybridpar.config_rules import Notice, quoted
from hybridpar.data.packing import IGNORE_INDEX

__all__ = ["special_ids", "has_content", "drop_empty"]


def special_ids(tokenizer) -> set[int]:
    """The ids of ``tokenizer``'s special tokens (its bos/eos/pad and, for a pretrained one, every other)."""
    ids = {getattr(tokenizer, name, None) for name in ("bos_id", "eos_id", "pad_id")}
    hf = getattr(tokenizer, "hf", None)
    ids |= set(getattr(hf, "all_special_ids", None) or ())
    return {i for i in ids if isinstance(i, int)}


SHORT = 16  # trained tokens up to which a document is decoded to see whether it is only whitespace


def has_content(document, specials: set[int], tokenizer=None) -> bool:
    """Whether ``document`` (ids, or ``{"input_ids", "labels"}``) trains on a token that is not special
    and, with ``tokenizer``, on text that is not whitespace alone (a chat template's newline after
    an empty assistant turn is not content)."""
    trained = document["labels"] if isinstance(document, dict) else document
    words = [int(i) for i in trained if int(i) != IGNORE_INDEX and int(i) not in specials]
    if not words or tokenizer is None or len(words) > SHORT:
        return bool(words)
    return bool(tokenizer.decode(words).strip())


def drop_empty(documents: list, tokenizer, task: str, path) -> list:
    """``documents`` without the empty ones (module docstring); ValueError if none is left."""
    specials = special_ids(tokenizer)
    empty = [i for i, document in enumerate(documents) if not has_content(document, specials, tokenizer)]
    if not empty:
        return documents
    what = {"prompt_completion": "an empty completion", "chat": "no assistant text", "hf_dataset": "no text"}.get(task, "empty text")
    if len(empty) == len(documents):
        raise ValueError(f"every one of the {len(documents)} documents of data.path={quoted(str(path))} (task "
                         f"{quoted(task)}) has {what}: it would train on special tokens only; fill the records (or "
                         "check data.task_options' field names).")
    warnings.warn(f"data.path={quoted(str(path))}: {len(empty)} of {len(documents)} documents (task {quoted(task)}) "
                  f"have {what} (special tokens only; the first is document {empty[0] + 1}) and are skipped.",
                  Notice, stacklevel=2)
    skip = set(empty)
    return [document for i, document in enumerate(documents) if i not in skip]
