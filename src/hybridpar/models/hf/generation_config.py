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
from pathlib import Path

from hybridpar.config_rules import quoted, shorten
from hybridpar.strict_json import DuplicateKeyError, FileRefused, load_file

__all__ = ["GENERATION_FILE", "TOKEN_ID_FIELDS", "vocab_of", "check_generation_config", "generation_id_problem",
           "check_generation_ids", "config_vocab_problem", "config_id_problem",
           "config_ids_problem"]

GENERATION_FILE = "generation_config.json"
TOKEN_ID_FIELDS = ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id")


def vocab_of(hf: dict) -> int | None:
    """``config.json``'s vocabulary size (its ``text_config``'s for a multimodal config), or None."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    vocab = hf.get("vocab_size", text.get("vocab_size"))
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "max_position_embeddings", "n_positions", "n_embd", "n_layer", "n_head", "intermediate_size",
               # Mamba2 / Bamba / NemotronH mixers (a zero here divided by zero in transformers' mixer)
               "num_heads", "n_groups", "chunk_size", "conv_kernel", "state_size", "ssm_state_size", "mamba_n_heads",
               "mamba_d_head", "mamba_n_groups", "mamba_chunk_size", "mamba_d_conv", "mamba_d_state", "mamba_num_heads",
               "mamba_head_dim",
               # Jamba / Falcon-H1, Kimi Linear (KDA and MLA), RecurrentGemma (a zero was torch's "groups must be a
               # positive integer", or passed --dry-run and built empty layers)
               "mamba_expand", "mamba_dt_rank", "time_step_rank", "mamba_d_ssm", "linear_num_heads", "linear_head_dim",
               "linear_conv_kernel_dim", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
               "v_head_dim", "lru_width", "attention_window_size", "conv1d_width", "sliding_window")
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")  # a MoE layer's experts, by family
AUTO_FIELDS = ("mamba_dt_rank", "time_step_rank")  # "auto": transformers derives it from hidden_size
POSITIVE_FIELDS = ("rope_theta", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps",
                   # softcaps and logit/residual scales (Gemma2, RecurrentGemma, Granite, Falcon-H1): a zero divided
                   # by zero (a ZeroDivisionError), or scaled a path to nothing, NaN in or silently wrong
                   "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "logits_soft_cap",
                   "logits_scaling", "attention_multiplier", "embedding_multiplier", "residual_multiplier",
                   "lm_head_multiplier", "attention_in_multiplier", "attention_out_multiplier", "key_multiplier",
                   "ssm_in_multiplier", "ssm_out_multiplier", "mlp_multipliers", "ssm_multipliers")


def config_vocab_problem(hf: dict, file) -> str | None:
    """The problem of a size in ``config.json`` (its own or its ``text_config``'s): a count in
    ``SIZE_FIELDS`` that is not an integer >= 1 (transformers builds zero rows, no layers, or divides
    by it), or a ``POSITIVE_FIELDS`` value (RoPE base, norm epsilon) that is not a finite number > 0
    (a RoPE base of 0 makes every frequency inf: NaN losses); None when all are (or are absent/null)."""
    import math

    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    for where, fields in (("", hf), ("text_config.", text), ("rope_parameters.", rope)):
        for name in SIZE_FIELDS:
            value = fields.get(name)
            if value is None or (value == "auto" and name in AUTO_FIELDS):
                continue
            per_layer = isinstance(value, list) and value  # Gemma 3n: intermediate_size, one per layer
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (value if per_layer else [value])):
                rule = "each entry an integer >= 1" if per_layer else "an integer >= 1"
                return (f"{file}: {where}{name}={quoted(value)} must be {rule}; restore the checkpoint's "
                        "config.json.")
        experts = next((fields[n] for n in EXPERT_FIELDS if isinstance(fields.get(n), int) and fields[n] > 0), 0)
        top_k = fields.get("num_experts_per_tok")  # more than the experts: torch.topk's "selected index k out of range"
        if experts and isinstance(top_k, int) and not isinstance(top_k, bool) and not 1 <= top_k <= experts:
            return (f"{file}: {where}num_experts_per_tok={top_k} must be in [1, {experts}] (a token is routed to at most "
                    "every expert of the layer); restore the checkpoint's config.json.")
        for name in POSITIVE_FIELDS:
            value = fields.get(name)
            if value is not None and any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                         or v <= 0 for v in (value if isinstance(value, list) else [value])):
                rule = "each entry a finite number > 0" if isinstance(value, list) else "a finite number > 0"
                return (f"{file}: {where}{name}={quoted(value)} must be {rule}; restore the checkpoint's config.json.")
    return None


def config_id_problem(hf: dict, file) -> str | None:
    """The problem of a token id in ``config.json`` itself (``TOKEN_ID_FIELDS``) outside the
    vocabulary, or None: transformers takes its generation ids from there when the checkpoint has no
    ``generation_config.json`` (and otherwise only logs)."""
    vocab = vocab_of(hf)
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    for where, fields in (("", hf), ("text_config.", text)):
        for field in TOKEN_ID_FIELDS:
            value = fields.get(field)
            ids = value if isinstance(value, list) and field == "eos_token_id" else [value]
            if value is not None and (not ids or any(_bad_id(i, vocab) for i in ids)):
                rule = f"an integer in [0, {vocab})" if vocab is not None else "an integer >= 0"
                return shorten(f"{file}: {where}{field}={quoted(value)} must be {rule}, the vocabulary: a token the model "
                               "never produces (generation would not stop or pad with it); fix it in config.json or "
                               f"set it in a {GENERATION_FILE}", 500)
    return None


def _vocab_in(directory: str | Path) -> int | None | bool:
    """``config.json``'s vocabulary size (None: not given), or False when it cannot be read (its
    loader's error names it)."""
    try:
        hf = load_file(Path(directory) / "config.json")
    except (OSError, ValueError, RecursionError):
        return False
    return vocab_of(hf) if isinstance(hf, dict) else False


def generation_id_problem(directory: str | Path) -> str | None:
    """The one-line problem of ``directory``'s generation token ids, or None (also when the file
    itself cannot be read: ``read_hf_config`` refuses that)."""
    vocab = _vocab_in(directory)
    if vocab is False:
        return None
    try:
        check_generation_config(directory, vocab, check_ids=False)
    except ValueError:
        return None
    try:
        check_generation_config(directory, vocab)
    except ValueError as error:
        return str(error)
    return config_ids_problem(directory)


def config_ids_problem(directory: str | Path) -> str | None:
    """``config_id_problem`` of ``directory``'s config.json when it has no generation_config.json."""
    if (Path(directory) / GENERATION_FILE).is_file():
        return None  # transformers reads the ids there (checked above)
    try:
        hf = load_file(Path(directory) / "config.json")
    except (OSError, ValueError, RecursionError):
        return None
    return config_id_problem(hf, Path(directory) / "config.json") if isinstance(hf, dict) else None


def check_generation_ids(directory: str | Path) -> None:
    """``generate``, before the model loads: the file and its token ids (``check_generation_config``)."""
    vocab = _vocab_in(directory)
    if vocab is not False:
        check_generation_config(directory, vocab)


def _bad_id(value, vocab_size: int | None) -> bool:
    if isinstance(value, bool) or not isinstance(value, int):
        return True
    return value < 0 or (vocab_size is not None and value >= vocab_size)


def check_generation_config(directory: str | Path, vocab_size: int | None, check_ids: bool = True) -> None:
    """ValueError (one line) when ``directory/generation_config.json`` exists but is not a JSON
    object, or names a token id (``TOKEN_ID_FIELDS``; ``eos_token_id`` may be a list) that is not
    an integer in ``[0, vocab_size)`` (``check_ids=False``: the JSON alone; training says the ids
    in one notice, ``train/preflight``: small test models often keep a default id outside their
    vocabulary). A missing file is fine (transformers' defaults)."""
    file = Path(directory) / GENERATION_FILE
    if not file.exists():  # a FIFO or a link to a device is there: load_file refuses it
        return
    fix = f"fix or delete {file} (transformers then uses the model config's ids)."
    try:
        config = load_file(file)
    except (DuplicateKeyError, FileRefused):
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        where = f" at line {error.lineno}, column {error.colno}" if isinstance(error, json.JSONDecodeError) else ""
        raise ValueError(shorten(f"{file} is not valid JSON{where} ({getattr(error, 'msg', error)}): transformers "
                                 f"would ignore it and generation would not stop at its end token; {fix}", 500)) from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} holds a JSON {type(config).__name__}, not an object of generation fields; {fix}")
    for field in TOKEN_ID_FIELDS if check_ids else ():
        value = config.get(field)
        if value is None:
            continue
        ids = value if isinstance(value, list) and field == "eos_token_id" else [value]
        bad = [i for i in ids if _bad_id(i, vocab_size)]
        if bad or not ids:
            rule = f"an integer in [0, {vocab_size})" if vocab_size is not None else "an integer >= 0"
            raise ValueError(shorten(
                f"{file}: {field}={quoted(value)} must be {rule}{' (or a list of them)' if field == 'eos_token_id' else ''}"
                f"{f', the vocabulary of config.json' if vocab_size is not None else ''}: a token the model never "
                f"produces, so generation would not stop or pad with it; {fix}", 500))
