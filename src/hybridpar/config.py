"""Run configuration: nested dataclasses, read from YAML, with dotted CLI overrides.

    hybridpar train --config configs/tiny-hybrid.yaml train.steps=100 parallel.cp=2

Every key has a rule in ``RULES`` (next to the dataclasses): a range for numbers, the
choices for strings. A value that breaks its rule, an unknown key, a value of the wrong
type, a YAML syntax error (file and line) or a malformed override is a ``ConfigError`` with
one message naming the key, the value, the rule and the fix. Nothing is silently ignored.

YAML is read with the YAML 1.2 core schema for scalars: ``1e-3`` is a float (PyYAML's
YAML 1.1 default reads it as a string), ``010`` is ten, ``yes``/``on`` are strings.

A new key needs a field in its dataclass and a line in ``RULES`` (a test checks that every
key has one); rules that relate keys to each other or to the model live in
``hybridpar.train.preflight``.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hybridpar.config_rules import INT64_MAX, as_path, SAMPLE_RULE_TEXT, SEED_MAX, did_you_mean, leaf_keys, nearest_choice, not_key_value, not_utf8, path_problem, quoted, repeated_override, sample_problem, shorten, show_value, type_names, whole_section_problem
from hybridpar.config_rules import ANY, PATH, LazyText, Rule, each, integer, number, one_of, or_null  # noqa: F401 (re-exported)
from hybridpar.config_rules import ConfigError, RepeatedOverride  # noqa: F401 (re-exported: raised by every check)
from hybridpar.yaml12 import Yaml12Loader, other_spelling, read_config_file, unquoted_value


@dataclass
class ModelConfig:
    preset: str = "tiny"  # HybridConfig preset (tiny, demo, small, 1b, nemotronh-8b)
    overrides: dict = field(default_factory=dict)  # HybridConfig fields, e.g. {pattern: "M*-M-"}
    dtype: str = "float32"  # float32 | float64 | bfloat16
    hf_path: str | None = None  # a Hugging Face checkpoint directory (config.json + safetensors) to start from
    backend: str = "auto"  # auto | hybrid | transformers: how model.hf_path is loaded (see models/hf/causal_lm.py)
    export_hf: str | None = None  # after training, write the model there in Hugging Face format
    export_architecture: str | None = None  # for a HybridLM not loaded from HF: Mamba2/Bamba/NemotronHForCausalLM


@dataclass
class DataConfig:
    task: str = "mqar"  # mqar | selective_copy | text | jsonl | chat | prompt_completion | hf_dataset | python_stdlib
    path: str | None = None  # the file (hf_dataset, python_stdlib: directory; python_stdlib null: this Python's stdlib)
    tokenizer: str = "auto"  # auto (model.hf_path's tokenizer, else bytes) | bytes | bpe (trained for the run) | a directory
    pack_size: int = 512  # tokens per packed row; a multiple of 2*cp (512: a synthetic task's default document fits one)
    packs_per_step: int = 2  # packed rows per step over all dp ranks; each rank accumulates gradients over its share
    pad_to_multiple_of: int | None = None  # per-document padding; default 2*cp (a resumed run keeps the checkpoint's)
    seed: int = 0
    task_options: dict = field(default_factory=dict)  # passed to the task (data/documents.py FILE_TASKS lists them)
    on_change: str = "refuse"  # a resumed run whose data file or tokenizer changed since the checkpoint: refuse | warn


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    cp_attention: str = "allgather"  # allgather | ulysses | ring
    cp_mamba: str = "a2a"  # a2a | state
    activation_checkpointing: str | bool = "none"  # none | full | selective (true/false: full/none)
    mixed_precision: str | None = None  # None | bf16: fp32 weights, bf16 matmuls (FSDP policy, else autocast)
    tf32: bool = True  # float32 matmuls/convs on CUDA in TF32 (never for float64 or `hybridpar check`)
    reshard_after_forward: bool | int = True  # FSDP blocks: true | false (gathered all step) | a divisor of dp_shard*cp
    compile: bool | str = False  # torch.compile each block: true (inductor) | a backend name (e.g. aot_eager)

    def __post_init__(self):
        from hybridpar.parallel.checkpointing import POLICIES, checkpointing_policy

        try:
            self.activation_checkpointing = checkpointing_policy(self.activation_checkpointing)
        except ValueError:
            raise ConfigError(f"parallel.activation_checkpointing={quoted(self.activation_checkpointing)} is not a policy; "
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
    collective_timeout_s: float = 600.0  # a collective that waits longer (a stalled or dead rank) ends the job
    on_nonfinite: str = "stop"  # stop | skip: what a non-finite loss or gradient norm does
    max_nonfinite_skips: int = 10  # with on_nonfinite=skip: the run stops at the skip after this many
    sample: dict | None = None  # after training, print a continuation: {prompt, max_new_tokens, temperature, top_p, seed}


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end, -1 = never
    keep: int = 2  # newest checkpoints of this run kept
    resume: str | None = "auto"  # auto (latest in output/checkpoints) | a path | null
    if_exists: str = "refuse"  # a fresh run into an output_dir with an earlier run: refuse | overwrite | new_subdir


@dataclass
class PeftConfig:
    method: str = "none"  # none | lora: train low-rank adapters on a frozen model (models/lora.py)
    r: int = 8  # LoRA rank
    alpha: float = 16.0  # the update is scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapter's input
    target_modules: tuple[str, ...] | None = None  # linear layers by name (peft's rule); null: q/k/v/o, MLP, Mamba in/out_proj
    target_parameters: tuple[str, ...] | None = None  # stacked MoE expert weights, e.g. [experts.gate_up_proj, experts.down_proj]
    merge: bool = False  # model.export_hf writes merged full weights instead of the adapter


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    output_dir: str = "runs/default"
    tensorboard: bool = True
    plot: bool = True


# ----------------------------------------------------------------------------- value rules


def _presets():
    from hybridpar.models.hybrid import PRESETS

    return PRESETS


def _architectures():
    from hybridpar.models.hf.config import ARCHITECTURES

    return ARCHITECTURES


_PACKS_WHY = " (packs held at once; fewer, larger packs hold as many tokens: data.pack_size)"
RULES: dict[str, Rule] = {
    "model.preset": one_of(lazy=_presets),
    "model.overrides": ANY,  # checked field by field against HybridConfig (preflight)
    "model.dtype": one_of("float32", "float64", "bfloat16"),
    "model.hf_path": or_null(PATH),
    "model.backend": one_of("auto", "hybrid", "transformers"),
    "model.export_hf": or_null(PATH),
    "model.export_architecture": or_null(one_of(lazy=_architectures)),
    "data.task": one_of("mqar", "selective_copy", "text", "jsonl", "chat", "prompt_completion", "hf_dataset",
                        "python_stdlib"),
    "data.path": or_null(PATH),
    "data.tokenizer": Rule("'auto', 'bytes', 'bpe' or a tokenizer directory path", PATH.holds),
    "data.pack_size": integer(1, 2**31 - 1, " (cu_seqlens are int32; the preflight also holds a pack to memory)"),
    "data.packs_per_step": integer(1, 2**24, _PACKS_WHY),
    "data.pad_to_multiple_of": or_null(integer(1), " (null: 2*cp)"),
    "data.seed": integer(0, INT64_MAX),
    "data.task_options": ANY,  # checked by the task (preflight)
    "data.on_change": one_of("refuse", "warn"),
    "parallel.dp_replicate": integer(1),
    "parallel.dp_shard": integer(1),
    "parallel.cp": integer(1),
    "parallel.tp": integer(1),
    "parallel.sequence_parallel": ANY,
    "parallel.cp_attention": one_of("allgather", "ulysses", "ring"),
    "parallel.cp_mamba": one_of("a2a", "state"),
    "parallel.activation_checkpointing": Rule("'none', 'full' or 'selective' (true/false: full/none)",
                                              lambda v: isinstance(v, bool) or v in ("none", "full", "selective")),
    "parallel.reshard_after_forward": Rule("true, false or an integer >= 1 and <= 2**63-1 dividing dp_shard*cp",
                                           lambda v: isinstance(v, bool) or 1 <= v <= INT64_MAX),
    "parallel.compile": Rule("true, false or a torch.compile backend name such as 'aot_eager'",
                             lambda v: isinstance(v, bool) or bool(str(v).strip())),
    "parallel.mixed_precision": or_null(one_of("bf16")),
    "parallel.tf32": ANY,
    "train.steps": integer(1),
    "train.lr": number(0, low_open=True),
    "train.min_lr_ratio": number(0, 1),
    "train.warmup_steps": integer(0),
    "train.weight_decay": number(0),
    "train.betas": each(number(0, 1, high_open=True), 2),
    "train.grad_clip": number(0, low_open=True),
    "train.seed": integer(0, SEED_MAX, " (torch.manual_seed's range)"),
    "train.log_every": integer(1),
    "train.eval_every": integer(0),
    "train.eval_packs": integer(1, 2**24, _PACKS_WHY),
    "train.collective_timeout_s": number(1, 1e9),  # seconds; datetime.timedelta and the launcher hold them
    "train.on_nonfinite": one_of("stop", "skip"),
    "train.max_nonfinite_skips": integer(0),
    "train.sample": Rule(SAMPLE_RULE_TEXT, lambda v: v is None or sample_problem(v) is None, sample_problem),
    "checkpoint.every": integer(-1),
    "checkpoint.keep": integer(1),
    "checkpoint.resume": Rule("'auto', a checkpoint path or null", lambda v: v is None or PATH.holds(v)),
    "checkpoint.if_exists": one_of("refuse", "overwrite", "new_subdir"),
    "peft.method": one_of("none", "lora"),
    "peft.r": integer(1),
    "peft.alpha": number(0, low_open=True),
    "peft.dropout": number(0, 1, high_open=True),
    "peft.target_modules": or_null(Rule("a list of module names such as [q_proj, v_proj] ([]: experts only)",
                                        lambda v: all(isinstance(t, str) and t.strip() for t in v)),
                                   " (null: q/k/v/o_proj, gate/up/down_proj, in/out_proj where present)"),
    "peft.target_parameters": or_null(Rule("a non-empty list of stacked expert weights such as [experts.gate_up_proj, "
                                           "experts.down_proj]",
                                           lambda v: len(v) > 0 and all(isinstance(t, str) and t.strip() for t in v)),
                                      " (null: experts are not adapted)"),
    "peft.merge": ANY,
    "output_dir": PATH,
    "tensorboard": ANY,
    "plot": ANY,
}


HOME_PATHS = {"model.hf_path", "model.export_hf", "data.path", "data.tokenizer", "checkpoint.resume", "output_dir"}
PATH_KEYS = HOME_PATHS  # keys whose value is looked up as a path (another key's long value is not "too long a name")


def invalid(key: str, value, must: str, fix: str | None = None) -> ConfigError:
    """The one message of a bad value: key, value, rule and fix."""
    fix = fix or _example(key)
    return ConfigError(f"{key}={show_value(value)} is invalid: it must be {must}; {fix}.")


def _example(key: str) -> str:
    default = _default_of(key)
    return f"e.g. {key}={show_value(default)} (the default)" if default is not _MISSING else f"set {key}"


_MISSING = object()
MAX_CONFIG_BYTES = 4 * 2**20  # a run config is a few KB; a larger file is most likely data passed by mistake


def _default_of(key: str):
    node = RunConfig()
    for part in key.split("."):
        node = getattr(node, part, _MISSING)
        if node is _MISSING:
            return _MISSING
    return node


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML file (optional) and apply ``key.sub=value`` overrides; every value checked."""
    raw: dict = {}
    if path is not None:
        raw = read_config_file(as_path(path, "config path").expanduser(), MAX_CONFIG_BYTES)
    if not isinstance(overrides, (list, tuple)) or not all(isinstance(item, str) for item in overrides):  # a str: letter by letter
        raise ConfigError(f"overrides={quoted(overrides)} must be a list of 'key=value' strings; e.g. ['train.steps=100'].")
    written: dict = {}  # leaf path -> (override, value): a key given twice is said
    for index, item in enumerate(overrides):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(not_key_value(overrides, index))
        if bad_bytes := not_utf8(item):
            raise ConfigError(f"override {quoted(item)} cannot be read: {bad_bytes}; write it in UTF-8 (a path "
                              "whose name is not UTF-8: rename it, or link it under a UTF-8 name).")
        try:
            parsed = yaml.load(value, Loader=Yaml12Loader)
        except yaml.YAMLError as error:
            problem = getattr(error, "problem", None) or "cannot be parsed"
            split = any(value.count(o) > value.count(c) for o, c in ("{}", "[]"))  # the shell split it at a space
            raise ConfigError(f"override {quoted(item)} has a malformed value {quoted(value)} ({problem}); write it as a YAML "
                              "value, e.g. train.betas=[0.9,0.95] or model.overrides={pattern: M-}" + (
                                  ", in quotes: the shell splits an unquoted override at its spaces, so quote it whole "
                                  f"(\"{shorten(item, 60)} ...\")" if split else "") + ".") from None
        if any(not part or part != part.strip() for part in key.strip().split(".")):  # train..steps, train. steps
            raise ConfigError(f"override {quoted(item)} has an empty or spaced name in its key {quoted(key.strip())}; "
                              "write the key as section.name, e.g. train.steps=100.")
        if value.strip() == "~" and key.strip() in HOME_PATHS:  # output_dir=~ was "output_dir=null is invalid"
            none = "" if key.strip() in ("output_dir", "data.tokenizer") else f" ({key.strip()}=null for none)"
            raise ConfigError(f"override {quoted(item)}: a lone ~ is null in YAML, not the home directory; write a path "
                              f"(~/NAME or the home directory's full path){none}.")
        _set_dotted(raw, key.strip().split("."), parsed)
        if repeated := repeated_override(written, item, tuple(key.strip().split(".")), parsed):
            warnings.warn(repeated, RepeatedOverride, stacklevel=2)  # a base set of overrides and a change to it
    return _build(RunConfig, raw, "")


def config_from_dict(raw: dict) -> RunConfig:
    """A ``RunConfig`` from ``to_dict``'s form (e.g. the one recorded in a checkpoint), every value checked."""
    return _build(RunConfig, raw, "")


def to_dict(config) -> dict:
    """Plain nested dict of a config (for logs, checkpoints and YAML)."""
    return dataclasses.asdict(config)


def _set_dotted(tree: dict, keys: list[str], value) -> None:
    for key in keys[:-1]:
        if tree.get(key) is None:  # an empty section in the file (``train:``) is a section
            tree[key] = {}
        node = tree[key]
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {shorten('.'.join(keys))}: {quoted(key)} is a value, not a section.")
        tree = node
    if len(keys) == 1 and (problem := whole_section_problem(tree, keys[0], value)):
        raise ConfigError(problem)
    tree[keys[-1]] = value


def _build(cls, raw, prefix: str):
    raw = {} if raw is None else raw  # ``train:`` with nothing under it: the defaults
    if not isinstance(raw, dict):
        raise ConfigError(f"section {prefix.rstrip('.') or 'top level'!r} must be a mapping, got {quoted(raw)}; "
                          f"set its keys one by one, e.g. {prefix}<key>=<value>.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        known = leaf_keys(RunConfig) + [f.name for f in dataclasses.fields(RunConfig)]
        meant = did_you_mean(prefix + str(unknown[0]), known)
        if prefix == "parallel." and str(unknown[0]).lower() in ("ep", "ep_size", "expert_parallel", "expert_parallel_size"):
            meant = ("; hybridpar has no expert parallelism: parallel.tp splits every expert on its intermediate dim "
                     "(FSDP shards them over parallel.dp_shard*cp)")  # was "did you mean parallel.tp?" alone
        raise ConfigError(f"unknown config key(s) {quoted([prefix + str(k) for k in unknown])}"
                          f"{meant}; valid keys here: {[prefix + n for n in names]}.")
    values = {}
    for name in names:
        if name not in raw:
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw[name], f"{prefix}{name}.")
        else:
            key = prefix + name
            value = coerce_value(raw[name], hint, key)
            rule = RULES.get(key, ANY)
            if key in HOME_PATHS and isinstance(value, str) and value.startswith("~"):
                value = os.path.expanduser(value)  # as a shell would: a YAML file or a quoted override skip the shell
            if not rule.holds(value):  # a path the system cannot look up says why (a symlink loop, ...)
                problem = path_problem(value) if isinstance(value, str) and key in PATH_KEYS else None
                problem = problem or (rule.problem(value) if rule.problem else None)  # e.g. train.sample's prompt
                meant = nearest_choice(value, rule.choices()) if rule.choices else None
                raise invalid(key, value, str(rule.text) + (f"; this one: {problem}" if problem else ""),
                              f"use {key}={show_value(meant)} (the nearest choice)" if meant else None)
            values[name] = value
    return cls(**values)


def coerce_value(value, hint, key: str):
    """Check ``value`` against a simple type hint, converting int->float and list->tuple."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise invalid(key, value, f"{type_names(options)}, not null")
    for option in options:
        origin = typing.get_origin(option) or option
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if origin is tuple and isinstance(value, (list, tuple)):
            items = typing.get_args(option)
            if items and all(i is float for i in items):
                bad = [v for v in value if not isinstance(v, (int, float)) or isinstance(v, bool)]
                if bad:  # 'nan' is text in YAML (.nan is the number)
                    raise invalid(key, value, f"{type_names(options)} (got a {type(bad[0]).__name__} in it: {quoted(bad[0])})")
                return tuple(float(v) for v in value)
            return tuple(value)
        if origin is bool and isinstance(value, bool):
            return value
        if origin in (int, str, dict) and isinstance(value, origin) and not (origin is int and isinstance(value, bool)):
            return value
    unquoted = unquoted_value(value, options)
    listed = isinstance(value, str) and tuple[str, ...] in options  # peft.target_modules=q_proj: one name, no brackets
    grouped = isinstance(value, str) and "_" in value and not value.strip("0123456789_.+-eE") and unquoted_value(
        value.replace("_", ""), options)  # 1_000: a YAML 1.1 integer
    raise invalid(key, value, f"{type_names(options)} (got {type(value).__name__})",
                  f"a value in quotes is text in YAML: write it without them, {key}={unquoted}" if unquoted else
                  f"a list is written in brackets, even of one name: {key}=[{shorten(value, 60)}]" if listed else
                  f"YAML 1.2 reads digits grouped by '_' as text: write {key}={grouped}" if grouped else
                  other_spelling(value, options, key))

