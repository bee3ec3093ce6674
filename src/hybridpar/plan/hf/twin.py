"""A transformers decoder planned through its ``HybridLM`` twin: the same widths, pattern ``*-`` per layer.

A Llama-family decoder layer computes ``h = x + attn(norm(x)); y = h + mlp(norm(h))``: HybridLM's
attention block followed by its gated-MLP block, with the same parameters (q, k, v, o; gate, up,
down; two RMSNorm weights), so the planner's shape formulas for memory, traffic and time apply to
it. The twin is taken only where both sides hold the same parameters (counted on transformers'
meta model), for the model types whose measured step it was held to (``TWIN_MODEL_TYPES``;
``tests/plan/test_plan_hf.py``, ``benchmarks/planner.py --models llama``).

What transformers' code keeps beyond the twin (``Layout.hf_decoder``, ``plan/activations.py``):
its RMSNorm keeps the normalized product ``x * rstd`` in float32 before the weight multiply (one
``[Ts, D]`` float32 per norm, two per layer) where hybridpar does not run its own norm in its place
(``lean_norms``: a Llama-form norm, not under sequence parallelism), and under
``full``/``selective`` checkpointing a whole decoder layer is one checkpoint that keeps one input,
not one per block.

Falcon-H1: per layer a parallel block ``P`` (its Mamba2 mixer and its attention side by side on one
norm's output, each branch reading its own multiplied copy; their outputs summed) then its MLP ``-``,
which runs transformers' forward (its multipliers: the gate's scaled copy is kept too).

Mamba2 hybrids: Bamba and NemotronH through the ``HybridConfig`` their checkpoints load as natively;
a NemotronH's MoE layers (``moe``) and every GraniteMoeHybrid layer's feed-forward half (MoE plus its
``shared_mlp``) are blocks of kind ``E`` (``plan/hf/moe.py``); a dense Granite's ``shared_mlp`` is the
gated MLP block ``-`` (``mlp_fused``: one ``[gate | up]`` ``input_linear``, gathered under TP).

Zamba2: ``M`` per Mamba layer, ``ZM`` per hybrid layer, ``Z`` one use of a shared transformer block
(weights counted once per distinct block, adapters per use; ``plan/hf/zamba2.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.models.hf.router_aux import router_aux_coefficient
from hybridpar.models.hybrid import HybridConfig

__all__ = ["TWIN_MODEL_TYPES", "TwinConfig", "hybrid_twin"]

TWIN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba2")
# Mamba2 hybrids: mapped field by field as models/hf/config.py loads them (Bamba M- / *- per layer)
MAMBA_HYBRIDS = {"bamba": "BambaForCausalLM", "nemotron_h": "NemotronHForCausalLM"}


@dataclass
class TwinConfig(HybridConfig):
    """A HybridLM shape with what a transformers attention holds beyond it, priced by the planner only
    (never built): ``qkv_bias``, Qwen2's biases on q, k and v and none on o (column-parallel, so split
    over TP like their weights; ``parallel.comm.step.unit_parameters``)."""

    qkv_bias: bool = False
    lean_norms: bool = False  # its hidden-state RMSNorms run blocks.rms_norm (models/hf/activations.py)
    lean_gated_norms: bool = False  # its Mamba mixers' gated norms run blocks.gated_rms_norm (the same)
    qk_norm: bool = False  # Qwen3: RMSNorm weights [head_dim] on q and k per head, replicated over TP
    paired_layers: bool = True  # a decoder layer is a mixer block then an MLP block (NemotronH: one block)
    mamba_gated_norm: bool = True  # False: y * silu(z), no norm weight (Falcon-H1 without mamba_rms_norm)
    mlp_multipliers: bool = False  # transformers' gated MLP with Falcon-H1's multipliers: act's input kept too
    summed_branches: bool = False  # its layers reduce their branches once, with the residual (Falcon-H1, Granite)
    mlp_fused: bool = False  # Granite's shared_mlp: one [gate | up] input_linear, its output gathered under TP
    # MoE blocks (pattern "E"; plan/hf/moe.py): router [E, D] (replicated), experts split over TP on
    # their intermediate dim, shared experts (NemotronH's ungated MLP, Granite's fused gated shared_mlp)
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate_size: int = 0
    moe_gated: bool = False  # experts [gate | up] (Granite) or up only (NemotronH, relu2)
    moe_shared_size: int = 0  # the shared experts' intermediate size (0: none)
    moe_router: str = "softmax"  # "softmax" of the top-k logits (Granite) or "sigmoid" with groups (NemotronH)
    moe_router_float32: bool = False  # transformers keeps gate.weight in float32 (NemotronH's strict list)
    moe_groups: tuple[int, int] = (1, 1)  # NemotronH's n_group, topk_group
    moe_norm_topk: bool = False  # NemotronH's norm_topk_prob
    moe_latent_size: int = 0  # NemotronH's fc1/fc2_latent_proj [L, D], [D, L] around the experts (0: none)
    moe_router_logits: bool = False  # output_router_logits: every router's [Tc, E] logits kept to the forward's end
    moe_aux_loss: bool = False  # and the trainer adds their load-balancing loss (plan/hf/moe.router_aux_bytes)
    # Zamba2 (pattern "Z": a shared block's use and its layer's linear; plan/hf/zamba2.py)
    shared_blocks: int = 0  # num_mem_blocks, the distinct shared blocks (0: not a Zamba2)
    shared_adapter_rank: int = 0  # adapter_rank of the per-use adapters
    shared_attention_adapters: bool = False  # use_shared_attention_adapter: q, k, v adapters too

    def validate(self) -> None:
        """HybridConfig's rules, with ``E`` (a MoE block, priced by the planner only) read as an MLP block,
        ``P`` as Mamba2 and ``Z`` (a Zamba2 shared block's use) as attention."""
        pattern, self.pattern = self.pattern, self.pattern.replace("E", "-").replace("P", "M").replace("Z", "*")
        try:
            super().validate()
        finally:
            self.pattern = pattern

    def moe_parameters(self, prefix: str, tp: int) -> list:
        """TP-local shapes of an ``E`` block's mixer (``parallel.comm.step.unit_parameters`` adds its norm)."""
        from hybridpar.parallel.comm.step import ParamShape

        d, e, inter, shared = self.hidden_size, self.moe_experts, self.moe_intermediate_size, self.moe_shared_size
        sharded, width = tp > 1, self.moe_latent_size or d  # the experts read and write the latent width
        up = "gate_up_proj" if self.moe_gated else "up_proj"
        params = [ParamShape(f"{prefix}.gate.weight", (e, d), False, float32=self.moe_router_float32),
                  ParamShape(f"{prefix}.experts.{up}", (e, (2 if self.moe_gated else 1) * inter // tp, width), sharded),
                  ParamShape(f"{prefix}.experts.down_proj", (e, width, inter // tp), sharded)]
        if self.moe_latent_size:  # replicated over TP (parallel/tensor/moe.py: LocalReplicateParallel)
            params += [ParamShape(f"{prefix}.fc1_latent_proj.weight", (width, d), False),
                       ParamShape(f"{prefix}.fc2_latent_proj.weight", (d, width), False)]
        if shared and self.mlp_fused:  # Granite's shared_mlp: input_linear [2 Is, D], output_linear [D, Is]
            params += [ParamShape(f"{prefix}.shared.input_linear.weight", (2 * shared // tp, d), sharded),
                       ParamShape(f"{prefix}.shared.output_linear.weight", (d, shared // tp), sharded)]
        elif shared:  # NemotronH's shared experts: up [Is, D], down [D, Is]
            params += [ParamShape(f"{prefix}.shared.up_proj.weight", (shared // tp, d), sharded),
                       ParamShape(f"{prefix}.shared.down_proj.weight", (d, shared // tp), sharded)]
        return params


def hybrid_twin(config, parameters: int) -> tuple[HybridConfig | None, str]:
    """``(twin, "")`` for a transformers ``config`` whose model holds ``parameters`` elements, or
    ``(None, why not)``."""
    model_type = getattr(config, "model_type", None)
    if model_type not in TWIN_MODEL_TYPES:
        return None, f"activations and traffic are modelled for HybridLM and {', '.join(TWIN_MODEL_TYPES)} models"
    if model_type in MAMBA_HYBRIDS or model_type in ("granitemoehybrid", "falcon_h1", "zamba2"):
        build = {"granitemoehybrid": granite_twin, "falcon_h1": falcon_twin, "zamba2": zamba2_twin}.get(
            model_type, _mamba_hybrid_twin)
        twin, why = build(config)
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
    """A Bamba's or NemotronH's twin: the ``HybridConfig`` its checkpoint loads as natively
    (``models/hf/config.py``), a NemotronH's ``moe`` layers as MoE blocks ``E``."""
    import dataclasses

    from hybridpar.models.hf.config import config_from_hf

    fields = {**config.to_dict(), "architectures": [MAMBA_HYBRIDS[config.model_type]]}
    kinds = list(getattr(config, "layers_block_type", None) or ())
    moe = [i for i, kind in enumerate(kinds) if kind == "moe"]
    if moe:
        fields["layers_block_type"] = ["mlp" if kind == "moe" else kind for kind in kinds]
    try:
        native = config_from_hf(fields)
    except ValueError as error:
        return None, f"its HybridLM twin cannot hold it ({str(error).rstrip('.')})"
    shape = {f.name: getattr(native, f.name) for f in dataclasses.fields(native)}
    if moe:
        shape["pattern"] = "".join("E" if i in moe else kind for i, kind in enumerate(native.pattern))
        shape.update(moe_experts=config.n_routed_experts, moe_top_k=config.num_experts_per_tok,
                     moe_intermediate_size=config.moe_intermediate_size,
                     moe_shared_size=config.moe_shared_expert_intermediate_size, moe_router="sigmoid",
                     moe_router_float32=True,  # NemotronH's _keep_in_fp32_modules_strict names gate.weight
                     moe_groups=(config.n_group, config.topk_group), moe_norm_topk=bool(config.norm_topk_prob),
                     moe_latent_size=getattr(config, "moe_latent_size", None) or 0,
                     moe_router_logits=bool(getattr(config, "output_router_logits", False)))
        # NemotronHForCausalLM computes no aux_loss (its output has none), so nothing trains on the logits
    return TwinConfig(**shape, paired_layers=config.model_type == "bamba"), ""


def granite_twin(config) -> tuple[TwinConfig | None, str]:
    """A GraniteMoeHybrid's twin: per layer its Mamba2 mixer ``M`` or attention ``*`` (RoPE only with
    ``position_embedding_type="rope"``), then its feed-forward half: the MoE block ``E`` (router,
    gated experts, the fused gated ``shared_mlp``) or, without experts, the ``shared_mlp`` alone as
    a gated MLP block ``-``. Multipliers (embedding, residual, attention, logits) scale by scalars and
    keep nothing."""
    if config.hidden_act != "silu":
        return None, f"granitemoehybrid with hidden_act={config.hidden_act!r} is not a gated SiLU MLP"
    heads = config.num_attention_heads
    experts = config.num_local_experts or 0
    mixers = ["M" if kind in ("mamba", "linear_attention") else "*" for kind in config.layers_block_type]
    rope = config.position_embedding_type == "rope"
    try:
        return _granite_twin(config, heads, experts, mixers, rope), ""
    except ValueError as error:
        return None, f"its HybridLM twin cannot hold it ({str(error).rstrip('.')})"


def _granite_twin(config, heads: int, experts: int, mixers: list[str], rope: bool) -> TwinConfig:
    return TwinConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        pattern="".join(m + ("E" if experts else "-") for m in mixers),
        mamba_num_heads=config.mamba_n_heads, mamba_head_dim=config.mamba_d_head, mamba_n_groups=config.mamba_n_groups,
        ssm_state_size=config.mamba_d_state, conv_kernel=config.mamba_d_conv, chunk_size=config.mamba_chunk_size,
        use_conv_bias=bool(config.mamba_conv_bias), mamba_proj_bias=bool(config.mamba_proj_bias),
        time_step_limit=tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf"))),
        num_attention_heads=heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        rotary_fraction=(config.rope_parameters or {}).get("partial_rotary_factor", 1.0) if rope else 0.0,
        attention_bias=bool(config.attention_bias), intermediate_size=config.shared_intermediate_size,
        mlp_activation="silu", mlp_gated=True, tie_word_embeddings=bool(config.tie_word_embeddings), mlp_fused=True,
        moe_experts=experts, moe_top_k=config.num_experts_per_tok if experts else 0,
        moe_intermediate_size=config.intermediate_size if experts else 0, moe_gated=True,
        moe_shared_size=config.shared_intermediate_size if experts else 0, summed_branches=True,
        moe_router_logits=bool(experts and config.output_router_logits),
        moe_aux_loss=bool(experts and router_aux_coefficient(config)))  # models/hf/router_aux.py


def falcon_twin(config) -> tuple[TwinConfig | None, str]:
    """A Falcon-H1's twin: ``P-`` per layer (module docstring). Its multipliers (embedding, key, branch
    inputs and outputs, ``mup_vector``, MLP, LM head) scale by constants and keep what the plan counts."""
    heads = config.num_attention_heads  # transformers holds mamba_n_heads x mamba_d_head = mamba_d_ssm
    if bool(config.mamba_proj_bias) != bool(config.projectors_bias):  # the twin has one bias flag for both
        return None, (f"its in_proj bias (mamba_proj_bias={config.mamba_proj_bias}) and out_proj bias "
                      f"(projectors_bias={config.projectors_bias}) differ")
    if config.hidden_act != "silu":
        return None, f"falcon_h1 with hidden_act={config.hidden_act!r} is not a gated SiLU MLP"
    try:
        return TwinConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, pattern="P-" * config.num_hidden_layers,
            mamba_num_heads=config.mamba_n_heads, mamba_head_dim=config.mamba_d_head,
            mamba_n_groups=config.mamba_n_groups, ssm_state_size=config.mamba_d_state, conv_kernel=config.mamba_d_conv,
            chunk_size=config.mamba_chunk_size, use_conv_bias=bool(config.mamba_conv_bias),
            mamba_proj_bias=bool(config.mamba_proj_bias), time_step_limit=tuple(config.time_step_limit),
            num_attention_heads=heads, num_key_value_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rotary_fraction=(config.rope_parameters or {}).get("partial_rotary_factor", 1.0),
            attention_bias=bool(config.attention_bias), intermediate_size=config.intermediate_size,
            mlp_activation="silu", mlp_gated=True, mlp_bias=bool(config.mlp_bias),
            tie_word_embeddings=bool(config.tie_word_embeddings), mamba_gated_norm=bool(config.mamba_rms_norm),
            mlp_multipliers=True, summed_branches=True), ""
    except ValueError as error:
        return None, f"its HybridLM twin cannot hold it ({str(error).rstrip('.')})"


def zamba2_twin(config) -> tuple[TwinConfig | None, str]:
    """A Zamba2's twin: ``M`` per Mamba layer, ``ZM`` per hybrid layer (``plan/hf/zamba2.py``)."""
    from hybridpar.plan.hf.zamba2 import zamba2_fields

    if not config.tie_word_embeddings:  # transformers then ties nothing: every hybrid layer holds its own block
        return None, "with tie_word_embeddings=False its hybrid layers' blocks are not shared (each its own copy)"
    if "hybrid" not in config.layers_block_type:
        return None, "it has no hybrid layer"
    if config.use_shared_attention_adapter and config.num_key_value_heads != config.num_attention_heads:
        return None, "its q/k/v adapters [2D] need num_key_value_heads == num_attention_heads"
    try:
        return TwinConfig(**zamba2_fields(config)), ""
    except ValueError as error:
        return None, f"its HybridLM twin cannot hold it ({str(error).rstrip('.')})"


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
