"""The parameters of a ``HybridLM`` (or a planner twin) per FSDP unit, TP-local, as the TP plans
shard them, and how many blocks of a pattern hold each kind of mixer.

``unit_parameters`` gives every unit's ``ParamShape`` list (``backbone.layers.i`` and the root
``""``): Mamba2 by heads and groups (one group: ``B``/``C`` whole on every rank), column- and
row-parallel projections, vocab-parallel embedding and head, norms replicated. ``step.py`` prices
the collectives over them; ``plan/params.py`` the memory.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from hybridpar.models.hybrid import HybridConfig
from hybridpar.models.mamba.mixer import replicated_groups

__all__ = ["ParamShape", "unit_parameters", "mamba_layers", "attention_layers"]


def mamba_layers(pattern: str) -> int:
    """Blocks with a Mamba2 mixer: ``M``, and a planner twin's parallel layer ``P`` (Falcon-H1: Mamba2
    and attention side by side on one norm's output, ``plan/hf/twin.py``)."""
    return pattern.count("M") + pattern.count("P")


def attention_layers(pattern: str) -> int:
    """Blocks with an attention mixer: ``*`` and ``P``."""
    return pattern.count("*") + pattern.count("P")


@dataclass(frozen=True)
class ParamShape:
    """A parameter's TP-local shape and how TP treats it."""

    name: str
    shape: tuple[int, ...]
    tp_sharded: bool  # a Shard placement on tp (its gradient norm is reduced over tp)
    sp_norm: bool = False  # a replicated norm weight fed sequence-sharded activations (Partial grad)
    tp_sum_in_autograd: bool = False  # replicated, its TP-partial gradient summed by autograd on each pack
    float32: bool = False  # kept in float32 (parallel/precision.float32_parameters): its own FSDP unit, gathered in float32


def unit_parameters(config: HybridConfig, tp: int = 1, sequence_parallel: bool = False) -> dict[str, list[ParamShape]]:
    """TP-local parameter shapes of every FSDP unit: ``backbone.layers.i`` and the root (``""``),
    as the ``hybrid_lm_plan`` shards them (Mamba by heads and groups, column/row-parallel
    projections, vocab-parallel embedding and head; norms replicated)."""
    shape = tuple(getattr(config, f.name) for f in dataclasses.fields(config))
    units = _unit_parameters(type(config), shape, tp, sequence_parallel and tp > 1)
    return {unit: list(params) for unit, params in units.items()}  # a copy: the cached lists stay as built


@functools.lru_cache(maxsize=64)  # the planner asks again for every policy and strategy of a layout (--fit)
def _unit_parameters(kind: type, shape: tuple, tp: int, sp: bool) -> dict[str, list[ParamShape]]:
    config = kind(*shape)
    d = config.hidden_size

    def col(name, rows, cols, bias):  # rows split over tp
        return [ParamShape(f"{name}.weight", (rows // tp, cols), tp > 1)] + (
            [ParamShape(f"{name}.bias", (rows // tp,), tp > 1)] if bias else [])

    def row(name, rows, cols, bias):  # input columns split over tp, bias replicated
        return [ParamShape(f"{name}.weight", (rows, cols // tp), tp > 1)] + (
            [ParamShape(f"{name}.bias", (rows,), False)] if bias else [])

    def mamba(m: str) -> list[ParamShape]:  # by heads; B/C by groups, or whole with one group
        d_inner, heads = config.mamba_intermediate_size, config.mamba_num_heads
        gn = config.mamba_n_groups * config.ssm_state_size
        parts = dict(z=d_inner, x=d_inner, B=gn, C=gn, dt=heads)
        shared = replicated_groups(config.mamba_n_groups, tp)  # one group: B/C rows whole on every rank
        div = {c: 1 if shared and c in "BC" else tp for c in parts}  # ranks a component is split over
        params = [ParamShape(f"{m}.in_proj.weight_{c}", (n // div[c], d), div[c] > 1) for c, n in parts.items()]
        if config.mamba_proj_bias:
            params += [ParamShape(f"{m}.in_proj.bias_{c}", (n // div[c],), div[c] > 1) for c, n in parts.items()]
        conv = dict(x=d_inner, B=gn, C=gn)
        params += [ParamShape(f"{m}.conv1d.weight_{c}", (n // div[c], 1, config.conv_kernel), div[c] > 1)
                   for c, n in conv.items()]
        if config.use_conv_bias:
            params += [ParamShape(f"{m}.conv1d.bias_{c}", (n // div[c],), div[c] > 1) for c, n in conv.items()]
        params += [ParamShape(f"{m}.{p}", (heads // tp,), tp > 1) for p in ("dt_bias", "A_log", "D")]
        if getattr(config, "mamba_gated_norm", True):  # a twin's Falcon-H1 without mamba_rms_norm has none
            params += [ParamShape(f"{m}.norm.weight", (d_inner // tp,), tp > 1)]
        return params + row(f"{m}.out_proj", d, d_inner, config.mamba_proj_bias)

    def attention(m: str) -> list[ParamShape]:
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        qkv_bias = config.attention_bias or getattr(config, "qkv_bias", False)  # Qwen2 (plan/hf/twin.py)
        params = [p for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
                  for p in col(f"{m}.{name}", rows, d, qkv_bias)]
        if getattr(config, "qk_norm", False):  # Qwen3's per-head norms, replicated (plan/hf/twin.py)
            params += [ParamShape(f"{m}.{n}.weight", (config.head_dim,), False) for n in ("q_norm", "k_norm")]
        return params + row(f"{m}.o_proj", d, q, config.attention_bias)

    units: dict[str, list[ParamShape]] = {}
    for index, kind in enumerate(config.pattern):
        prefix = f"backbone.layers.{index}"
        params = [ParamShape(f"{prefix}.norm.weight", (d,), False, sp)]
        m = f"{prefix}.mixer"
        if kind == "M":
            params += mamba(m)
        elif kind == "*":
            params += attention(m)
        elif kind == "P":  # a twin's parallel layer (Falcon-H1): both mixers after one norm
            params += mamba(f"{m}.mamba") + attention(f"{m}.attention")
        elif kind == "E":  # a planner twin's MoE block: router, experts, shared experts (plan/hf/twin.py)
            params += config.moe_parameters(m, tp)
        else:
            for name in (("gate_proj", "up_proj") if config.mlp_gated else ("up_proj",)):
                params += col(f"{m}.{name}", config.intermediate_size, d, config.mlp_bias)
            params += row(f"{m}.down_proj", d, config.intermediate_size, config.mlp_bias)
        units[prefix] = params
    root = [ParamShape("backbone.embeddings.weight", (config.vocab_size // tp, d), tp > 1),
            ParamShape("backbone.norm_f.weight", (d,), False, sp)]
    if not config.tie_word_embeddings:
        root.append(ParamShape("lm_head.weight", (config.vocab_size // tp, d), tp > 1))
    units[""] = root
    return units
