"""The files of a Hugging Face checkpoint directory that are not weights or config.json.

A checkpoint is usable only with its tokenizer, chat template and generation settings, so
every export copies them from the directory they came from (the source checkpoint or a
tokenizer directory): the files below that exist there, and nothing else.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["TOKENIZER_FILES", "copy_tokenizer_files"]

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "generation_config.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
)
TEMPLATE_DIR = "additional_chat_templates"  # transformers 5 saves named extra templates here


def copy_tokenizer_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy the tokenizer, chat template and generation config files of ``src_dir`` into
    ``dst_dir`` (replacing files of the same name); returns the names copied."""
    src, dst = Path(src_dir), Path(dst_dir)
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
