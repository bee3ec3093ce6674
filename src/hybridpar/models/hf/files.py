"""The files of a Hugging Face checkpoint directory that are not weights or config.json.

A checkpoint is usable only with its tokenizer, chat template and generation settings, so
every export copies them from the directory they came from (the source checkpoint or a
tokenizer directory): the files of ``TOKENIZER_FILES`` that exist there, and nothing else, after
``check_files`` (``strict_json``) has refused any that is not a regular file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hybridpar.config_rules import quoted
from hybridpar.strict_json import TEMPLATE_DIR, TOKENIZER_FILES, check_files
from hybridpar.strict_json import load_file as load_json

__all__ = ["TOKENIZER_FILES", "check_files", "copy_tokenizer_files", "directory_kind"]


def copy_tokenizer_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy the tokenizer, chat template and generation config files of ``src_dir`` into
    ``dst_dir`` (replacing files of the same name); returns the names copied."""
    src, dst = Path(src_dir), Path(dst_dir)
    check_files(src)  # a FIFO or device link was skipped, and the export had no tokenizer
    present = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not src.is_dir() or not set(present) - {"generation_config.json"}:
        raise ValueError(f"{src} holds no tokenizer files (none of {list(TOKENIZER_FILES[:5])}, ...); pass the "
                         "directory of the checkpoint or tokenizer the model was trained with.")
    if src.resolve() == dst.resolve():
        return present
    dst.mkdir(parents=True, exist_ok=True)
    for name in present:
        shutil.copyfile(src / name, dst / name)
    if (src / TEMPLATE_DIR).is_dir():
        shutil.copytree(src / TEMPLATE_DIR, dst / TEMPLATE_DIR, dirs_exist_ok=True)
        present.append(TEMPLATE_DIR)
    return present


def directory_kind(path: str | Path, wanted: str) -> str | None:
    """What ``path`` holds when it is not the ``wanted`` kind ("hf": a Hugging Face model, "run": a
    hybridpar run or checkpoint), as a clause for its message (a LoRA adapter, a hybridpar run, a
    Hugging Face model, a tokenizer alone), or None."""
    path = Path(path)
    if (path / "adapter_config.json").is_file():
        try:
            base = load_json(path / "adapter_config.json").get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError, RecursionError):
            base = None
        return (f"{path} is a LoRA adapter (adapter_config.json) of the base model {quoted(base)}, not a "
                + ("hybridpar training checkpoint: start a run from that base model with model.hf_path" if wanted == "run"
                   else "whole model: use that base model here (generate --hf-path takes the adapter itself)"))
    run = (path / "manifest.json").is_file() or (path / "checkpoints").is_dir() or path.name.startswith("step_")
    if run and wanted != "run":
        return (f"{path} is a hybridpar training run or checkpoint, not a Hugging Face model: resume it with "
                "checkpoint.resume, generate from it with --checkpoint, or write a Hugging Face copy with model.export_hf")
    if (path / "config.json").is_file() and wanted != "hf":
        return (f"{path} is a Hugging Face model (config.json), not a hybridpar training checkpoint: start a run "
                "from it with model.hf_path, or generate from it with --hf-path")
    if not run and any((path / name).is_file() for name in TOKENIZER_FILES[:2]):
        return f"{path} holds a tokenizer only, no model (no config.json): use it as data.tokenizer or --tokenizer"
    return None
