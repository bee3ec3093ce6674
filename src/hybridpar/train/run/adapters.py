"""Checkpoints of a LoRA run: the adapters and their optimizer state, plus the base they sit on.

The frozen base weights are not written (``checkpoint.py`` passes DCP's ``ignore_frozen_params``
when the model has frozen parameters, for saving and loading alike): a resumed run rebuilds them from ``model.hf_path`` (or the preset
and seed) and loads only the adapters. So that a resume never puts adapters on other weights,
run.json records ``base_reference`` (the path and a sha256 of its weight files, or the preset,
dtype and seed that generate it) and the adapters' layout (``adapter_layout``: rank, alpha and the
adapted modules, then the adapted stacked expert weights), and ``check_same_base`` refuses a resume whose base or adapters differ, naming
both (loading is not strict for a LoRA run, so adapters of other modules would be dropped silently).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from torch import nn

from hybridpar.config import RunConfig
from hybridpar.config_rules import shorten
from hybridpar.models.lora import adapter_settings, lora_modules
from hybridpar.models.lora_experts import expert_lora_modules
from hybridpar.train.run.checkpoint import CheckpointError, read_run_info

__all__ = ["adapter_layout", "base_reference", "check_same_base"]

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def _sha256_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(2**22), b""):
                digest.update(block)
    return digest.hexdigest()


def base_reference(config: RunConfig) -> dict | None:
    """What the frozen weights of a ``peft.method=lora`` run are (None for a full fine-tune)."""
    if config.peft.method == "none":
        return None
    if config.model.hf_path:
        path = Path(config.model.hf_path).resolve()
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
        return {"path": str(path), "sha256": _sha256_files(files)}
    recipe = {"preset": config.model.preset, "overrides": config.model.overrides, "dtype": config.model.dtype,
              "seed": config.train.seed}
    text = json.dumps(recipe, sort_keys=True)
    return {"path": f"preset {config.model.preset} (seed {config.train.seed})",
            "sha256": hashlib.sha256(text.encode()).hexdigest()}


def adapter_layout(model: nn.Module) -> dict | None:
    """``{"r", "alpha", "modules"}`` of a model's adapters (names before ``parallelize``), or None."""
    settings = adapter_settings(model)
    if settings is None:
        return None
    experts = [f"{path}.{p}" for path, m in expert_lora_modules(model).items() for p in m.lora_parameters]
    return {"r": settings["r"], "alpha": settings["alpha"], "modules": sorted(lora_modules(model)) + experts}


def _describe(layout: dict) -> str:
    names = sorted({name.rsplit(".", 1)[-1] for name in layout["modules"]})
    return f"r={layout['r']}, alpha={layout['alpha']:g} on {len(layout['modules'])} modules ({', '.join(names)})"


def check_same_base(checkpoint: str | Path, current: dict | None) -> None:
    """Refuse to resume adapters from ``checkpoint`` on a base other than the one they trained on."""
    saved = read_run_info(checkpoint).get("lora_base")
    if saved is None and current is None:
        return
    if saved is None or current is None:
        kind = "a full fine-tune" if saved is None else "a LoRA run"
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} is from {kind}, but this run has peft.method="
                              f"{'lora' if current else 'none'}; resume with the same peft.method or start fresh "
                              "with checkpoint.resume=null.")
    if saved["sha256"] != current["sha256"]:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} holds LoRA adapters trained on {saved['path']} "
                              f"(sha256 {saved['sha256'][:12]}), but this run's base is {current['path']} (sha256 "
                              f"{current['sha256'][:12]}); resume on the same base weights or start fresh with "
                              "checkpoint.resume=null.")
    saved_adapters, adapters = saved.get("adapters"), current.get("adapters")
    if saved_adapters is not None and adapters is not None and saved_adapters != adapters:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} holds adapters with {shorten(_describe(saved_adapters), 200)}, "
                              f"but this run builds {shorten(_describe(adapters), 200)}; resume with the checkpoint's "
                              "peft.r, peft.alpha and peft.target_modules, or start fresh with checkpoint.resume=null.")
