"""``train.sample``: after training, print a continuation of a prompt from the trained weights.

    train:
      sample: {prompt: "def ", max_new_tokens: 80, temperature: 0.8, top_p: 0.95, seed: 0}

Every rank gathers the full weights (one collective per parameter, as an export does); rank 0
loads them into a single-device copy of the model and continues the prompt with
``generate.continue_prompt``, the code path of ``hybridpar generate``. So no generation is
distributed, the sample needs no checkpoint, and ``hybridpar generate --checkpoint
<output_dir>`` with the same settings prints the same text from the final checkpoint.
"""

from __future__ import annotations

__all__ = ["SAMPLE_KEYS", "RULE_TEXT", "sample_problem", "sample_settings", "check_sample", "print_sample"]

SAMPLE_KEYS = {"prompt": None, "max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "seed": 0}  # prompt required
RULE_TEXT = ("null or a mapping with prompt (text, required), max_new_tokens (an integer >= 1, default 64), "
             "temperature (>= 0, default 0: greedy), top_p (in (0, 1], default 1) and seed (an integer >= 0, default 0)")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sample_problem(raw) -> str | None:
    """What is wrong with a ``train.sample`` mapping, or None."""
    if not isinstance(raw, dict):
        return f"a mapping, not a {type(raw).__name__}"
    unknown = sorted(set(raw) - set(SAMPLE_KEYS))
    if unknown:
        return f"unknown key(s) {unknown}"
    settings = {**SAMPLE_KEYS, **raw}
    rules = [
        (isinstance(settings["prompt"], str) and settings["prompt"] != "", "prompt must be a non-empty string"),
        (isinstance(settings["max_new_tokens"], int) and not isinstance(settings["max_new_tokens"], bool)
         and settings["max_new_tokens"] >= 1, "max_new_tokens must be an integer >= 1"),
        (_number(settings["temperature"]) and settings["temperature"] >= 0, "temperature must be >= 0"),
        (_number(settings["top_p"]) and 0 < settings["top_p"] <= 1, "top_p must be in (0, 1]"),
        (isinstance(settings["seed"], int) and not isinstance(settings["seed"], bool) and settings["seed"] >= 0,
         "seed must be an integer >= 0"),
    ]
    return next((message for holds, message in rules if not holds), None)


def sample_settings(raw: dict | None) -> dict | None:
    """The settings of ``train.sample`` over their defaults (ValueError if broken), or None."""
    if raw is None:
        return None
    problem = sample_problem(raw)
    if problem:
        raise ValueError(f"train.sample={raw!r} is invalid: {problem}; it must be {RULE_TEXT}.")
    return {**SAMPLE_KEYS, **raw}


def check_sample(config) -> None:
    """ValueError for ``train.sample`` on a run that has no text tokenizer (a synthetic task)."""
    from hybridpar.data.documents import FILE_TASKS

    if config.train.sample is not None and config.data.task not in FILE_TASKS:
        raise ValueError(f"train.sample continues a text prompt, but data.task={config.data.task!r} makes synthetic "
                         "token ids with no tokenizer to encode it; use a file task (text, python_stdlib, ...) or set "
                         "train.sample=null.")


def print_sample(model, tokenizer, settings: dict) -> str:
    """Continue ``settings["prompt"]`` with ``model`` (single-device, trained weights) and print
    ``sample: <prompt><continuation>``; returns the continuation."""
    import torch

    from hybridpar.generate import continue_prompt

    model.eval()
    with torch.no_grad():
        _, new_ids, completion = continue_prompt(model, tokenizer, settings["prompt"], settings["max_new_tokens"],
                                                 settings["temperature"], settings["top_p"], settings["seed"])
    how = "greedy" if settings["temperature"] == 0 else \
        f"temperature {settings['temperature']:g}, top_p {settings['top_p']:g}, seed {settings['seed']}"
    print(f"sample ({len(new_ids)} tokens, {how}):\n{settings['prompt']}{completion}", flush=True)
    return completion
