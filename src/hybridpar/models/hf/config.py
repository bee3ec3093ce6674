"""config.json <-> ``HybridConfig`` for Mamba2, Bamba and NemotronH checkpoints.

Each architecture's fields are mapped one by one; a field that ``HybridLM`` cannot
represent exactly is a ``ValueError`` naming it, so a loaded model is never silently
different from the checkpoint (see ``models/hf/checkpoint.py`` for tensors and files).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import torch

from hybridpar.config_rules import as_path, quoted
from hybridpar.models.hf.files import directory_kind
from hybridpar.models.hybrid import HybridConfig
from hybridpar.models.hf.generation_config import check_generation_config, config_vocab_problem, vocab_of
from hybridpar.strict_json import DuplicateKeyError, FileRefused, check_files, load_file

MAMBA2, BAMBA, NEMOTRON_H = "Mamba2ForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM"
ARCHITECTURES = (MAMBA2, BAMBA, NEMOTRON_H)
MODEL_TYPES = {MAMBA2: "mamba2", BAMBA: "bamba", NEMOTRON_H: "nemotron_h"}
CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# transformers' activation names that our MLP computes exactly (and back).
ACTIVATIONS_FROM_HF = {"silu": "silu", "swish": "silu", "relu2": "relu2", "gelu_pytorch_tanh": "gelu"}
ACTIVATIONS_TO_HF = {"silu": "silu", "relu2": "relu2", "gelu": "gelu_pytorch_tanh"}
NEMOTRON_H_LAYERS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-"}
INF = float("inf")

MAMBA_FIELDS = ("mamba_num_heads", "mamba_head_dim", "mamba_n_groups", "ssm_state_size", "conv_kernel",
                "chunk_size", "use_conv_bias", "mamba_proj_bias", "time_step_limit")
ATTENTION_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rotary_fraction",
                    "attention_bias")
MLP_FIELDS = ("intermediate_size", "mlp_activation", "mlp_gated", "mlp_bias")


def unsupported(field: str, value, rule: str) -> ValueError:
    return ValueError(f"config.json field {field}={quoted(value)} cannot be represented by HybridLM: {rule}.")


# ----------------------------------------------------------------------------- config.json


def _decode_floats(obj):
    """transformers writes inf/nan as ``{"__float__": "Infinity"}``; turn them back into floats."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(obj["__float__"].replace("Infinity", "inf"))
        return {key: _decode_floats(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_decode_floats(value) for value in obj]
    return obj


def _encode_floats(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        return {key: _encode_floats(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode_floats(value) for value in obj]
    return obj


def read_hf_config(path: str | Path) -> dict:
    """The config.json of a checkpoint directory as a dict (special floats decoded); ValueError for
    a quantized checkpoint, whose weights hybridpar can neither train nor generate from."""
    file = as_path(path, "path") / CONFIG_FILE
    check_files(path)  # a FIFO or a link to a device among its files: refused before any library opens one
    if not file.is_file():
        kind = directory_kind(path, "hf")
        raise FileNotFoundError(f"{file} not found; {kind}." if kind else
                                f"{file} not found; a Hugging Face checkpoint directory needs {CONFIG_FILE}.")
    try:
        hf = load_file(file)
    except (DuplicateKeyError, FileRefused):
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as error:  # RecursionError: nested too deep
        where = f" at line {error.lineno}, column {error.colno}" if isinstance(error, json.JSONDecodeError) else ""
        raise ValueError(f"{file} is not valid JSON{where} ({getattr(error, 'msg', error)}); restore the "
                         "checkpoint's config.json.") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{file} holds a JSON {type(hf).__name__}, not an object of config fields; restore the "
                         "checkpoint's config.json (it starts with '{').")
    if problem := config_vocab_problem(hf, file):
        raise ValueError(problem)
    check_generation_config(path, vocab_of(hf), check_ids=False)  # its ids: generate refuses, train notices
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"{Path(path)} is a quantized checkpoint (quantization_config with quant_method "
                         f"{quoted(method)}); hybridpar trains and generates from full-precision weights (no QLoRA): "
                         "use the unquantized checkpoint.")
    return _decode_floats(hf)


def architecture_of(hf: dict) -> str:
    """The causal-LM class named by ``architectures`` (or ``model_type``); ValueError if unsupported."""
    names = hf.get("architectures") or [a for a, t in MODEL_TYPES.items() if t == hf.get("model_type")]
    for name in names:
        if name in ARCHITECTURES:
            return name
    given = hf.get("architectures") or hf.get("model_type")
    raise ValueError(f"unsupported architecture {quoted(given)}; HybridLM loads and saves {list(ARCHITECTURES)}.")


def _first(hf: dict, *names, default=None):
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    return default


def _activation(hf: dict, field: str, default: str) -> str:
    name = hf.get(field, default)
    if name not in ACTIVATIONS_FROM_HF:
        raise unsupported(field, name, f"supported activations are {sorted(ACTIVATIONS_FROM_HF)}")
    return ACTIVATIONS_FROM_HF[name]


def _require(hf: dict, field: str, allowed, default, rule: str):
    value = hf.get(field, default)
    if value not in allowed:
        raise unsupported(field, value, rule)
    return value


def _no_dropout(hf: dict, *fields: str) -> None:
    for field in fields:
        _require(hf, field, (0, 0.0, None), 0.0, "HybridLM has no dropout; set it to 0.0")


def _mamba_expand_rule(hf: dict, expand_field: str, heads: int, head_dim: int) -> None:
    if hf.get(expand_field, 2) * hf["hidden_size"] != heads * head_dim:
        raise unsupported(expand_field, hf.get(expand_field, 2),
                          f"{expand_field} * hidden_size must equal num_heads * head_dim = {heads * head_dim}")


def _mamba2_fields(hf: dict) -> dict:
    _require(hf, "hidden_act", ("silu", "swish"), "silu", "the Mamba2 convolution uses SiLU")
    heads, head_dim = hf.get("num_heads", 128), hf.get("head_dim", 64)
    _mamba_expand_rule(hf, "expand", heads, head_dim)
    return dict(
        pattern="M" * hf.get("num_hidden_layers", 64), mamba_num_heads=heads, mamba_head_dim=head_dim,
        mamba_n_groups=hf.get("n_groups", 8), ssm_state_size=hf.get("state_size", 128),
        conv_kernel=hf.get("conv_kernel", 4), chunk_size=hf.get("chunk_size", 256),
        use_conv_bias=hf.get("use_conv_bias", True), mamba_proj_bias=hf.get("use_bias", False),
        time_step_limit=tuple(hf.get("time_step_limit") or (0.0, INF)), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=hf.get("tie_word_embeddings", False), initializer_range=hf.get("initializer_range", 0.1),
    )


def _bamba_fields(hf: dict) -> dict:
    activation = _activation(hf, "hidden_act", "silu")
    if activation != "silu":
        raise unsupported("hidden_act", hf["hidden_act"], "Bamba uses it for the Mamba convolution too, which is SiLU")
    _no_dropout(hf, "attention_dropout")
    _require(hf, "z_loss_coefficient", (0, 0.0, None), 0.0,
             "Bamba's loss adds this z-loss and HybridLM's loss is the cross entropy alone; set it to 0.0")
    heads = hf.get("mamba_n_heads", 128)
    head_dim = hf.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = hf.get("mamba_expand", 2) * hf["hidden_size"] // heads
    _mamba_expand_rule(hf, "mamba_expand", heads, head_dim)
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    _require(rope, "rope_type", ("default",), rope.get("type", "default"), "only plain RoPE is supported")
    num_attention_heads = hf.get("num_attention_heads", 32)
    attention_head_dim = hf.get("head_dim") or hf["hidden_size"] // num_attention_heads
    rotary_fraction = rope.get("partial_rotary_factor", 0.5)  # BambaConfig's hard-coded default
    if int(attention_head_dim * rotary_fraction) % 2:
        raise unsupported("rope_parameters.partial_rotary_factor", rotary_fraction,
                          f"it must rotate an even number of the {attention_head_dim} head channels")
    attention_layers = set(hf.get("attn_layer_indices") or ())
    return dict(
        pattern="".join("*-" if i in attention_layers else "M-" for i in range(hf.get("num_hidden_layers", 32))),
        mamba_num_heads=heads, mamba_head_dim=head_dim, mamba_n_groups=hf.get("mamba_n_groups", 1),
        ssm_state_size=hf.get("mamba_d_state", 256), conv_kernel=hf.get("mamba_d_conv", 4),
        chunk_size=hf.get("mamba_chunk_size", 256), use_conv_bias=hf.get("mamba_conv_bias", True),
        mamba_proj_bias=hf.get("mamba_proj_bias", False),
        time_step_limit=tuple(hf.get("time_step_limit") or (0.0, INF)),
        num_attention_heads=num_attention_heads, num_key_value_heads=_first(hf, "num_key_value_heads", "num_attention_heads", default=8),
        head_dim=attention_head_dim, rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rotary_fraction=float(rotary_fraction), attention_bias=hf.get("attention_bias", False),
        intermediate_size=hf.get("intermediate_size", 14336), mlp_activation=activation, mlp_gated=True,
        mlp_bias=hf.get("mlp_bias", False), norm_eps=hf.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=hf.get("tie_word_embeddings", False), initializer_range=hf.get("initializer_range", 0.02),
    )


def _nemotron_h_fields(hf: dict) -> dict:
    field = next((f for f in ("layers_block_type", "layer_types", "hybrid_override_pattern") if hf.get(f)), None)
    if field is None:
        raise unsupported("layers_block_type", None, "the list of layer kinds is required")
    layers = list(hf[field])
    for kind in layers:
        if kind not in NEMOTRON_H_LAYERS and kind not in ("M", "*", "-"):
            raise unsupported(field, kind, "supported layers are Mamba2, attention and MLP (no MoE)")
    _require(hf, "mamba_hidden_act", ("silu", "swish"), "silu", "the Mamba2 convolution uses SiLU")
    _require(hf, "num_nextn_predict_layers", (0, None), 0, "multi-token-prediction layers are not supported")
    _no_dropout(hf, "attention_dropout", "hidden_dropout")
    return dict(
        pattern="".join(NEMOTRON_H_LAYERS.get(kind, kind) for kind in layers),
        mamba_num_heads=hf.get("mamba_num_heads", 128), mamba_head_dim=hf.get("mamba_head_dim", 64),
        mamba_n_groups=_first(hf, "n_groups", "mamba_n_groups", default=8), ssm_state_size=hf.get("ssm_state_size", 128),
        conv_kernel=_first(hf, "conv_kernel", "mamba_d_conv", default=4),
        chunk_size=_first(hf, "chunk_size", "mamba_chunk_size", default=128),
        use_conv_bias=_first(hf, "use_conv_bias", "mamba_conv_bias", default=True), mamba_proj_bias=hf.get("use_bias", False),
        # NemotronHMamba2Mixer ignores config.time_step_limit and clamps dt to [time_step_min, inf).
        time_step_limit=(float(_first(hf, "time_step_min", "mamba_dt_min", default=0.001)), INF),
        num_attention_heads=hf.get("num_attention_heads", 32),
        num_key_value_heads=_first(hf, "num_key_value_heads", "num_attention_heads", default=8),
        head_dim=_first(hf, "head_dim", "attention_head_dim", default=128),  # the latter in early configs
        rotary_fraction=0.0, attention_bias=False,  # NemotronHAttention has neither RoPE nor biases
        intermediate_size=hf.get("intermediate_size", 21504), mlp_activation=_activation(hf, "mlp_hidden_act", "relu2"),
        mlp_gated=False, mlp_bias=hf.get("mlp_bias", False), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=False,  # NemotronHForCausalLM never ties lm_head to the embeddings
        initializer_range=hf.get("initializer_range", 0.02),
    )


FIELDS_FROM_HF = {MAMBA2: _mamba2_fields, BAMBA: _bamba_fields, NEMOTRON_H: _nemotron_h_fields}


def config_from_hf(hf: dict, dtype: torch.dtype = torch.float32) -> HybridConfig:
    """The ``HybridConfig`` of a config.json dict; ValueError naming any field we cannot represent."""
    architecture = architecture_of(hf)
    for field in ("vocab_size", "hidden_size"):
        if field not in hf:
            raise ValueError(f"config.json of {architecture} has no {field!r}; add it.")
    fields = FIELDS_FROM_HF[architecture](hf)
    return HybridConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], dtype=dtype, **fields)


def config_to_hf(config: HybridConfig, architecture: str) -> dict:
    """A config.json dict for ``architecture`` describing ``config``; ValueError if it cannot."""
    architecture_of({"architectures": [architecture]})
    c, pattern = config, config.pattern
    common = dict(architectures=[architecture], model_type=MODEL_TYPES[architecture], vocab_size=c.vocab_size,
                  hidden_size=c.hidden_size, tie_word_embeddings=c.tie_word_embeddings,
                  initializer_range=c.initializer_range, dtype=str(c.dtype).removeprefix("torch."))
    expand, remainder = divmod(c.mamba_intermediate_size, c.hidden_size)
    if architecture != NEMOTRON_H and (remainder or not expand):  # their configs check this even without Mamba layers
        raise ValueError(f"{architecture} needs mamba_num_heads * mamba_head_dim = {c.mamba_intermediate_size} to be "
                         f"a whole multiple of hidden_size={c.hidden_size}; change the mamba head count or size.")
    if architecture == MAMBA2:
        hf = dict(num_hidden_layers=len(pattern), num_heads=c.mamba_num_heads, head_dim=c.mamba_head_dim,
                  expand=expand, n_groups=c.mamba_n_groups, state_size=c.ssm_state_size, conv_kernel=c.conv_kernel,
                  chunk_size=c.chunk_size, use_conv_bias=c.use_conv_bias, use_bias=c.mamba_proj_bias,
                  time_step_limit=list(c.time_step_limit), hidden_act="silu", layer_norm_epsilon=c.norm_eps,
                  residual_in_fp32=False)
    elif architecture == BAMBA:
        if len(pattern) % 2 or set(pattern[1::2]) != {"-"}:
            raise ValueError(f"{BAMBA} layers are a mixer block then an MLP block; pattern {pattern!r} is not a "
                             "sequence of 'M-' and '*-' pairs.")
        if c.mlp_activation != "silu":
            raise ValueError(f"{BAMBA} uses one activation for the MLP and the Mamba convolution (SiLU); "
                             f"mlp_activation={c.mlp_activation!r} cannot be exported, set it to 'silu'.")
        hf = dict(num_hidden_layers=len(pattern) // 2, attn_layer_indices=[i for i, k in enumerate(pattern[::2]) if k == "*"],
                  mamba_n_heads=c.mamba_num_heads, mamba_d_head=c.mamba_head_dim, mamba_expand=expand,
                  mamba_n_groups=c.mamba_n_groups, mamba_d_state=c.ssm_state_size, mamba_d_conv=c.conv_kernel,
                  mamba_chunk_size=c.chunk_size, mamba_conv_bias=c.use_conv_bias, mamba_proj_bias=c.mamba_proj_bias,
                  time_step_limit=list(c.time_step_limit), num_attention_heads=c.num_attention_heads,
                  num_key_value_heads=c.num_key_value_heads, attention_bias=c.attention_bias,
                  rope_parameters=dict(rope_type="default", rope_theta=c.rope_theta, partial_rotary_factor=c.rotary_fraction),
                  intermediate_size=c.intermediate_size, hidden_act=ACTIVATIONS_TO_HF[c.mlp_activation],
                  mlp_bias=c.mlp_bias, rms_norm_eps=c.norm_eps, attention_dropout=0.0)
        if c.head_dim != c.hidden_size // c.num_attention_heads:
            hf["head_dim"] = c.head_dim
    else:
        hf = dict(layers_block_type=[{"M": "linear_attention", "*": "full_attention", "-": "mlp"}[k] for k in pattern],
                  mamba_num_heads=c.mamba_num_heads, mamba_head_dim=c.mamba_head_dim, n_groups=c.mamba_n_groups,
                  ssm_state_size=c.ssm_state_size, conv_kernel=c.conv_kernel, chunk_size=c.chunk_size,
                  expand=max(expand, 1), use_conv_bias=c.use_conv_bias, use_bias=c.mamba_proj_bias,
                  time_step_min=c.time_step_limit[0], time_step_limit=list(c.time_step_limit), mamba_hidden_act="silu",
                  num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                  head_dim=c.head_dim, attention_bias=False, intermediate_size=c.intermediate_size,
                  mlp_hidden_act=ACTIVATIONS_TO_HF[c.mlp_activation], mlp_bias=c.mlp_bias,
                  layer_norm_epsilon=c.norm_eps, residual_in_fp32=False, attention_dropout=0.0, hidden_dropout=0.0)
    hf = {**common, **hf}
    try:
        differences = config_differences(config, config_from_hf(hf, config.dtype))
    except ValueError as error:
        raise ValueError(f"{architecture} cannot represent this HybridConfig: {error}") from error
    if differences:
        raise ValueError(f"{architecture} cannot represent this HybridConfig: {'; '.join(differences)}. "
                         "Pick another architecture or change those fields.")
    return hf


def config_differences(ours: HybridConfig, theirs: HybridConfig) -> list[str]:
    """``"field: ours=... but ...=..."`` for every field that changes the model (unused kinds skipped)."""
    skipped = {"dtype", "initializer_range"}
    for kind, fields in (("M", MAMBA_FIELDS), ("*", ATTENTION_FIELDS), ("-", MLP_FIELDS)):
        if kind not in ours.pattern and kind not in theirs.pattern:
            skipped.update(fields)
    if ours.rotary_fraction == 0 and theirs.rotary_fraction == 0:
        skipped.add("rope_theta")
    return [f"{f.name}={getattr(ours, f.name)!r} becomes {getattr(theirs, f.name)!r}"
            for f in dataclasses.fields(HybridConfig)
            if f.name not in skipped and getattr(ours, f.name) != getattr(theirs, f.name)]
