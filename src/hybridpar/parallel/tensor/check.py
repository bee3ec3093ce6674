"""Checks a tensor-parallel plan must pass before anything is sharded (no collective runs here).

For every module a plan entry matches:

- its style fits the module: torch's ``ColwiseParallel``/``RowwiseParallel`` take ``nn.Linear``
  and ``nn.Embedding`` only (GPT-2's ``Conv1D`` has a transposed weight: it needs the
  ``Conv1D*Parallel`` styles); our own styles run their ``check(name, module, tp)``;
- sharded dims divide by ``tp``: a column-parallel weight's output features, a row-parallel
  weight's input features (vocab dims of embeddings and LM heads may be uneven);
- a row-parallel projection reading a column shard has its producers sharded: every other
  linear layer (``nn.Linear``/``Conv1D``) in the same parent module has a plan entry and at
  least one of them is column-parallel (a fallback plan naming ``down_proj`` but not a fused
  ``gate_up_proj`` would feed it a whole tensor taken for a shard);
- with FSDP (``data_parallel``), no ``nn.Linear`` weight is packed on dim 0 (FSDP shards dim 0);
- heads stay whole: a column-parallel projection inside a module with ``head_dim`` gives
  every rank whole heads, and the module's forward does not reshape or split with a
  head-count attribute (``self.num_heads``, ``self.config.num_attention_heads``, ...) unless
  the plan makes it per-rank (``LocalHeadCounts``).

With sequence parallelism the residual stream is a ``Shard(1)`` DTensor, so the plan must
cover it: every module holding parameters is named by an entry (or lies inside one), and
every entry on a direct child of a decoder layer or of the base model (norms, embeddings,
mixers; the LM head, which returns the model's output, aside) returns a DTensor. Otherwise
the uncovered modules are named in a ``ValueError`` (a plain tensor added to the stream fails
with "mixed torch.Tensor and DTensor", or worse, a full-sequence tensor taken for a shard
doubles the sequence).
"""

from __future__ import annotations

import functools
import inspect
import re
from fnmatch import fnmatch

import torch.nn as nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from hybridpar.parallel.tensor.linear_styles import LocalHeadCounts, PackedColwiseParallel, is_conv1d
from hybridpar.parallel.tensor.styles import LocalReplicateParallel

__all__ = ["validate_tp_sizes", "refuse_attention_sinks", "matches", "matched_modules", "check_plan", "sp_uncovered", "compress_names"]

_SIZE_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")  # experts: their own check
_HEAD_ATTRIBUTE = re.compile(r"self\.(config\.)?(num_heads|num_attention_heads|num_key_value_heads|n_head|"
                             r"split_size|hidden_size|embed_dim|all_head_size)\b")


def validate_tp_sizes(model: nn.Module, tp: int) -> None:
    """Head, KV-head and MLP sizes of a Hugging Face config must be divisible by ``tp``."""
    config = getattr(model, "config", None)
    if config is None:
        return
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for field in _SIZE_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value % tp != 0:
            raise ValueError(
                f"config.{field}={value} is not divisible by tp={tp}; choose a tp that divides {value} "
                f"(column-parallel projections split {field} evenly across TP ranks)"
            )


def refuse_attention_sinks(model: nn.Module, tp: int, styles: dict[str, ParallelStyle]) -> None:
    """``ValueError`` at ``tp > 1`` for an attention module with sinks (one logit per query head,
    ``models/attention/sinks.py``) that no entry of ``styles`` shards with its heads
    (``shards_sinks``: ``plans_gpt_oss.HeadShardedSinks``)."""
    if tp > 1:
        for name, module in model.named_modules():
            if isinstance(getattr(module, "sinks", None), nn.Parameter) and not any(
                    getattr(style, "shards_sinks", False) and matches(name, pattern) for pattern, style in styles.items()):
                raise ValueError(f"tensor parallelism for {type(model).__name__}: {name} has attention sinks (one logit per "
                                 "query head), which its TP plan does not shard with its heads; use parallel.tp=1 (FSDP "
                                 "and context parallelism apply) or a plan with HeadShardedSinks.")


@functools.lru_cache(maxsize=1 << 16)  # a check compares every module name with every entry: reused by --fit
def matches(path: str, pattern: str) -> bool:
    """``parallelize_module`` matching: same number of dotted atoms, fnmatch per atom."""
    atoms, tokens = path.split("."), pattern.split(".")
    return len(atoms) == len(tokens) and all(fnmatch(a, t) for a, t in zip(atoms, tokens))


def matched_modules(model: nn.Module, styles: dict[str, ParallelStyle]) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """(name, module, style) for every module a plan entry matches ("" is the root)."""
    modules = dict(model.named_modules())
    return [(name, module, style) for pattern, style in styles.items()
            for name, module in modules.items() if (name == pattern == "") or (name and matches(name, pattern))]


def compress_names(names) -> list[str]:
    """Layer indices folded to ``*``, duplicates dropped, order kept."""
    return list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names))


def _fail(name: str, message: str) -> None:
    raise ValueError(f"TP plan entry for {name!r}: {message}")


@functools.lru_cache(maxsize=None)
def _head_attributes(cls: type) -> frozenset[str]:
    """Head-count attributes ``cls.forward`` reads (``config.`` prefixed for config fields)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return frozenset()
    return frozenset(f"{cfg or ''}{attr}" for cfg, attr in _HEAD_ATTRIBUTE.findall(source))


def _check_heads(name: str, module: nn.Module, parent_name: str, parent: nn.Module, local_attrs, tp: int) -> None:
    out_features = module.weight.shape[0] if isinstance(module, nn.Linear) else getattr(module, "nf", 0)
    head_dim = getattr(parent, "head_dim", None) or getattr(parent, "head_size", None)
    if isinstance(head_dim, int) and (out_features // tp) % head_dim:
        _fail(name, f"{out_features} output features over tp={tp} split a head of {type(parent).__name__} "
                    f"(head_dim={head_dim}); the head counts must be divisible by tp")
    unpatched = sorted(_head_attributes(type(parent)) - set(local_attrs))
    if unpatched:
        _fail(name, f"{type(parent).__name__}.forward ({parent_name!r}) reshapes or splits with {unpatched}, which "
                    "would still be the global head counts on a column shard; register a plan that makes them "
                    "per-rank (LocalHeadCounts) or gathers the projection output (ColwiseParallel(output_layouts="
                    "Replicate())), or use tp=1")


def _column_sharded(style: ParallelStyle) -> bool:
    """Does the style leave the module's output split over TP columns?"""
    if isinstance(style, PackedColwiseParallel):
        return True
    return isinstance(style, ColwiseParallel) and isinstance(style.output_layouts[0], Shard)


def _check_entry(name: str, module: nn.Module, style: ParallelStyle, tp: int) -> None:
    if hasattr(style, "check"):
        style.check(name, module, tp)
        return
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return
    kind = type(style).__name__
    if is_conv1d(module):
        _fail(name, f"{kind} treats the weight as nn.Linear's [out, in], but a Hugging Face Conv1D stores [in, out]; "
                    "use Conv1DColwiseParallel / Conv1DRowwiseParallel")
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        _fail(name, f"{kind} supports nn.Linear and nn.Embedding, got {type(module).__name__}")
    if isinstance(module, nn.Embedding):
        return  # vocab rows or embedding columns may shard unevenly
    if isinstance(style, ColwiseParallel) and _column_sharded(style) and module.weight.shape[0] % tp:
        _fail(name, f"column-parallel output features {module.weight.shape[0]} are not divisible by tp={tp}")
    if isinstance(style, RowwiseParallel) and isinstance(style.input_layouts[0], Shard) and module.weight.shape[1] % tp:
        _fail(name, f"row-parallel input features {module.weight.shape[1]} are not divisible by tp={tp}")


def _check_row_inputs(name: str, parent: nn.Module, parent_name: str, styles_by_name: dict) -> None:
    """A row-parallel entry with a sharded input needs column-parallel producers next to it."""
    siblings = [f"{parent_name}.{child}" if parent_name else child for child, module in parent.named_children()
                if isinstance(module, nn.Linear) or is_conv1d(module)]
    unplanned = [s for s in siblings if s != name and s not in styles_by_name]
    fix = ("shard the producing projections (ColwiseParallel, PackedColwiseParallel for fused ones) or give this "
           "entry RowwiseParallel(input_layouts=Replicate())")
    if unplanned:
        _fail(name, f"its row-parallel input is a column shard, but {unplanned} in {type(parent).__name__} "
                    f"{'has' if len(unplanned) == 1 else 'have'} no plan entry (an output left whole); {fix}")
    if not any(_column_sharded(style) for s in siblings for style in styles_by_name.get(s, ())):
        _fail(name, f"its row-parallel input is a column shard, but no projection in {type(parent).__name__} "
                    f"is column-parallel; {fix}")


def _stream_parents(model: nn.Module) -> set[str]:
    """Modules whose children read or write the residual stream: the root, the base model,
    and every element of a module list (a decoder layer) that is not itself inside a decoder
    layer (Zamba2's per-layer adapter lists are not layers)."""
    names = {""}
    base = getattr(model, "base_model", None)
    layers: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if module is base:
            names.add(name)
        if isinstance(module, nn.ModuleList) and not name.startswith(layers):
            elements = [f"{name}.{child}" if name else child for child, _ in module.named_children()]
            names.update(elements)
            layers += tuple(f"{element}." for element in elements)
    return names


def _returns_plain(style: ParallelStyle) -> bool:
    if isinstance(style, LocalReplicateParallel):
        return style.output_layouts is None
    return getattr(style, "use_local_output", None) is True


def _prefixes(name: str) -> list[str]:
    atoms = name.split(".")
    return [".".join(atoms[:i]) for i in range(1, len(atoms) + 1)]


def sp_uncovered(model: nn.Module, entries) -> list[str]:
    """The outermost modules holding parameters that no plan entry names or contains
    (parameters a module shards itself, ``tensor_model_parallel``, aside)."""
    covered = {name for name, _, _ in entries}
    if "" in covered:  # a root entry covers everything
        return []
    holds_covered = {prefix for name in covered if name for prefix in _prefixes(name)}
    uncovered = []
    for name, module in model.named_modules():
        params = [p for p in module._parameters.values() if p is not None and not getattr(p, "tensor_model_parallel", False)]
        if not params or not name or any(prefix in covered for prefix in _prefixes(name)):
            continue
        # a module whose children are covered but whose own parameters are not (e.g. a gated DeltaNet's
        # A_log beside a planned in_proj) is itself the outermost uncovered holder
        top = next((prefix for prefix in _prefixes(name) if prefix not in holds_covered), name)
        if top not in uncovered:
            uncovered.append(top)
    return uncovered


def check_plan(model: nn.Module, styles: dict[str, ParallelStyle], tp: int, sequence_parallel: bool,
               data_parallel: bool = False) -> None:
    """Raise ValueError if the plan does not fit ``model`` at ``tp`` (see the module docstring);
    ``data_parallel``: FSDP will shard dim 0 of every parameter as well."""
    entries = matched_modules(model, styles)
    packed_dim0 = [name for name, module, style in entries
                   if isinstance(style, PackedColwiseParallel) and isinstance(module, nn.Linear)]
    if data_parallel and packed_dim0:
        raise ValueError(
            f"{compress_names(packed_dim0)}: PackedColwiseParallel shards an nn.Linear weight on dim 0 with a stride "
            "(_StridedShard), which FSDP's dim-0 shard cannot compose with; use ColwiseParallel(output_layouts="
            "Replicate()) for these projections (gathered output) or run without data/context parallelism")
    modules = dict(model.named_modules())
    local_attrs: dict[str, tuple[str, ...]] = {}
    for name, _, style in entries:
        if isinstance(style, LocalHeadCounts):
            local_attrs[name] = local_attrs.get(name, ()) + style.names
    styles_by_name: dict[str, list[ParallelStyle]] = {}
    for name, _, style in entries:
        styles_by_name.setdefault(name, []).append(style)
    for name, module, style in entries:
        _check_entry(name, module, style, tp)
        parent_name = name.rpartition(".")[0]
        if _column_sharded(style) and (isinstance(module, nn.Linear) or is_conv1d(module)):
            _check_heads(name, module, parent_name, modules[parent_name], local_attrs.get(parent_name, ()), tp)
        if isinstance(style, RowwiseParallel) and isinstance(style.input_layouts[0], Shard) and name:
            if isinstance(module, nn.Linear) or is_conv1d(module):
                _check_row_inputs(name, modules[parent_name], parent_name, styles_by_name)
    if not sequence_parallel:
        return
    uncovered = sp_uncovered(model, entries)
    if uncovered:
        raise ValueError(
            f"sequence parallelism needs a plan entry for every module that holds parameters (the residual stream "
            f"is sequence-sharded); the plan leaves {compress_names(uncovered)} uncovered. Set "
            "sequence_parallel=False or register a plan that covers them (register_tp_plan)")
    parents = _stream_parents(model)
    head = getattr(model, "get_output_embeddings", lambda: None)() or getattr(model, "lm_head", None)
    plain = [name for name, module, style in entries
             if name.rpartition(".")[0] in parents and module is not head
             and any(p is not None for p in module.parameters()) and _returns_plain(style)]
    if plain:
        raise ValueError(
            f"under sequence parallelism {compress_names(plain)} sit on the residual stream but their plan entries "
            "return plain tensors; give them sequence-parallel styles (SequenceParallel, "
            "LocalReplicateParallel(output_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1), "
            "use_local_output=False)) or set sequence_parallel=False")
