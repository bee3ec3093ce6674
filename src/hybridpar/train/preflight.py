"""Everything that can be wrong with a run, found before any process group exists.

One function per concern, shared by every entry point so they cannot disagree:

- ``validate_layout``: the degrees against the world size, the model's heads and groups
  against tp and cp (on a shape-only ``meta`` model: a ``HybridLM`` or a transformers model),
  the data shape against the layout.
  ``hybridpar plan``, the launcher and every rank call it.
- ``check_model_memory`` and ``check_pack_memory``: the model's state (weights, and gradients and
  AdamW's moments of what trains, sharded at best over tp * dp_shard * cp) and ``data.pack_size``
  against what this machine can hold (lower bounds of the planner's estimate: the pack's ids,
  labels and positions, and every block's saved input), on every rank and in the launcher,
  before any memory is spent;
- ``one_process_rendezvous``: a one-process run outside torchrun owns its rendezvous, so a
  busy or foreign ``MASTER_PORT``/``MASTER_ADDR`` is replaced by a free local one (a notice
  says so), as ``--nproc-per-node`` does; a ``MASTER_PORT`` that is not a port exits 2;
- ``validate_run``: the layout, the export target, every path the run writes, the output
  directory (lock, earlier runs, the checkpoint to resume and its data fingerprints),
  ``train.sample``, and the data task, files and tokenizer
  (``data.tokenizer`` against ``model.hf_path`` and the embedding; ``bpe`` is trained here,
  ``train/run/tokenizer.py``). The launcher calls it before
  torchrun starts, so a config error exits 2 with one message at any process count.

Rules between keys live here; rules of a single value live in ``config.RULES``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import typing
from pathlib import Path

from hybridpar.config import ConfigError, RunConfig, coerce_value, invalid, show_value
from hybridpar.config_rules import did_you_mean, quoted
from hybridpar.data.tokenizers import auto_bytes_note
from hybridpar.models.hybrid import MODEL_RULES
from hybridpar.parallel.context.hf_own_memory import memory_fixes, own_path_bytes, own_path_words
from hybridpar.parallel.dims import ParallelDims
from hybridpar.train.batches import (missing_eos, pack_size_fix, pad_multiple, sequence_parallel_pack_problem,
                                     validate_data)
from hybridpar.train.hf_model import (attention_dropout_problem, check_learned_positions, hf_shape, meta_model,
                                      model_backend, pack_position_note)
from hybridpar.train.optim import check_optimizer_scale
from hybridpar.train.peft import apply_peft


# Keys of ``parallelize``'s own rules, as its messages name them ("tp=3", "compile backend").
_PARALLEL_KEYS = re.compile(r"\b(compile|reshard_after_forward|mixed_precision|activation_checkpointing|sequence_parallel|"
                            r"cp_attention|cp_mamba|tp|cp|dp_shard|dp_replicate)\b")
_STYLE_REPR = re.compile(r"\b[A-Z]\w*\([^()]*\)|'[^']*'")  # Mamba1ChannelParallel(sequence_parallel=False), 'names'
COMMON_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")


def parallel_dims(config: RunConfig) -> ParallelDims:
    p = config.parallel
    return ParallelDims(p.dp_replicate, p.dp_shard, p.cp, p.tp)


def model_config(config: RunConfig):
    """The shape of ``model.*``: a ``HybridConfig`` (preset + overrides, or ``model.hf_path``'s
    config.json) or, for a transformers model, its ``PretrainedConfig`` (``train/hf_model.py``)."""
    import torch

    from hybridpar.models.hybrid import HybridConfig

    dtype = getattr(torch, config.model.dtype)
    backend = model_backend(config)
    if config.model.hf_path:
        from hybridpar.models.hf.config import config_from_hf, read_hf_config

        if config.model.overrides:
            raise ConfigError(f"model.overrides={quoted(config.model.overrides)} cannot change a model loaded from model.hf_path; "
                              "remove the overrides or edit the checkpoint's config.json.")
        path = Path(config.model.hf_path)
        if backend == "transformers":
            shape = hf_shape(path)
            shape.dtype = dtype  # the dtype it is trained in, as the loaded model's config says
            return shape
        try:
            return config_from_hf(read_hf_config(path), dtype)
        except (ValueError, TypeError, KeyError) as error:
            raise ConfigError(f"model.hf_path={str(path)!r}: {path / 'config.json'} cannot be used: {error}") from None
    hints = typing.get_type_hints(HybridConfig)
    fields = {f.name for f in dataclasses.fields(HybridConfig)} - {"dtype"}
    unknown = sorted(set(config.model.overrides) - fields)
    if unknown:
        meant = "; the dtype is model.dtype" if "dtype" in unknown else did_you_mean(unknown[0], fields)
        raise ConfigError(f"model.overrides has unknown field(s) {quoted(unknown)}{meant}; "
                          f"HybridConfig fields are {sorted(fields)}.")
    overrides = {}
    for name, value in config.model.overrides.items():
        key = f"model.overrides.{name}"
        overrides[name] = coerce_value(value, hints[name], key)
        rule = MODEL_RULES.get(name)
        if rule is not None and not rule.holds(overrides[name]):
            raise invalid(key, value, str(rule.text), f"e.g. {key}={getattr(HybridConfig(), name)!r} (the tiny default)")
    try:
        return HybridConfig.from_preset(config.model.preset, dtype=dtype, **overrides)
    except (ValueError, TypeError, ZeroDivisionError) as error:
        raise ConfigError(f"model.overrides={quoted(config.model.overrides)} do not make a valid "
                          f"{config.model.preset!r} model: {error}") from None


def _check_compile_backend(value) -> None:
    """``parallel.compile``: a backend name torch knows (the list is long: name the usual ones)."""
    if not isinstance(value, str):
        return
    from torch._dynamo import list_backends

    if value not in set(list_backends(exclude_tags=())) | set(COMMON_BACKENDS):
        raise invalid("parallel.compile", value, f"true (inductor), false or a torch.compile backend such as "
                      f"{', '.join(map(repr, COMMON_BACKENDS))} (all: torch._dynamo.list_backends())",
                      "e.g. parallel.compile=true or parallel.compile=aot_eager")


def _named_parallel_key(config: RunConfig, message: str) -> str:
    """``parallel.<key>=<value>`` of the first parallel key a layout message names."""
    # not a key inside a style's repr or a quoted name; else "TP" ("Hugging Face TP style 'x' is not supported")
    match = _PARALLEL_KEYS.search(_STYLE_REPR.sub("", message)) or re.search(r"\b(TP)\b", message)
    if match is None:
        p = config.parallel
        return f"parallel.* (dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} cp={p.cp} tp={p.tp})"
    key = match[1].lower()
    return f"parallel.{key}={show_value(getattr(config.parallel, key))}"


def _layout_error(config: RunConfig, error: ValueError) -> ConfigError:
    """A layout rule's message under the key it names (a HybridLM's CP head rule: cp with tp)."""
    from hybridpar.parallel.parallelize import CPHeadError

    if isinstance(error, CPHeadError):  # the heads each TP rank will hold at cp
        return ConfigError(f"parallel.cp={config.parallel.cp} with parallel.tp={config.parallel.tp}: {error.rule}")
    return ConfigError(f"{_named_parallel_key(config, str(error))}: {error}")


def cp_head_rules(config: RunConfig, model) -> None:
    """The CP strategies' head/group rules alone, said as ``validate_layout`` says them (``plan --fit``)."""
    from hybridpar.parallel.parallelize import cp_cores_at, cp_head_checks

    p = config.parallel
    try:
        cp_head_checks(model, p.tp, *cp_cores_at(p.cp, p.cp_attention, p.cp_mamba))
    except ValueError as error:
        raise _layout_error(config, error) from None


def validate_layout(config: RunConfig, world_size: int | None = None, model=None, shape=None):
    """Raise ``ValueError`` naming the key if the layout cannot run; returns the model shape.

    ``world_size=None`` takes the product of the degrees (``plan``); ``model`` (default: a
    meta model of ``shape``) is what will be parallelized.
    """
    from hybridpar.parallel.parallelize import validate_parallelize

    if not isinstance(config, RunConfig):  # make_plan("run.yaml"): an AttributeError
        raise ValueError(f"the run config {quoted(config)} is not a RunConfig (type {type(config).__name__}); "
                         "read it with hybridpar.load_config(path).")
    if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1):
        raise ValueError(f"world_size={quoted(world_size)} must be an integer >= 1 (the number of processes), or None.")
    p, data = config.parallel, config.data
    dims = parallel_dims(config)
    if world_size is not None:
        dims.validate(world_size)
    shape = shape if shape is not None else (model.config if model is not None else model_config(config))
    model = apply_peft(config, model if model is not None else meta_model(shape))  # peft.*: adapters first
    _check_compile_backend(p.compile)
    check_learned_positions(model, data.pack_size)  # a transformers model with a position table (GPT-2's wpe)
    try:
        validate_parallelize(model, dims, cp_attention_strategy=p.cp_attention, cp_mamba_strategy=p.cp_mamba,
                             sequence_parallel=p.sequence_parallel, mixed_precision=p.mixed_precision,
                             activation_checkpointing=p.activation_checkpointing,
                             reshard_after_forward=p.reshard_after_forward, compile=p.compile)
    except ValueError as error:
        raise _layout_error(config, error) from None
    multiple = pad_multiple(data, p.cp)
    if multiple % (2 * p.cp):
        raise ConfigError(f"data.pad_to_multiple_of={multiple} is not a multiple of 2*cp={2 * p.cp}; every padded "
                          f"document must split into 2*cp equal chunks: use a multiple of {2 * p.cp} or leave it null.")
    if data.pack_size % multiple:
        raise ConfigError(f"data.pack_size={data.pack_size} is not a multiple of the document padding {multiple} ("
                          f"{'data.pad_to_multiple_of' if data.pad_to_multiple_of else f'2*cp={2 * p.cp}'}); use "
                          f"data.pack_size={pack_size_fix(data.pack_size, multiple)}.")
    if p.sequence_parallel and (problem := sequence_parallel_pack_problem(data.pack_size, multiple, p.cp, p.tp)):
        raise ConfigError(problem)
    dp = dims.size("dp")
    if data.packs_per_step % dp:
        raise ConfigError(f"data.packs_per_step={data.packs_per_step} is not divisible by the data-parallel size "
                          f"dp_replicate*dp_shard={dp}; use a multiple of {dp}.")
    if config.train.eval_every and config.train.eval_packs % dp:
        raise ConfigError(f"train.eval_packs={config.train.eval_packs} is not divisible by the data-parallel size {dp}; "
                          f"use a multiple of {dp} (or train.eval_every=0).")
    return shape


_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2}


def _memory_bytes(local_ranks: int) -> tuple[int, str]:
    """``(bytes, what)`` one rank of this machine can use: its GPU's memory, or its share of the RAM."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory, "its GPU's memory"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(1, local_ranks), f"its share of this machine's RAM ({local_ranks} process(es))"


def pack_memory_floor(config: RunConfig, shape, model=None) -> int:
    """Bytes one rank needs at least for one step's packs: ids, labels and positions (int64, every
    rank builds whole packs; evaluation's ``train.eval_packs`` too), a synthetic task's window of at
    least 8 documents of ``max_len`` tokens (ids and labels), one saved ``[T/(cp*tp), hidden]``
    input per block, and what ``model``'s transformers paths keep: its own attention's ``[S, S]``
    tensors, the logits path's logits (``own_path_bytes``). ``hybridpar plan``'s estimate is above it."""
    p, data = config.parallel, config.data
    blocks = len(getattr(shape, "pattern", "") or "") or getattr(shape, "num_hidden_layers", 1) or 1
    element = 2 if p.mixed_precision == "bf16" else _DTYPE_BYTES.get(config.model.dtype, 4)
    packs = max(data.packs_per_step, config.train.eval_packs if config.train.eval_every else 0)
    longest = data.task_options.get("max_len", 0) if isinstance(data.task_options.get("max_len"), int) else 0
    square = 0 if model is None else own_path_bytes(model, data.pack_size, element, p.tp, p.cp)
    return 24 * data.pack_size * packs + 16 * 8 * longest + square + \
        -(-data.pack_size // (p.cp * p.tp)) * int(getattr(shape, "hidden_size", 1) or 1) * element * blocks


def model_state_floor(config: RunConfig, model, moments: bool = True) -> int:
    """Bytes one rank needs at least for ``model``'s state: each parameter in ``model.dtype``, and each
    one that trains its gradient and (``moments``) AdamW's two moments alike, of which a rank holds
    1/(tp * dp_shard * cp) at best (TP splits over tp, FSDP shards over dp_shard * cp)."""
    p, element = config.parallel, _DTYPE_BYTES.get(config.model.dtype, 4)
    copies = 4 if moments else 2
    total = sum(param.numel() * (copies if param.requires_grad else 1) for param in model.parameters())
    return -(-total * element // (p.tp * p.dp_shard * p.cp))


def check_model_memory(config: RunConfig, model, local_ranks: int, moments: bool = True) -> int:
    """ConfigError if ``model`` (a meta model, adapters added) cannot fit in this machine's memory
    (``model_state_floor``), before any weight exists; returns the floor."""
    need = model_state_floor(config, model, moments)
    have, what = _memory_bytes(local_ranks)
    if need > have:
        p, count = config.parallel, sum(param.numel() for param in model.parameters())
        trained = sum(param.numel() for param in model.parameters() if param.requires_grad)
        kept = "weights, gradients and AdamW's two moments" if moments else "weights and gradients"
        raise ConfigError(f"the model's {count:,} parameters ({trained:,} trained) need at least {need / 2**30:,.1f} GiB "
                          f"per rank for their {kept} in model.dtype={config.model.dtype} (1/{p.tp * p.dp_shard * p.cp} "
                          f"of them per rank at best: tp*dp_shard*cp), more than {what}: {have / 2**30:,.1f} GiB; "
                          "shard it over more processes (parallel.dp_shard, parallel.tp), train adapters only "
                          "(peft.method=lora), or use a smaller model.")
    return need


def check_pack_memory(config: RunConfig, shape, local_ranks: int, model_bytes: int = 0, model=None) -> None:
    """ConfigError if ``data.pack_size`` cannot fit in this machine's memory (``pack_memory_floor``),
    beside ``model_bytes`` of the model's state (``check_model_memory``)."""
    need = pack_memory_floor(config, shape, model) + model_bytes
    have, what = _memory_bytes(local_ranks)
    if need > have:
        data, train = config.data, config.train
        packs = f"data.packs_per_step={data.packs_per_step}" + \
            (f", train.eval_packs={train.eval_packs}" if train.eval_every else "")
        longest = data.task_options.get("max_len")
        documents = f", documents of data.task_options.max_len={longest}" if isinstance(longest, int) else ""
        square = "" if model is None else own_path_words(model)
        raise ConfigError(f"data.pack_size={data.pack_size} ({packs}{documents}) needs at least {need / 2**30:,.1f} GiB "
                          f"per rank for its tokens, the blocks' saved inputs{square}"
                          f"{' and the model state' if model_bytes else ''}, more than {what}: "
                          f"{have / 2**30:,.1f} GiB; {memory_fixes(model)}, and see hybridpar plan for the full estimate.")


def one_process_rendezvous() -> str | None:
    """Make ``MASTER_ADDR``/``MASTER_PORT`` usable for a one-process run that is not under torchrun
    (it owns the rendezvous: nothing else connects to it); returns a notice when they were replaced."""
    port_text = os.environ.get("MASTER_PORT")
    if ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ) or \
            (port_text is None and "MASTER_ADDR" not in os.environ):
        return None
    if port_text is not None and (not port_text.strip().isdigit() or not 1 <= int(port_text) <= 65535):
        raise ConfigError(f"MASTER_PORT={quoted(port_text)} is not a port number: it must be an integer in [1, 65535]; "
                          "fix it, or unset it (a one-process run then picks a free port).")
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    problem = None
    try:
        if not address.strip():  # torch takes it for unset: "MASTER_ADDR expected, but not set" (binding "" works)
            raise OSError("empty")
        with socket.socket() as probe:  # a local address: binding to it works
            probe.bind((address, 0))
    except (OSError, UnicodeError):
        problem = f"MASTER_ADDR={quoted(address)} is not an address of this machine"
    if problem is None and port_text is not None:
        try:
            with socket.socket() as probe:  # the store listens on every interface, as torch's TCPStore does
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(("", int(port_text)))
        except OSError as error:
            problem = f"MASTER_PORT={int(port_text)} is in use ({error.strerror})"
    if problem is None:
        return None
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return (f"{problem}; this one-process run uses 127.0.0.1:{port} instead (it needs no other process to find it), "
            "as --nproc-per-node does.")


def check_hf_weights(path: str, backend: str, say: bool = True) -> None:
    """ConfigError if ``model.hf_path`` has no safetensors weights, a file of them is damaged or (the
    hybrid backend) a tensor's shape disagrees with config.json: headers only, no tensor is read.
    ``say``: its notices too (a dry run; a real run's load says them, once)."""
    from hybridpar.models.hf.checkpoint import shape_problem
    from hybridpar.models.hf.config import INDEX_FILE, WEIGHTS_FILE
    from hybridpar.models.hf.weights import weight_files

    try:
        problem = shape_problem(path, say) if backend == "hybrid" else weight_files(path, WEIGHTS_FILE, INDEX_FILE, say) and None
    except (ValueError, OSError) as error:
        raise ConfigError(f"model.hf_path={str(path)!r}: {error}") from None
    if problem:
        raise ConfigError(f"model.hf_path={str(path)!r}: {problem}")


def check_transformers_shapes(path: str, meta) -> None:
    """ConfigError if a tensor of the checkpoint has another shape than config.json gives it (a dry run; a real run's
    load says it, with transformers' name conversions)."""
    from hybridpar.models.hf.checkpoint import transformers_shape_problem

    if problem := transformers_shape_problem(path, meta):
        raise ConfigError(f"model.hf_path={str(path)!r}: {problem}")


def validate_run(config: RunConfig, command: str, world_size: int | None = None, dry_run: bool = False):
    """Every check that needs no process group (the launcher's preflight); returns the model shape.

    ``dry_run`` (``hybridpar train --dry-run``) writes nothing: a ``data.tokenizer=bpe`` tokenizer
    not trained yet is checked for what training it needs, and the data with bytes instead."""
    from hybridpar.train.run.metrics import notice
    from hybridpar.train.run.tokenizer import BPE, _refuse_bpe, bpe_dir, prepare_data
    from hybridpar.models.hf.generation_config import generation_id_problem
    from hybridpar.train.sample import check_sample, check_sample_prompt
    from hybridpar.train.unused_keys import unused_key_notices

    shape = validate_layout(config, world_size)
    check_optimizer_scale(config)
    if config.model.hf_path:
        check_hf_weights(config.model.hf_path, model_backend(config), say=dry_run)
    for note in unused_key_notices(config, command):
        notice(note)
    local_ranks, meta = world_size or 1, meta_model(shape)  # shape-only: the model (and its adapters, below)
    if dry_run and config.model.hf_path and model_backend(config) != "hybrid":  # the hybrid backend: checked above
        check_transformers_shapes(config.model.hf_path, meta)
    meta = apply_peft(config, meta)
    state = check_model_memory(config, meta, local_ranks, moments=command == "train")
    check_pack_memory(config, shape, local_ranks, state, meta)
    if note := pack_position_note(config):  # RoPE past max_position_embeddings: runs, extrapolating
        notice(note)
    check_sample(config)
    if (world_size or 1) == 1:
        replaced = one_process_rendezvous()
        if replaced:
            notice(replaced)
    if command == "train":
        from hybridpar.train.run.directory import check_lock_free, check_run_paths
        from hybridpar.train.run.resume import preflight_resume
        from hybridpar.train.run.export import validate_export

        validate_export(config, shape)
        check_run_paths(config)
        check_lock_free(config.output_dir)
        preflight_resume(config, shape, dry_run)  # dry_run: prints what the run's resume would
    # data.tokenizer=bpe: trained here, once, before any worker starts (into output_dir, checked above)
    data, bpe_pending = config.data, False
    if dry_run and data.tokenizer == BPE and not bpe_dir(config.output_dir).exists():
        _refuse_bpe(config, shape.vocab_size)
        data, bpe_pending = dataclasses.replace(data, tokenizer="bytes"), True
    else:
        data = prepare_data(config, shape.vocab_size)
    tokenizer = validate_data(data, shape.vocab_size, config.model.hf_path)
    if no_eos := missing_eos(data, tokenizer):
        notice(no_eos)
    if tokenizer is not None and (fallback := auto_bytes_note(data.tokenizer, config.model.hf_path, shape.vocab_size)):
        notice(fallback)  # the workers resolve it again with warnings held back
    if dry_run:  # the records, as training reads them at start, when that is cheap (run/dry_read.py)
        from hybridpar.train.run.dry_read import read_like_training

        if unread := read_like_training(config, data, shape.vocab_size, tokenizer, bpe_pending):
            notice(unread)
    check_sample_prompt(config, data, shape.vocab_size, meta)
    if config.model.hf_path and (problem := generation_id_problem(config.model.hf_path)):
        notice(problem)  # not used in training; the export would carry it (generate refuses it)
    if command == "check" and (why := attention_dropout_problem(config, shape, parallel_dims(config).world_size)):
        raise ConfigError(f"check cannot prove this layout: {why}")  # at once (train says it at start)
    train = config.train
    if command == "train" and train.warmup_steps > train.steps:  # allowed (an extended run warms up alike); said last
        notice(f"train.warmup_steps={train.warmup_steps} is more than train.steps={train.steps}: the learning rate "
               f"rises for the whole run and ends at {train.lr * train.steps / train.warmup_steps:.3g}, below "
               f"train.lr={train.lr:g}")
    return shape
