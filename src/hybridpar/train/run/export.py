"""The export of a finished run (``model.export_hf``): its target checked before training (a
representable architecture, a folder where nothing would be lost), then the gathered weights
written into a staging folder and renamed into place, so a failed export leaves nothing
half-written where the user looks. A failure to write (a full disk, a directory removed) is one
line saying where the trained weights still are.
"""

from __future__ import annotations

import glob
import os
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch.distributed as dist
from torch import nn

from hybridpar.config import ConfigError, RunConfig
from hybridpar.data.tokenizers import ships_tokenizer
from hybridpar.models.hf.causal_lm import export_causal_lm
from hybridpar.parallel.state import canonical_state_dict
from hybridpar.models.hf.lora_export import export_lora
from hybridpar.train.run.checkpoint import OutputWriteError, free_space
from hybridpar.train.run.metrics import notice

__all__ = ["validate_export", "export_architecture", "export_target_problem", "overlap_problem", "export_trained",
           "write_export", "remove_stale_staging"]

RUN_FOLDERS = ("checkpoints", "tensorboard", "tokenizer")  # what a run writes under output_dir


def _write_failure(error: Exception) -> bool:
    """An OSError, or safetensors' ``SafetensorError`` wrapping one ("I/O error: No space left ...")."""
    return isinstance(error, OSError) or "I/O error" in str(error)


def export_architecture(config: RunConfig) -> str | None:
    """The architecture ``model.export_hf`` is written as (ConfigError if there is none)."""
    if config.model.export_architecture or not config.model.export_hf:
        return config.model.export_architecture
    from hybridpar.train.hf_model import model_backend

    if model_backend(config) == "transformers":
        return None  # exported as its own class
    if config.model.hf_path:
        from hybridpar.models.hf.config import architecture_of, read_hf_config

        return architecture_of(read_hf_config(config.model.hf_path))
    from hybridpar.models.hf.config import ARCHITECTURES

    raise ConfigError(f"model.export_hf={config.model.export_hf!r} needs model.export_architecture (one of "
                      f"{list(ARCHITECTURES)}) for a model not loaded from model.hf_path.")


def export_target_problem(target: str | Path, source: str | None) -> str | None:
    """Why ``target`` cannot receive an export without destroying something, or None."""
    target = Path(target)
    if source and target.resolve() == Path(source).resolve():
        return "it is model.hf_path, the checkpoint being fine-tuned; exporting there would overwrite the original"
    if target.is_file():
        return "it is a file"
    if target.is_dir() and any(target.iterdir()):
        return "it is a directory that is not empty; hybridpar never writes into one"
    return None


def validate_export(config: RunConfig, shape) -> None:
    """``model.export_hf``: a representable architecture, a target that nothing would be lost in, and
    (LoRA unmerged) a base checkpoint the adapter can name."""
    if not config.model.export_hf:
        return
    from hybridpar.models.hybrid import HybridConfig

    if not isinstance(shape, HybridConfig) and config.model.export_architecture:
        raise ConfigError(f"model.export_architecture={config.model.export_architecture!r} applies to HybridLM models; "
                          f"a transformers model ({type(shape).__name__}) is exported as its own class: leave it null.")
    if config.peft.method == "lora" and not config.peft.merge and not config.model.hf_path:
        raise ConfigError(f"model.export_hf={config.model.export_hf!r} with peft.merge=false would write a LoRA adapter "
                          f"whose base (model.preset={config.model.preset!r}, random weights) is saved nowhere; set "
                          "peft.merge=true to export the merged model, or fine-tune a checkpoint named by model.hf_path.")
    architecture = export_architecture(config)
    from hybridpar.models.hf.config import config_to_hf

    if isinstance(shape, HybridConfig) and (not config.model.hf_path or config.model.export_architecture):
        try:
            config_to_hf(shape, architecture)
        except ValueError as error:
            raise ConfigError(f"model.export_architecture={architecture!r} cannot hold this model: {error}") from None
    from hybridpar.train.run.directory import inside_another_run

    problem = export_target_problem(config.model.export_hf, config.model.hf_path) or \
        overlap_problem(config.model.export_hf, config.output_dir) or inside_another_run(config.model.export_hf)
    if problem:
        raise ConfigError(f"model.export_hf={config.model.export_hf!r} cannot be written: {problem}; choose a new or "
                          "empty directory.")


def overlap_problem(target: str | Path, output_dir: str | Path) -> str | None:
    """Why export ``target`` would collide with the run's own ``output_dir`` (it is output_dir, holds it,
    or lies in a folder the run fills): found at start, not after training when it is no longer empty."""
    target, out = Path(target).resolve(), Path(output_dir).resolve()
    if target == out or out.is_relative_to(target):
        return f"it is or holds output_dir={str(output_dir)!r}, which the run fills before the export is written"
    inside = next((name for name in RUN_FOLDERS if target.is_relative_to(out / name)), None)
    return f"it lies in output_dir's {inside}/, which the run writes" if inside else None


def remove_stale_staging(target: Path) -> list[Path]:
    """Remove the staging folders of ``target`` whose process is gone (an export killed with SIGKILL
    leaves ``.<name>.tmp-<pid>`` behind); a live process's folder is left alone. Returns the removed."""
    removed = []
    for folder in target.parent.glob(f".{glob.escape(target.name)}.tmp-*"):
        pid = folder.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (another export at work)
        except PermissionError:
            continue  # alive, another user's
        except (ProcessLookupError, OverflowError):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def write_export(target: Path, write: Callable[[Path], None], last_checkpoint: str | None) -> None:
    """``write(staging)`` the export, then rename the staging folder to ``target`` (empty or absent; a
    symbolic link to an empty folder is followed: a folder cannot be renamed onto the link itself)."""
    if target.is_symlink() and target.is_dir():
        target = target.resolve()
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    remove_stale_staging(target)
    try:
        write(staging)
        if target.is_dir():
            target.rmdir()  # empty (checked before training)
        staging.rename(target)
    except Exception as error:
        shutil.rmtree(staging, ignore_errors=True)
        if not _write_failure(error):
            raise
        kept = (f"the trained weights are in {last_checkpoint}: free space and run the same command again to export "
                "them (nothing is left to train)" if last_checkpoint else
                "no checkpoint holds the trained weights (checkpoint.every=-1)")
        first = (str(error).strip().splitlines() or [""])[0][:200]
        raise OutputWriteError(f"model.export_hf={str(target)!r} could not be written ({type(error).__name__}: {first}; "
                               f"{free_space(target.parent)}); {kept}.") from None


def export_trained(model: nn.Module, config: RunConfig, path: str, tokenizer, last_checkpoint: str | None,
                   rank: int) -> None:
    """Gather the full weights (every rank) and write them on rank 0 in the Hugging Face format, with
    the tokenizer files, chat template and generation config of the tokenizer trained with (LoRA: the
    adapter in PEFT's format, or merged weights). A target that became unwritable during training
    is not overwritten: the export goes beside it, under a timestamped name."""
    state = canonical_state_dict(model)
    if rank == 0:
        target = Path(path)
        problem = export_target_problem(target, config.model.hf_path)
        if problem:  # appeared during training: keep the trained weights next to it
            target = target.with_name(f"{target.name}-{time.strftime('%Y%m%d-%H%M%S')}")
            notice(f"model.export_hf={path!r} cannot be written now ({problem}); exporting to {target} instead.")
        # the file task's tokenizer (none for bytes); for a synthetic task, the one model.hf_path ships
        tokenizer_dir = tokenizer.source_dir if tokenizer is not None else \
            config.model.hf_path if ships_tokenizer(config.model.hf_path) else None
        architecture = config.model.export_architecture
        if config.peft.method == "lora":
            write = partial(export_lora, model, state=state, merge=config.peft.merge, tokenizer_dir=tokenizer_dir,
                            base_path=config.model.hf_path, architecture=architecture)
        else:
            write = partial(export_causal_lm, model, tokenizer_dir=tokenizer_dir, state_dict=state, architecture=architecture)
        write_export(target, write, last_checkpoint)
        shown = f"{target} (-> {target.resolve()})" if target.is_symlink() else str(target)
        print(f"exported Hugging Face checkpoint: {shown}", flush=True)
    dist.barrier()
