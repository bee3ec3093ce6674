"""``hybridpar generate``: text from a trained model, in one process.

    hybridpar generate --hf-path runs/tuned --prompt "def add(" --max-new-tokens 64
    hybridpar generate --checkpoint runs/tiny-hybrid --prompt "k" --max-new-tokens 32 --temperature 0.8 --top-p 0.9 --seed 0

The model comes from

- ``--hf-path DIR``: a Hugging Face checkpoint directory (an export, or any causal LM), loaded
  as ``hybridpar train`` would load ``model.hf_path`` (``--backend auto|hybrid|transformers``):
  Mamba2 / Bamba / NemotronH as a ``HybridLM`` (cached generation, ``models/generation.py``),
  any other architecture as the transformers model with its own ``generate``;
- ``--hf-path ADAPTER``: a LoRA adapter in the PEFT format (``adapter_config.json``, e.g. a LoRA
  run's ``model.export_hf``): its base checkpoint with the adapter merged in;
- ``--checkpoint DIR``: a training checkpoint (of a LoRA run: the base rebuilt, the adapters loaded) (a ``step_*`` folder, or an ``output_dir`` or its
  ``checkpoints`` folder: the newest complete one), i.e. the model of the config recorded in its
  ``run.json`` with the checkpoint's weights; ``--base DIR`` says where its ``model.hf_path`` moved
  (it must hold the model the run recorded).

The tokenizer follows the training rules (``--tokenizer auto|bytes|DIR``; ``auto`` is the
checkpoint's own tokenizer when it ships one, for ``--checkpoint`` the run's ``data.tokenizer``;
``bpe``: the tokenizer trained for the run, in its ``output_dir/tokenizer``).
The prompt is a document without its end token (BOS as the tokenizer defines); generation
stops at the tokenizer's end token (a transformers model: its generation config's). Greedy at
``--temperature 0`` (the default), else nucleus sampling seeded by ``--seed``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch

__all__ = ["GENERATE_DTYPES", "load_for_generation", "checkpoint_to_load", "check_generate_arguments", "run_generate"]

GENERATE_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def checkpoint_to_load(path: str | Path) -> Path:
    """The ``step_*`` folder ``--checkpoint`` means: itself, or the newest complete one under it (a warning
    names each newer one skipped and why, as a resumed run prints it)."""
    from hybridpar.config_rules import not_a_directory, shorten
    from hybridpar.train.run.checkpoint import checkpoint_step, incomplete_reason, list_checkpoints, newest_complete

    path = Path(path)
    if not path.is_dir():
        what = not_a_directory(path)
        raise ValueError(f"--checkpoint {path} {what}; pass a training checkpoint (a step_* folder) or the output_dir "
                         "of a run that saved one (for a Hugging Face directory use --hf-path).")
    if (path / "run.json").is_file() or path.name.startswith("step_"):
        reason = incomplete_reason(path)
        if reason:
            raise ValueError(f"--checkpoint {path} is not a complete checkpoint: {reason}; pass a complete step_* "
                             "folder or the run's output_dir.")
        return path
    for folder in (path / "checkpoints", path):
        if not list_checkpoints(folder):
            continue
        chosen, skipped = newest_complete(folder)
        if chosen is None:
            newest, reason = next(iter(skipped.items()))
            raise ValueError(f"--checkpoint {path} holds no complete training checkpoint: none of its {len(skipped)} "
                             f"step_* folder(s) can be loaded (newest: {newest}: {shorten(reason, 300)}); restore one "
                             "from a copy, or pass another checkpoint.")
        for skip, why in skipped.items():
            print(f"hybridpar: warning: skipping checkpoint {skip}: {why}; generating from {chosen.name} (step "
                  f"{checkpoint_step(chosen)}), the newest complete one", file=sys.stderr, flush=True)
        return chosen
    raise ValueError(f"--checkpoint {path} holds no complete training checkpoint (step_* folder); pass one, or the "
                     "output_dir of a run that saved one (for a Hugging Face directory use --hf-path).")


def _model_from_checkpoint(path: Path, dtype: torch.dtype | None, base: str | None = None):
    """``(model, run config)``: the recorded config's single-device model with the checkpoint's weights
    (``base``: where the run's ``model.hf_path`` is now)."""
    import dataclasses

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from hybridpar.config import config_from_dict
    from hybridpar.config_rules import shorten
    from hybridpar.models.hf.weights import check_finite
    from hybridpar.parallel.state import canonical_state_dict, load_canonical_state_dict
    from hybridpar.parallel.tensor.hybrid import split_mamba_mixers
    from hybridpar.parallel.tensor.hf_plans.moe_hybrid import split_hf_mixers
    from hybridpar.train.peft import apply_peft
    from hybridpar.train.run.adapters import base_reference, check_same_base
    from hybridpar.train.run.checkpoint import load_failure, read_run_info
    from hybridpar.train.run.fused_resume import fused_legacy_names
    from hybridpar.train.trainer import build_model

    info = read_run_info(path)
    if not info.get("config"):
        raise ValueError(f"{path}/run.json records no run config; this checkpoint cannot say which model it holds.")
    config = _with_base(config_from_dict(info["config"]), path, info.get("model"), base)
    if dtype is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=str(dtype).removeprefix("torch.")))
    stored = apply_peft(config, build_model(config))  # a LoRA run: the frozen base is rebuilt, adapters loaded
    check_same_base(path, base_reference(config))
    split_mamba_mixers(stored)  # the parameter names training saves (layout-free), ours
    split_hf_mixers(stored)  # and transformers' Mamba2 mixers
    lora = config.peft.method != "none"
    state = {"model": {n: p for n, p in stored.named_parameters() if p.requires_grad} if lora else stored.state_dict()}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            with fused_legacy_names(state, path, stored):  # an older run's fused Mamba1 in_proj.weight
                dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        stored.load_state_dict(state["model"], strict=not lora)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - DCP raises many kinds; the message names the folder
        raise ValueError(f"--checkpoint {path} could not be loaded ({shorten(load_failure(error), 240)}); it "
                         "may be corrupt or from another model: pass another step_* folder.") from None
    model = apply_peft(config, build_model(config))
    load_canonical_state_dict(model, canonical_state_dict(stored))  # fused names again; every parameter set
    check_finite(model.named_parameters(), f"checkpoint {path}")
    return model.eval(), config


def _with_base(config, path: Path, recorded_model: dict | None, base: str | None):
    """The run config with its ``model.hf_path`` at ``base`` (``--base``: the folder moved). The base must
    build the model the run recorded: its weights come from the checkpoint, but its config.json says how
    they compute (a changed rope_theta would generate otherwise, silently)."""
    import dataclasses

    from hybridpar.config_rules import quoted
    from hybridpar.train.preflight import model_config
    from hybridpar.train.run.resume import changed_keys, model_signature

    hf_path = config.model.hf_path
    if base is not None and not hf_path:
        raise ValueError(f"--base {quoted(base)} is not used: checkpoint {path} is of a model.preset run (no "
                         "model.hf_path); leave --base out.")
    if base is None:
        if hf_path and not Path(hf_path).is_dir():
            raise ValueError(f"the run's model.hf_path {quoted(hf_path)} (recorded in {path}/run.json) is gone (moved "
                             "or deleted); pass --base DIR where that checkpoint directory is now.")
        return config
    if not Path(base).is_dir():
        raise ValueError(f"--base {quoted(base)} is not a directory; pass the folder the run's model.hf_path "
                         f"{quoted(hf_path)} moved to.")
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, hf_path=base))
    if recorded_model is not None:
        current = model_signature(model_config(config))
        if changed := changed_keys(recorded_model, current, skip=("dtype",)):
            raise ValueError(f"--base {quoted(base)} holds another model than checkpoint {path} was trained on ("
                             f"{', '.join(changed[:6])} differ); pass the folder the run's model.hf_path moved to.")
    return config


def _merged_adapter(adapter_dir: str) -> tuple[str, str]:
    """``(merged checkpoint in a temporary directory, the base's directory)`` of a PEFT adapter."""
    import atexit
    import shutil
    import tempfile

    from hybridpar.models.hf.lora_export import merge_adapter_checkpoint, read_peft_adapter

    scratch = tempfile.mkdtemp(prefix="hybridpar-lora-")
    atexit.register(shutil.rmtree, scratch, True)  # if the process ends first (load_for_generation removes it)
    try:
        merge_adapter_checkpoint(adapter_dir, scratch)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    base = read_peft_adapter(adapter_dir)[0].get("base_model_name_or_path")
    tokenizer_home = adapter_dir if any(Path(adapter_dir).glob("tokenizer*")) else base
    return scratch, tokenizer_home


def load_for_generation(hf_path: str | None = None, checkpoint: str | None = None, backend: str = "auto",
                        tokenizer: str = "auto", dtype: str | None = None, base: str | None = None):
    """``(model, tokenizer)`` for ``hybridpar generate`` (module docstring)."""
    from hybridpar.data.tokenizers import resolve_tokenizer
    from hybridpar.models.hf.causal_lm import load_causal_lm

    if (hf_path is None) == (checkpoint is None):
        raise ValueError("pass exactly one of --hf-path DIR (a Hugging Face checkpoint) or --checkpoint DIR (a "
                         "hybridpar training checkpoint).")
    from hybridpar.config_rules import quoted

    home = os.path.expanduser  # '~/...' quoted, or from a script, reaches us unexpanded
    hf_path, checkpoint, base = hf_path and home(hf_path), checkpoint and home(checkpoint), base and home(base)
    if base is not None and checkpoint is None:
        raise ValueError(BASE_WITHOUT_CHECKPOINT)
    tokenizer = home(tokenizer) if tokenizer.startswith("~") else tokenizer

    if dtype is not None and dtype not in GENERATE_DTYPES:
        raise ValueError(f"--dtype {quoted(dtype)} is unknown; choose one of {list(GENERATE_DTYPES)} (default: as "
                         "stored).")
    torch_dtype = GENERATE_DTYPES.get(dtype)
    if hf_path is not None:
        require_directory("--hf-path", hf_path)
        model_path, adapter = hf_path, None
        if (Path(hf_path) / "adapter_config.json").is_file():  # a LoRA adapter: its base with the adapter merged
            adapter, (hf_path, model_path) = hf_path, _merged_adapter(hf_path)
        from hybridpar.models.hf.generation_config import check_generation_ids, config_ids_problem

        try:
            check_generation_ids(hf_path)  # an end token the model can make (train only warns)
            if problem := config_ids_problem(hf_path):  # tiny test models keep default ids: said, not refused
                print(f"hybridpar: warning: {problem}; generation runs to --max-new-tokens.", file=sys.stderr, flush=True)
            model = load_causal_lm(hf_path, backend, dtype=torch_dtype).eval()
        except ValueError as error:  # name the adapter and its base, not the temporary folder they were merged into
            if adapter is None:
                raise
            raise ValueError(str(error).replace(hf_path, f"adapter {adapter!r} merged onto its base")) from None
        finally:  # loaded (or refused): the merged copy goes now, not at exit (each call from Python left one)
            if adapter is not None:
                import shutil

                shutil.rmtree(hf_path, ignore_errors=True)
    else:
        path = checkpoint_to_load(checkpoint)
        from hybridpar.train.run.checkpoint import read_run_info

        recorded = ((read_run_info(path).get("config") or {}).get("data") or {}).get("tokenizer", "auto")
        if tokenizer == "auto" and recorded not in ("auto", "bytes", "bpe") and not Path(str(recorded)).is_dir():
            raise ValueError(f"the run's data.tokenizer {quoted(recorded)} (recorded in {path}/run.json) is gone (moved "
                             "or deleted); pass --tokenizer DIR where it is now.")
        model, config = _model_from_checkpoint(path, torch_dtype, base)
        model_path = config.model.hf_path
        if tokenizer == "bpe" and config.data.tokenizer != "bpe":  # it names the run's trained one: there is none
            raise ValueError(f"--tokenizer bpe is the tokenizer a data.tokenizer=bpe run trains, but checkpoint {path} "
                             f"was trained with data.tokenizer={quoted(config.data.tokenizer)}; leave --tokenizer out "
                             "(auto: the run's own) or pass a tokenizer directory.")
        tokenizer = config.data.tokenizer if tokenizer == "auto" else tokenizer
        if tokenizer == "bpe":  # trained for the run, kept in its output_dir
            from hybridpar.train.run.tokenizer import find_run_tokenizer

            tokenizer = str(find_run_tokenizer(path, config.output_dir))
    return model, resolve_tokenizer(tokenizer, model_path=model_path, vocab_size=model.config.vocab_size)


BASE_WITHOUT_CHECKPOINT = ("--base is not used without --checkpoint: it says where a training checkpoint's "
                           "model.hf_path is now; with --hf-path, pass the folder itself.")
_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p", "seed": "--seed"}


def check_generate_arguments(args) -> None:
    """ValueError (one bounded line, naming the option) for any sampling option out of range
    (``models/generation.check_sampling``: a temperature below 1e-5 is greedy, inf or NaN is refused)."""
    import re

    from hybridpar.config_rules import shorten
    from hybridpar.models.generation import check_sampling

    if args.max_new_tokens == 0:  # the prompt alone would be printed as if it were the model's answer
        raise ValueError("--max-new-tokens 0 generates nothing (the prompt would be printed alone); pass "
                         "--max-new-tokens >= 1.")
    try:
        check_sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    except ValueError as error:
        message = re.sub(r"^(\w+)=(\S+) ", lambda m: f"{_FLAGS.get(m[1], m[1])} {m[2]} ", str(error))
        message = message.replace("in [0, 2**31-1]", "in [1, 2**31-1]")  # generate makes at least one token
        raise ValueError(shorten(message.replace("; change it in the generate call.", "."), 400)) from None
    from hybridpar.config_rules import not_utf8, path_problem, quoted

    for name in ("hf_path", "checkpoint", "base", "tokenizer", "prompt"):
        value = getattr(args, name, None)
        problem = value is not None and (not_utf8(value) if name == "prompt" else path_problem(value))
        if problem:
            raise ValueError(f"--{name.replace('_', '-')} {quoted(value)} is not usable: {problem}"
                             + ("; pass UTF-8 text." if name == "prompt" else "."))
    if getattr(args, "base", None) is not None and args.checkpoint is None:
        raise ValueError(BASE_WITHOUT_CHECKPOINT)
    if not isinstance(args.backend, str) or args.backend not in ("auto", "hybrid", "transformers"):
        raise ValueError(f"--backend {quoted(args.backend)} is unknown; choose one of auto, hybrid, transformers.")
    if args.dtype is not None and args.dtype not in GENERATE_DTYPES:
        raise ValueError(f"--dtype {quoted(args.dtype)} is unknown; choose one of {list(GENERATE_DTYPES)} (default: as "
                         "stored).")
    for note in unused_flags(args):
        print(f"hybridpar: warning: {note}", file=sys.stderr, flush=True)


def require_directory(flag: str, value: str) -> None:
    """ValueError unless ``value`` (given as ``flag``) is a directory: a Hugging Face checkpoint's folder."""
    from hybridpar.config_rules import quoted

    if not Path(value).is_dir():
        raise ValueError(f"{flag} {quoted(value)} is not a directory; pass a Hugging Face checkpoint directory "
                         "(config.json + model.safetensors), e.g. a run's model.export_hf.")


def check_generate_paths(args) -> None:
    """``--dry-run``: what the paths must be, checked as the model's load would, without loading it (a dry run
    called a missing --checkpoint or --tokenizer valid): --checkpoint holds a complete checkpoint (its files'
    hashes, skips said), --hf-path and --base are directories, --tokenizer is auto, bytes, bpe or a directory."""
    from hybridpar.config_rules import quoted

    if args.checkpoint is not None:
        checkpoint_to_load(Path(args.checkpoint).expanduser())
    for flag, value in (("--hf-path", args.hf_path), ("--base", getattr(args, "base", None))):
        if value is not None:
            require_directory(flag, os.path.expanduser(value))
    spec = args.tokenizer
    if spec not in ("auto", "bytes", "bpe") and not Path(spec).expanduser().is_dir():
        raise ValueError(f"--tokenizer {quoted(spec)} is neither 'auto', 'bytes', 'bpe' nor an existing directory; pass "
                         "one of those or the directory of a saved tokenizer.")


def unused_flags(args) -> list[str]:
    """A note for each flag given that this generate call does not read (so it changes nothing)."""
    from hybridpar.models.generation import GREEDY_BELOW

    notes, greedy = [], args.temperature < GREEDY_BELOW
    given = [flag for flag, unset in (("--seed", args.seed is None), ("--top-p", args.top_p == 1.0)) if not unset]
    if greedy and given:
        notes.append(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} not used: --temperature "
                     f"{args.temperature:g} is greedy (the most likely token each step); set --temperature > 0 to sample")
    if args.checkpoint is not None and args.backend != "auto":
        notes.append(f"--backend {args.backend} is not used: it chooses how --hf-path loads; a --checkpoint model is "
                     "built as it was trained")
    return notes


def run_generate(args) -> int:
    """The ``generate`` command: print the prompt and its continuation (``--json``: one JSON object)."""
    from hybridpar.train.sample import continue_prompt

    check_generate_arguments(args)
    model, tokenizer = load_for_generation(args.hf_path, args.checkpoint, args.backend, args.tokenizer, args.dtype,
                                           getattr(args, "base", None))
    if torch.cuda.is_available():
        model = model.cuda()
    prompt_ids, new_ids, completion = continue_prompt(model, tokenizer, args.prompt, args.max_new_tokens,
                                                      args.temperature, args.top_p, args.seed)
    if args.json:
        print(json.dumps({"prompt": args.prompt, "completion": completion, "prompt_ids": prompt_ids,
                          "new_ids": new_ids}), flush=True)
    else:
        print(args.prompt + completion, flush=True)
    return 0
