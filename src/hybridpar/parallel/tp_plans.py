"""Tensor-parallel plan registry and the plans for Hugging Face causal LMs.

A plan is a dict ``{module path pattern: ParallelStyle}`` (patterns as in torch's
``parallelize_module``: dotted names, ``*`` matches one level). Plan functions have the
signature ``plan_fn(model, sequence_parallel) -> dict``. The registry is keyed by the
model class's ``f"{cls.__module__}.{cls.__qualname__}"`` (a string survives class
re-wrapping, unlike the class object), with short aliases such as ``"LlamaForCausalLM"``.

Register a plan for a new model class::

    @register_tp_plan("my_pkg.model.MyLM", aliases=("MyLM",))
    def my_lm_plan(model, sequence_parallel): ...

or lazily, by dotted path, so importing this module does not import the plan's module:
``register_tp_plan("my_pkg.model.MyLM", "my_pkg.tp:my_lm_plan")``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from hybridpar.parallel.tp_styles import (
    LocalReplicateParallel,
    RotaryEmbedParallel,
    SequenceParallelAllGatherActivation,
    VocabParallelEmbedding,
)

PlanFn = Callable[[nn.Module, bool], dict[str, ParallelStyle]]
ValidateFn = Callable[[nn.Module, int], None]

__all__ = [
    "PlanEntry", "register_tp_plan", "unregister_tp_plan", "lookup_tp_plan", "known_plan_names", "class_key",
    "hf_style", "hf_tp_plan", "default_plan",
]


def class_key(cls_or_obj) -> str:
    """``module.qualname`` of a class (or of an instance's class)."""
    cls = cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class PlanEntry:
    """One registered plan: ``fn`` (or a lazy ``"module:attr"`` path) plus capabilities.

    ``validate(model, tp)`` raises ValueError for sizes the plan cannot shard; None means
    the Hugging Face config check in ``tp.validate_tp_sizes``.
    """

    key: str
    fn: PlanFn | str
    aliases: tuple[str, ...] = ()
    sequence_parallel: bool = True
    validate: ValidateFn | None = None
    doc: str = field(default="", repr=False)

    def resolve(self) -> PlanFn:
        if isinstance(self.fn, str):
            module_name, _, attr = self.fn.partition(":")
            try:
                self.fn = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as err:
                raise ValueError(
                    f"TP plan {self.key!r} points to {self.fn!r}, which cannot be imported ({err}); "
                    "pass an explicit plan dict to apply_tp until that plan exists"
                ) from err
        return self.fn


_REGISTRY: dict[str, PlanEntry] = {}
_ALIASES: dict[str, str] = {}


def register_tp_plan(key: str, fn: PlanFn | str | None = None, *, aliases=(), sequence_parallel: bool = True,
                     validate: ValidateFn | None = None, replace: bool = False):
    """Register ``fn`` under ``key`` (a class ``module.qualname`` or a plan name); decorator if fn is None."""

    def add(plan_fn):
        names = (key, *aliases)
        if not replace:
            taken = [n for n in names if n in _REGISTRY or _ALIASES.get(n, key) != key]
            if taken:
                raise ValueError(f"TP plan name(s) {taken} already registered; pass replace=True to override")
        _REGISTRY[key] = PlanEntry(key, plan_fn, tuple(aliases), sequence_parallel, validate)
        for alias in aliases:
            _ALIASES[alias] = key
        return plan_fn

    return add if fn is None else add(fn)


def unregister_tp_plan(key: str) -> None:
    """Remove a registered plan and its aliases (no-op if absent)."""
    entry = _REGISTRY.pop(key, None)
    for alias in entry.aliases if entry else ():
        _ALIASES.pop(alias, None)


def lookup_tp_plan(name: str) -> PlanEntry | None:
    """The entry registered under a key or an alias, else None."""
    return _REGISTRY.get(_ALIASES.get(name, name))


def known_plan_names() -> list[str]:
    return sorted(set(_REGISTRY) | set(_ALIASES))


# --------------------------------------------------------------------------------------
# Hugging Face string styles -> DTensor ParallelStyles


def hf_style(name: str) -> ParallelStyle:
    """A fresh DTensor ParallelStyle for one of Hugging Face's ``tp_plan`` strings."""
    table = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: VocabParallelEmbedding(),
        "embedding_colwise": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "replicated_with_grad_allreduce": lambda: LocalReplicateParallel(grad_allreduce=True),
        "replicate": lambda: LocalReplicateParallel(),
        "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    }
    if name not in table:
        raise ValueError(
            f"Hugging Face TP style {name!r} is not supported (supported: {sorted(table)}); "
            "pass an explicit plan dict of ParallelStyles for the modules that use it"
        )
    return table[name]()


def hf_tp_plan(model: nn.Module) -> dict[str, ParallelStyle] | None:
    """The model's own Hugging Face plan (``model.tp_plan``: class ``_tp_plan`` plus the
    prefixed ``config.base_model_tp_plan``) as DTensor styles; None if it has none or it
    only covers the LM head (then it shards nothing worth having)."""
    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    if not any(k != "lm_head" for k in plan):
        return None
    embed = getattr(getattr(model, "base_model", None), "embed_tokens", None)
    prefix = getattr(model, "base_model_prefix", "model")
    if isinstance(embed, nn.Embedding) and not any(k.endswith("embed_tokens") for k in plan):
        plan[f"{prefix}.embed_tokens"] = "embedding_rowwise"
    return {pattern: hf_style(style) for pattern, style in plan.items()}


# --------------------------------------------------------------------------------------
# Plans. Non-SP: activations replicated between blocks; norms replicated (LocalReplicate).
# SP: the residual stream is a Shard(1) DTensor [B, S/tp, D]; norms feeding projections
# all-gather once; o_proj/down_proj reduce-scatter back to Shard(1).


def _decoder_plan(sequence_parallel: bool, *, prefix: str = "model", attn=("q_proj", "k_proj", "v_proj"),
                  attn_out: str = "o_proj", mlp: str = "mlp", mlp_in=("gate_proj", "up_proj"),
                  mlp_out: str = "down_proj", pre_attn_norm: str = "input_layernorm",
                  pre_mlp_norm: str | None = "post_attention_layernorm", post_norms=(), head_norms=(),
                  final_norm: str = "norm") -> dict[str, ParallelStyle]:
    """A Llama-shaped decoder plan; names are relative to one decoder layer.

    ``post_norms`` normalize a block's output before the residual add (Gemma3);
    ``head_norms`` normalize per head on head-sharded activations (Qwen3 q_norm/k_norm),
    so their gradients are summed over TP.
    """
    layer = f"{prefix}.layers.*"
    plan: dict[str, ParallelStyle] = {f"{layer}.self_attn.{p}": ColwiseParallel() for p in attn}
    plan.update({f"{layer}.{mlp}.{p}": ColwiseParallel() for p in mlp_in})
    plan.update({f"{layer}.self_attn.{n}": LocalReplicateParallel(grad_allreduce=True) for n in head_norms})
    in_norms = [n for n in (pre_attn_norm, pre_mlp_norm) if n]
    if not sequence_parallel:
        plan[f"{prefix}.embed_tokens"] = VocabParallelEmbedding()
        plan[f"{layer}.self_attn.{attn_out}"] = RowwiseParallel()
        plan[f"{layer}.{mlp}.{mlp_out}"] = RowwiseParallel()
        for norm in (*in_norms, *post_norms):
            plan[f"{layer}.{norm}"] = LocalReplicateParallel()
        plan[f"{prefix}.{final_norm}"] = LocalReplicateParallel()
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
        return plan
    # [B, S] ids -> [B, S/tp, D] DTensor
    plan[f"{prefix}.embed_tokens"] = VocabParallelEmbedding(output_layouts=Shard(1), use_local_output=False)
    plan[f"{prefix}.rotary_emb"] = RotaryEmbedParallel()
    # [B, S/tp, D] -> [B, S, D] once per norm, then head/column-sharded projections
    for norm in in_norms:
        plan[f"{layer}.{norm}"] = SequenceParallelAllGatherActivation(use_local_output=False)
    # [B, S, D] partial sums -> reduce-scatter -> [B, S/tp, D]
    plan[f"{layer}.self_attn.{attn_out}"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    plan[f"{layer}.{mlp}.{mlp_out}"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    for norm in post_norms:
        plan[f"{layer}.{norm}"] = SequenceParallel()
    plan[f"{prefix}.{final_norm}"] = SequenceParallel()
    # [B, S/tp, D] -> all-gather -> [B, S, V/tp] -> all-gather -> [B, S, V]
    plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plan


_HF = "transformers.models"


@register_tp_plan(f"{_HF}.llama.modeling_llama.LlamaForCausalLM", aliases=("LlamaForCausalLM",))
@register_tp_plan(f"{_HF}.mistral.modeling_mistral.MistralForCausalLM", aliases=("MistralForCausalLM",))
@register_tp_plan(f"{_HF}.qwen2.modeling_qwen2.Qwen2ForCausalLM", aliases=("Qwen2ForCausalLM",))
def llama_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Llama, Mistral, Qwen2: q/k/v, gate/up column-parallel; o/down row-parallel."""
    return _decoder_plan(sequence_parallel)


@register_tp_plan(f"{_HF}.qwen3.modeling_qwen3.Qwen3ForCausalLM", aliases=("Qwen3ForCausalLM",))
def qwen3_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Qwen3: Llama plus per-head q_norm/k_norm on local heads (gradients summed over TP)."""
    return _decoder_plan(sequence_parallel, head_norms=("q_norm", "k_norm"))


@register_tp_plan(f"{_HF}.gemma3.modeling_gemma3.Gemma3ForCausalLM", aliases=("Gemma3ForCausalLM",))
def gemma3_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Gemma3: scaled embedding, four norms per layer (two after the blocks), q/k norms."""
    plan = _decoder_plan(sequence_parallel, pre_mlp_norm="pre_feedforward_layernorm",
                         post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
                         head_norms=("q_norm", "k_norm"))
    if sequence_parallel:
        plan["model.rotary_emb_local"] = RotaryEmbedParallel()  # older Gemma3 versions
    return plan


@register_tp_plan(f"{_HF}.phi.modeling_phi.PhiForCausalLM", aliases=("PhiForCausalLM",))
def phi_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Phi (Phi-2): attention output ``dense``, MLP ``fc1``/``fc2``, one LayerNorm per layer
    shared by the parallel attention and MLP branches, optional per-head q/k LayerNorms."""
    return _decoder_plan(sequence_parallel, attn_out="dense", mlp_in=("fc1",), mlp_out="fc2",
                         pre_mlp_norm=None, head_norms=("q_layernorm", "k_layernorm"),
                         final_norm="final_layernorm")


@register_tp_plan(f"{_HF}.falcon_h1.modeling_falcon_h1.FalconH1ForCausalLM", aliases=("FalconH1ForCausalLM",))
def falcon_h1_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Falcon-H1: attention and MLP (``feed_forward``) sharded; the parallel Mamba2 branch is
    replicated (seed 004). Under SP the Mamba branch reads the all-gathered norm output and
    its replicated output joins the sequence-sharded attention output as a DTensor."""
    plan = _decoder_plan(sequence_parallel, mlp="feed_forward", pre_mlp_norm="pre_ff_layernorm",
                         final_norm="final_layernorm")
    plan["model.layers.*.mamba"] = LocalReplicateParallel(output_as_dtensor=sequence_parallel)
    return plan


@register_tp_plan("default", aliases=("llama_style",))
def default_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Generic fallback for Llama-shaped models (``model.layers.*.self_attn``/``mlp``);
    fused ``qkv_proj``/``gate_up_proj`` are left out: a plain column split of a fused
    weight mixes q, k and v rows."""
    return _decoder_plan(sequence_parallel)


# Our own model: the plan (Mamba2 mixer by heads, attention, MLP, vocab-parallel embedding
# and head) lives in hybridpar.parallel.tp_hybrid and is imported on first use.
register_tp_plan("hybridpar.models.hybrid.HybridLM", "hybridpar.parallel.tp_hybrid:hybrid_lm_plan",
                 aliases=("HybridLM",))
