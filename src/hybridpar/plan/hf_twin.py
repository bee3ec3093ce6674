"""A transformers decoder planned through its ``HybridLM`` twin: the same widths, pattern ``*-`` per layer.

A Llama-family decoder layer computes ``h = x + attn(norm(x)); y = h + mlp(norm(h))``: HybridLM's
attention block followed by its gated-MLP block, with the same parameters (q, k, v, o; gate, up,
down; two RMSNorm weights), so the planner's shape formulas for memory, traffic and time apply to
it. The twin is taken only where both sides hold the same parameters (counted on transformers'
meta model), for the model types whose measured step it was held to (``TWIN_MODEL_TYPES``;
``tests/plan/test_plan_hf.py``, ``benchmarks/planner.py --models llama``).

What transformers' code keeps beyond the twin (``Layout.hf_decoder``, ``plan/activations.py``):
its RMSNorm keeps the normalized product ``x * rstd`` in float32 before the weight multiply (one
``[Ts, D]`` float32 per norm, two per layer), and under ``full``/``selective`` checkpointing a whole
decoder layer is one checkpoint that keeps one input, not one per block.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.models.hybrid import HybridConfig

__all__ = ["TWIN_MODEL_TYPES", "TwinConfig", "hybrid_twin"]

TWIN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "bamba", "nemotron_h")
# Mamba2 hybrids: mapped field by field as models/hf/config.py loads them (Bamba M- / *- per layer)
MAMBA_HYBRIDS = {"bamba": "BambaForCausalLM", "nemotron_h": "NemotronHForCausalLM"}


@dataclass
class TwinConfig(HybridConfig):
    """A HybridLM shape with what a transformers attention holds beyond it, priced by the planner only
    (never built): ``qkv_bias``, Qwen2's biases on q, k and v and none on o (column-parallel, so split
    over TP like their weights; ``parallel.comm.step.unit_parameters``)."""

    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm weights [head_dim] on q and k per head, replicated over TP
    paired_layers: bool = True  # a decoder layer is a mixer block then an MLP block (NemotronH: one block)


def hybrid_twin(config, parameters: int) -> tuple[HybridConfig | None, str]:
    """``(twin, "")`` for a transformers ``config`` whose model holds ``parameters`` elements, or
    ``(None, why not)``."""
    model_type = getattr(config, "model_type", None)
    if model_type not in TWIN_MODEL_TYPES:
        return None, f"activations and traffic are modelled for HybridLM and {', '.join(TWIN_MODEL_TYPES)} models"
    if model_type in MAMBA_HYBRIDS:
        twin, why = _mamba_hybrid_twin(config)
        if twin is None:
            return None, why
    elif getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return None, f"{model_type} with hidden_act={config.hidden_act!r}/mlp_bias is not a gated SiLU MLP"
    else:
        twin = _decoder_twin(config, model_type)
    from hybridpar.plan.params import parameter_count

    if parameter_count(twin) != parameters:
        return None, (f"its {parameters:,} parameters are not the {parameter_count(twin):,} of a plain "
                      f"{model_type} decoder of its widths")
    return twin, ""


def _mamba_hybrid_twin(config) -> tuple[TwinConfig | None, str]:
    """A Bamba's or dense NemotronH's twin: the ``HybridConfig`` its checkpoint loads as natively
    (``models/hf/config.py``; a NemotronH with MoE layers is refused there, with the reason)."""
    import dataclasses

    from hybridpar.models.hf.config import config_from_hf

    try:
        native = config_from_hf({**config.to_dict(), "architectures": [MAMBA_HYBRIDS[config.model_type]]})
    except ValueError as error:
        return None, f"its HybridLM twin cannot hold it ({str(error).rstrip('.')})"
    fields = {f.name: getattr(native, f.name) for f in dataclasses.fields(native)}
    return TwinConfig(**fields, paired_layers=config.model_type == "bamba"), ""


def _decoder_twin(config, model_type: str) -> TwinConfig:
    """A Llama-family decoder's twin: pattern ``*-`` per layer."""
    heads = config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    return TwinConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, pattern="*-" * config.num_hidden_layers,
        num_attention_heads=heads, num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        rotary_fraction=rope.get("partial_rotary_factor", 1.0), attention_bias=bool(getattr(config, "attention_bias", False)),
        intermediate_size=config.intermediate_size, mlp_activation="silu", mlp_gated=True,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)), qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3")
