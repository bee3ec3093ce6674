"""``train.sample``: after training, print a continuation of a prompt from the trained weights.

    train:
      sample: {prompt: "def ", max_new_tokens: 80, temperature: 0.8, top_p: 0.95, seed: 0}

Every rank gathers the full weights (one collective per parameter, as an export does); rank 0
loads them into a single-device copy of the model and continues the prompt with
``continue_prompt``, the code path of ``hybridpar generate``. So no generation is
distributed, the sample needs no checkpoint, and ``hybridpar generate --checkpoint
<output_dir>`` with the same settings prints the same text from the final checkpoint.
"""

from __future__ import annotations

import torch

from hybridpar.config_rules import SAMPLE_KEYS, SAMPLE_RULE_TEXT, sample_problem

__all__ = ["sample_settings", "check_sample", "check_sample_prompt", "continue_prompt", "print_sample"]


def sample_settings(raw: dict | None) -> dict | None:
    """The settings of ``train.sample`` over their defaults (ValueError if broken), or None."""
    if raw is None:
        return None
    problem = sample_problem(raw)
    if problem:
        raise ValueError(f"train.sample={raw!r} is invalid: {problem}; it must be {SAMPLE_RULE_TEXT}.")
    return {**SAMPLE_KEYS, **raw}


def check_sample(config) -> None:
    """ValueError for ``train.sample`` on a run that has no text tokenizer (a synthetic task)."""
    from hybridpar.data.documents import FILE_TASKS

    if config.train.sample is not None and config.data.task not in FILE_TASKS:
        raise ValueError(f"train.sample continues a text prompt, but data.task={config.data.task!r} makes synthetic "
                         "token ids with no tokenizer to encode it; use a file task (text, python_stdlib, ...) or set "
                         "train.sample=null.")


def check_sample_prompt(config, data, vocab_size: int, meta_model=None) -> None:
    """ValueError (one line) for a ``train.sample`` prompt the run's tokenizer refuses (a reserved
    control byte, no token at all), or (``meta_model``: the run's model on the meta device) a generation larger
    than the free memory: found before step 1, not after training. ``data``: the data config whose tokenizer
    the run uses (``prepare_data``'s)."""
    settings = sample_settings(config.train.sample)
    if settings is None:
        return
    from hybridpar.config_rules import quoted, shorten
    from hybridpar.train.batches import data_tokenizer
    from hybridpar.train.hf_model import model_backend

    tokenizer = data_tokenizer(data, vocab_size, config.model.hf_path)
    try:
        ids = tokenizer.document(settings["prompt"], add_eos=False)
    except ValueError as error:
        raise ValueError(shorten(f"train.sample's prompt {quoted(settings['prompt'], 60)} cannot be encoded by the run's "
                                 f"tokenizer ({str(error).rstrip('.')}); change the prompt (checked now, not after training).", 500)) from None
    if not ids:
        raise ValueError(f"train.sample's prompt {quoted(settings['prompt'], 60)} is no token for the run's tokenizer "
                         "(empty, and it adds no BOS); give a prompt with at least one character.")
    if meta_model is not None:  # the whole run trained, then the sample was refused for memory
        import torch

        from hybridpar.models.generation import check_generation_memory

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            check_generation_memory(meta_model, 1, len(ids), settings["max_new_tokens"], device=device)
        except ValueError as error:
            raise ValueError(f"train.sample: {str(error).rstrip('.')} (checked now, not after training).") from None
    table = _learned_positions(config)
    if config.model.hf_path and model_backend(config) == "transformers":
        from hybridpar.models.hf.positions import position_note
        from hybridpar.train.hf_model import hf_shape
        from hybridpar.train.run.metrics import notice

        from types import SimpleNamespace

        shape = SimpleNamespace(config=hf_shape(config.model.hf_path))  # position_note reads model.config only
        if note := position_note(shape, len(ids) + settings["max_new_tokens"]):
            notice(f"train.sample: {note}")
    if table and len(ids) + settings["max_new_tokens"] > table[1]:
        raise ValueError(f"train.sample's prompt ({len(ids)} tokens) plus max_new_tokens={settings['max_new_tokens']} "
                         f"needs {len(ids) + settings['max_new_tokens']} positions, but the model learned {table[1]} "
                         f"({table[0]}); ask for at most {max(0, table[1] - len(ids))} new tokens (checked now, not "
                         "after training).")


def _learned_positions(config) -> tuple[str, int] | None:
    """``(module, positions)`` of the learned position table of a transformers ``model.hf_path`` (GPT-2's
    ``wpe``), from its meta model; None for HybridLM and computed positions (RoPE)."""
    from hybridpar.models.hf.positions import learned_positions
    from hybridpar.train.hf_model import hf_meta_model, hf_shape, model_backend

    if not config.model.hf_path or model_backend(config) != "transformers":
        return None
    return learned_positions(hf_meta_model(hf_shape(config.model.hf_path)))


def print_sample(model, tokenizer, settings: dict) -> str:
    """Continue ``settings["prompt"]`` with ``model`` (single-device, trained weights) and print
    ``sample: <prompt><continuation>``; returns the continuation."""
    model.eval()
    with torch.no_grad():
        _, new_ids, completion = continue_prompt(model, tokenizer, settings["prompt"], settings["max_new_tokens"],
                                                 settings["temperature"], settings["top_p"], settings["seed"])
    how = "greedy" if settings["temperature"] == 0 else \
        f"temperature {settings['temperature']:g}, top_p {settings['top_p']:g}, seed {settings['seed']}"
    print(f"sample ({len(new_ids)} tokens, {how}):\n{settings['prompt']}{completion}", flush=True)
    return completion


def continue_prompt(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                    seed: int | None = None) -> tuple[list[int], list[int], str]:
    """``(prompt ids, new ids, decoded continuation)``: the prompt is a document without its end
    token; a ``HybridLM`` stops at the tokenizer's end token, a transformers model at its
    generation config's."""
    import sys

    from hybridpar.models.generation import check_generation_memory, generation_bytes, transformers_generation_bytes
    from hybridpar.models.hf.causal_lm import generate_causal_lm
    from hybridpar.models.hf.positions import position_note
    from hybridpar.models.hybrid import HybridLM

    from hybridpar.config_rules import quoted, shorten

    try:
        prompt_ids = tokenizer.document(prompt, add_eos=False)
    except ValueError as error:  # e.g. a reserved control byte: its API advice (errors='drop') is no CLI fix
        why = str(error).split(";")[0].rstrip(".")
        raise ValueError(shorten(f"the prompt {quoted(prompt, 60)} cannot be encoded by tokenizer {tokenizer.name} "
                                 f"({why}); remove that character from the prompt.", 500)) from None
    if not prompt_ids:
        raise ValueError("the prompt is empty and the tokenizer adds no BOS: give the model at least one token.")
    # before any allocation: a huge prompt or token count is refused in one line
    check_generation_memory(model, 1, len(prompt_ids), max_new_tokens,
                            estimate=generation_bytes if isinstance(model, HybridLM) else transformers_generation_bytes)
    if note := position_note(model, len(prompt_ids) + max_new_tokens):
        print(f"hybridpar: warning: {note}.", file=sys.stderr, flush=True)
    eos = tokenizer.eos_id if isinstance(model, HybridLM) else None  # a transformers model: its generation config
    device = next(model.parameters()).device
    out = generate_causal_lm(model, torch.tensor([prompt_ids], device=device), max_new_tokens,
                             temperature=temperature, top_p=top_p, seed=seed, eos_token_id=eos)
    new_ids = out[0, len(prompt_ids):].tolist()
    return prompt_ids, new_ids, tokenizer.decode(new_ids)
