"""Run configuration: nested dataclasses, read from YAML, with dotted CLI overrides.

    hybridpar train --config configs/tiny-hybrid.yaml train.steps=100 parallel.cp=2

Unknown keys and values of the wrong type are errors that name the key and the
valid choices; nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A configuration key or value that cannot be used, with the fix in the message."""


@dataclass
class ModelConfig:
    preset: str = "tiny"  # HybridConfig preset (tiny, small, nemotronh-8b)
    overrides: dict = field(default_factory=dict)  # HybridConfig fields, e.g. {pattern: "M*-M-"}
    dtype: str = "float32"  # float32 | float64 | bfloat16
    hf_path: str | None = None  # load a Mamba2/Bamba/NemotronH checkpoint directory instead
    export_hf: str | None = None  # after training, write the model there in Hugging Face format
    export_architecture: str | None = None  # for a model not loaded from HF: Mamba2/Bamba/NemotronHForCausalLM


@dataclass
class DataConfig:
    task: str = "mqar"  # mqar | selective_copy | text | jsonl
    path: str | None = None  # the file for text/jsonl
    pack_size: int = 256  # tokens per packed row; a multiple of 2*cp
    packs_per_step: int = 2  # packed rows per step over all dp ranks; each rank accumulates gradients over its share
    pad_to_multiple_of: int | None = None  # per-document padding; default 2*cp (pin it to resume at another cp)
    seed: int = 0
    task_options: dict = field(default_factory=dict)  # passed to the synthetic task


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    cp_attention: str = "allgather"  # allgather | ulysses
    cp_mamba: str = "a2a"  # a2a | state
    activation_checkpointing: str | bool = "none"  # none | full | selective (true/false: full/none)
    mixed_precision: str | None = None  # None | bf16 (FSDP params in bf16, reduce in fp32)
    reshard_after_forward: bool | int = True  # FSDP blocks: true | false (gathered all step) | a divisor of dp_shard*cp
    compile: bool | str = False  # torch.compile each block: true (inductor) | a backend name (e.g. aot_eager)

    def __post_init__(self):
        from hybridpar.parallel.checkpointing import POLICIES, checkpointing_policy

        try:
            self.activation_checkpointing = checkpointing_policy(self.activation_checkpointing)
        except ValueError:
            raise ConfigError(f"parallel.activation_checkpointing={self.activation_checkpointing!r} is not a policy; "
                              f"choose one of {list(POLICIES)} (true/false still mean full/none).") from None


@dataclass
class TrainConfig:
    steps: int = 60
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 1
    eval_every: int = 20
    eval_packs: int = 8


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 2  # newest checkpoints kept
    resume: str | None = "auto"  # auto (latest in output/checkpoints) | a path | null


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output_dir: str = "runs/default"
    tensorboard: bool = True
    plot: bool = True


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML file (optional) and apply ``key.sub=value`` overrides."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing YAML file, e.g. configs/tiny-hybrid.yaml.")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level, got {type(raw).__name__}.")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value; write e.g. train.steps=100.")
        _set_dotted(raw, key.strip().split("."), yaml.safe_load(value))
    return _build(RunConfig, raw, "")


def to_dict(config) -> dict:
    """Plain nested dict of a config (for logs, checkpoints and YAML)."""
    return dataclasses.asdict(config)


def _set_dotted(tree: dict, keys: list[str], value) -> None:
    for key in keys[:-1]:
        node = tree.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {'.'.join(keys)}: {key!r} is a value, not a section.")
        tree = node
    tree[keys[-1]] = value


def _build(cls, raw, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"section {prefix.rstrip('.') or 'top level'!r} must be a mapping, got {raw!r}.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ConfigError(f"unknown config key(s) {[prefix + k for k in unknown]}; valid keys here: {[prefix + n for n in names]}.")
    values = {}
    for name in names:
        if name not in raw:
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw[name], f"{prefix}{name}.")
        else:
            values[name] = _coerce(raw[name], hint, prefix + name)
    return cls(**values)


def _coerce(value, hint, key: str):
    """Check ``value`` against a simple type hint, converting int->float and list->tuple."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{key} may not be null.")
    for option in options:
        origin = typing.get_origin(option) or option
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if origin is tuple and isinstance(value, (list, tuple)):
            return tuple(value)
        if origin is bool and isinstance(value, bool):
            return value
        if origin in (int, str, dict) and isinstance(value, origin) and not (origin is int and isinstance(value, bool)):
            return value
    expected = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise ConfigError(f"{key}={value!r} has type {type(value).__name__}; expected {expected}.")
