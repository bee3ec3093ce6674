"""A checkpoint's ``generation_config.json`` read strictly.

transformers reads ``generation_config.json`` for the end, padding and start token ids that
``generate`` stops on and pads with, and ignores a file it cannot parse (with a log line held
back), so a damaged file, or an ``eos_token_id`` outside the vocabulary, made generation run to
``--max-new-tokens`` without a word. Here a file that is not JSON is refused in one line naming
the file; an id outside the vocabulary is refused by ``generate`` and said in one notice by
``train`` (whose export would carry it).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from hybridpar.config_rules import Notice, quoted, shorten
from hybridpar.strict_json import DuplicateKeyError, load_file

__all__ = ["GENERATION_FILE", "TOKEN_ID_FIELDS", "vocab_of", "check_generation_config", "check_generation_ids"]

GENERATION_FILE = "generation_config.json"
TOKEN_ID_FIELDS = ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id")


def vocab_of(hf: dict) -> int | None:
    """``config.json``'s vocabulary size (its ``text_config``'s for a multimodal config), or None."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    vocab = hf.get("vocab_size", text.get("vocab_size"))
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def check_generation_ids(directory: str | Path) -> None:
    """``check_generation_config`` for ``generate``, before the model loads: every id refused (a
    ``config.json`` that cannot be read is left to the loader, whose error names it)."""
    try:
        hf = load_file(Path(directory) / "config.json")
    except (OSError, ValueError, RecursionError):
        return
    check_generation_config(directory, vocab_of(hf) if isinstance(hf, dict) else None)


def _bad_id(value, vocab_size: int | None) -> bool:
    if isinstance(value, bool) or not isinstance(value, int):
        return True
    return value < 0 or (vocab_size is not None and value >= vocab_size)


def check_generation_config(directory: str | Path, vocab_size: int | None, refuse_ids: bool = True) -> None:
    """ValueError (one line) when ``directory/generation_config.json`` exists but is not a JSON
    object, or names a token id (``TOKEN_ID_FIELDS``; ``eos_token_id`` may be a list) that is not
    an integer in ``[0, vocab_size)``; ``refuse_ids=False`` (training: the ids are not used, and
    small test models often keep a default id outside their vocabulary) says the latter in one
    notice instead. A missing file is fine (transformers' defaults)."""
    file = Path(directory) / GENERATION_FILE
    if not file.is_file():
        return
    fix = f"fix or delete {file} (transformers then uses the model config's ids)."
    try:
        config = load_file(file)
    except DuplicateKeyError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        where = f" at line {error.lineno}, column {error.colno}" if isinstance(error, json.JSONDecodeError) else ""
        raise ValueError(shorten(f"{file} is not valid JSON{where} ({getattr(error, 'msg', error)}): transformers "
                                 f"would ignore it and generation would not stop at its end token; {fix}", 500)) from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} holds a JSON {type(config).__name__}, not an object of generation fields; {fix}")
    for field in TOKEN_ID_FIELDS:
        value = config.get(field)
        if value is None:
            continue
        ids = value if isinstance(value, list) and field == "eos_token_id" else [value]
        bad = [i for i in ids if _bad_id(i, vocab_size)]
        if bad or not ids:
            rule = f"an integer in [0, {vocab_size})" if vocab_size is not None else "an integer >= 0"
            message = shorten(
                f"{file}: {field}={quoted(value)} must be {rule}{' (or a list of them)' if field == 'eos_token_id' else ''}"
                f"{f', the vocabulary of config.json' if vocab_size is not None else ''}: a token the model never "
                f"produces, so generation would not stop or pad with it; {fix}", 500)
            if refuse_ids:
                raise ValueError(message)
            warnings.warn(message, Notice, stacklevel=2)
            return
