"""Tensor/sequence-parallel plans for dense Hugging Face decoders (transformers 5.23).

Each plan is exact: float64 loss and every gradient equal the single-process model's
(``tests/distributed/test_tp_hf*.py``). Hugging Face's own ``base_model_tp_plan`` has no
sequence parallelism, so these plans derive it from the layer structure (``decoder_plan``):
which norms feed a block (all-gathered once), which norms sit on a block's output (stay
sequence-sharded), and which attention code needs every head (computed whole, weights still
sharded: Phi3 slices its fused qkv by config head counts and chunks its fused gate_up, OLMo2
normalizes q and k across all heads).
"""

from __future__ import annotations

from functools import partial

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from hybridpar.models.hf.mixers.gdn import MARK as GDN_MARK
from hybridpar.models.hf.mixers.gdn import _LAYOUTS, _layout, _norm, _out
from hybridpar.models.hf.mixers.short_conv import SHORT_CONV_MARK
from hybridpar.parallel.lora import split_lora_components

from hybridpar.parallel.tensor.check import validate_tp_sizes
from hybridpar.parallel.tensor.decoder import decoder_plan, embedding_style, lm_head_style
from hybridpar.parallel.tensor.hybrid import MambaHeadParallel, SplitConv1d, SplitInProj
from hybridpar.parallel.tensor.linear_styles import (
    Conv1DColwiseParallel,
    Conv1DRowwiseParallel,
    HeadGateParallel,
    LocalHeadCounts,
    PackedColwiseParallel,
)
from hybridpar.parallel.tensor.registry import register_tp_plan
from hybridpar.parallel.tensor.styles import (AllReduceGrad, LocalReplicateParallel, RotaryEmbedParallel,
                                             SequenceParallelAllGatherActivation, local_mixer_input, row_parallel_exit)

__all__ = [
    "hf_key", "register_hf_plan", "llama_plan", "qwen3_plan", "gemma2_plan", "gemma3_plan", "phi_plan", "phi3_plan", "olmo2_plan", "cohere_plan",
    "starcoder2_plan", "gpt_neox_plan", "stablelm_plan", "gpt2_plan", "lfm2_plan", "lfm3_plan",
    "split_short_conv", "ShortConvChannelParallel", "split_gdn", "gdn_tp_problem", "GDNHeadParallel",
]


def hf_key(model_type: str, class_name: str) -> str:
    """The registry key of a transformers class: ``transformers.models.<t>.modeling_<t>.<Class>``."""
    return f"transformers.models.{model_type}.modeling_{model_type}.{class_name}"


def register_hf_plan(model_type: str, class_name: str, **kwargs):
    """Decorator: register a plan under a transformers class's key, with its bare name as alias."""
    return register_tp_plan(hf_key(model_type, class_name), aliases=(class_name,), **kwargs)


def _config_flag_refused(flag: str, why: str):
    """A ``validate`` that refuses configs with ``flag`` set, then checks the usual sizes."""
    def validate(model: nn.Module, tp: int) -> None:
        if getattr(model.config, flag, False):
            raise ValueError(f"{type(model).__name__} with config.{flag}=True is not supported at tp={tp}: {why}; "
                             f"use tp=1 (FSDP still shards it) or a config with {flag}=False")
        validate_tp_sizes(model, tp)
    return validate


@register_hf_plan("llama", "LlamaForCausalLM")
@register_hf_plan("mistral", "MistralForCausalLM")
@register_hf_plan("qwen2", "Qwen2ForCausalLM")
@register_hf_plan("granite", "GraniteForCausalLM")
@register_hf_plan("gemma", "GemmaForCausalLM")
@register_hf_plan("smollm3", "SmolLM3ForCausalLM")
@register_hf_plan("helium", "HeliumForCausalLM")
@register_hf_plan("ernie4_5", "Ernie4_5ForCausalLM")
def llama_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Llama, Mistral, Qwen2, Granite, Gemma, SmolLM3, Helium, Ernie 4.5: q/k/v, gate/up column-parallel;
    o/down row-parallel."""
    return decoder_plan(sequence_parallel, shared_norm_output=True)


@register_hf_plan("qwen3", "Qwen3ForCausalLM")
def qwen3_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Qwen3: Llama plus per-head q_norm/k_norm on local heads (gradients summed over TP)."""
    return decoder_plan(sequence_parallel, head_norms=("q_norm", "k_norm"), shared_norm_output=True)


_GEMMA_NORMS = dict(in_norms=("input_layernorm", "pre_feedforward_layernorm"),
                    post_norms=("post_attention_layernorm", "post_feedforward_layernorm"))


@register_hf_plan("gemma2", "Gemma2ForCausalLM")
def gemma2_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Gemma2: scaled embedding, four norms per layer (two on the block outputs)."""
    return decoder_plan(sequence_parallel, shared_norm_output=True, **_GEMMA_NORMS)


@register_hf_plan("gemma3", "Gemma3ForCausalLM")
def gemma3_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Gemma3: Gemma2's layout plus per-head q/k norms."""
    plan = decoder_plan(sequence_parallel, head_norms=("q_norm", "k_norm"), shared_norm_output=True, **_GEMMA_NORMS)
    if sequence_parallel:
        plan["model.rotary_emb_local"] = RotaryEmbedParallel()  # older Gemma3 versions
    return plan


@register_hf_plan("phi", "PhiForCausalLM")
def phi_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Phi (Phi-2): attention output ``dense``, MLP ``fc1``/``fc2``, one LayerNorm per layer
    shared by the parallel attention and MLP branches, optional per-head q/k LayerNorms."""
    return decoder_plan(sequence_parallel, attn_out="dense", mlp_in=("fc1",), mlp_out="fc2",
                        in_norms=("input_layernorm",), head_norms=("q_layernorm", "k_layernorm"),
                        final_norm="final_layernorm", shared_norm_output=True, summed_branches=True)


@register_hf_plan("phi3", "Phi3ForCausalLM")
def phi3_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Phi3: fused ``qkv_proj`` split by config head counts and fused ``gate_up_proj`` chunked
    into gate and up: both outputs gathered (weights sharded ``Shard(0)``, so FSDP composes;
    a packed ``_StridedShard(0)`` weight would collide with FSDP's dim-0 shard)."""
    return decoder_plan(sequence_parallel, qkv=("qkv_proj",), gather_attention=True, mlp_in=("gate_up_proj",),
                        gather_mlp=True, shared_norm_output=True)


@register_hf_plan("olmo2", "Olmo2ForCausalLM")
@register_hf_plan("olmo3", "Olmo3ForCausalLM")
def olmo2_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """OLMo2, OLMo3: q/k RMSNorms over all heads (gathered attention); only post-block norms, so the
    blocks read the residual stream directly."""
    return decoder_plan(sequence_parallel, gather_attention=True, head_norms=("q_norm", "k_norm"), in_norms=(),
                        post_norms=("post_attention_layernorm", "post_feedforward_layernorm"), residual_inputs=True,
                        shared_norm_output=True)


@register_hf_plan("exaone4", "Exaone4ForCausalLM")
def exaone4_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Exaone4: per-head q/k RMSNorms (replicated) and OLMo2's post-block norms only."""
    return decoder_plan(sequence_parallel, head_norms=("q_norm", "k_norm"), in_norms=(),
                        post_norms=("post_attention_layernorm", "post_feedforward_layernorm"), residual_inputs=True,
                        shared_norm_output=True)


@register_hf_plan("cohere", "CohereForCausalLM",
           validate=_config_flag_refused("use_qk_norm", "its q/k LayerNorms hold one weight row per head"))
def cohere_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Cohere: one input LayerNorm feeding parallel attention and MLP branches."""
    return decoder_plan(sequence_parallel, in_norms=("input_layernorm",), shared_norm_output=True, summed_branches=True)


@register_hf_plan("starcoder2", "Starcoder2ForCausalLM")
def starcoder2_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Starcoder2: LayerNorms with bias, MLP ``c_fc``/``c_proj`` (nn.Linear, with bias)."""
    return decoder_plan(sequence_parallel, mlp_in=("c_fc",), mlp_out="c_proj", shared_norm_output=True)


@register_hf_plan("gpt_neox", "GPTNeoXForCausalLM")
def gpt_neox_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """GPT-NeoX: ``query_key_value`` interleaved per head (``[H, 3, d]`` rows, so a plain
    column split keeps whole heads), parallel or sequential residual."""
    return decoder_plan(sequence_parallel, prefix="gpt_neox", embed="embed_in", attn="attention",
                        qkv=("query_key_value",), attn_out="dense", mlp_in=("dense_h_to_4h",),
                        mlp_out="dense_4h_to_h", final_norm="final_layer_norm", shared_norm_output=True,
                        summed_branches=True)


@register_hf_plan("stablelm", "StableLmForCausalLM",
           validate=_config_flag_refused("qk_layernorm", "its per-head LayerNorms are a list indexed by global head"))
def stablelm_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """StableLM: Llama-shaped, but attention reshapes with ``self.num_heads`` /
    ``self.num_key_value_heads``, which become the per-rank head counts; parallel or sequential residual."""
    plan = decoder_plan(sequence_parallel, shared_norm_output=True, summed_branches=True)
    plan["model.layers.*.self_attn"] = LocalHeadCounts(("num_heads", "num_key_value_heads"))
    return plan


@register_hf_plan("gpt2", "GPT2LMHeadModel",
           validate=_config_flag_refused("add_cross_attention", "cross-attention blocks have no TP plan"))
def gpt2_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """GPT-2: ``Conv1D`` projections (transposed weights); ``c_attn`` packs ``[q | k | v]``
    (``PackedColwiseParallel(3)``, attention ``split_size``/``num_heads`` made per-rank);
    learned positions ``wpe`` replicated, added to the sequence-sharded token embeddings."""
    sp = sequence_parallel
    reduce_out = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    block = "transformer.h.*"
    plan: dict[str, ParallelStyle] = {
        "transformer.wte": embedding_style(sp),
        "transformer.wpe": LocalReplicateParallel(output_layouts=Shard(1) if sp else None),
        f"{block}.attn": LocalHeadCounts(("num_heads", "split_size")),
        f"{block}.attn.c_attn": PackedColwiseParallel(split_factor=3),
        f"{block}.attn.c_proj": Conv1DRowwiseParallel(**reduce_out),
        f"{block}.mlp.c_fc": Conv1DColwiseParallel(),
        f"{block}.mlp.c_proj": Conv1DRowwiseParallel(**reduce_out),
        "lm_head": lm_head_style(sp),
    }
    for norm in ("ln_1", "ln_2"):
        plan[f"{block}.{norm}"] = SequenceParallelAllGatherActivation(use_local_output=False) if sp else LocalReplicateParallel()
    plan["transformer.ln_f"] = SequenceParallel() if sp else LocalReplicateParallel()
    return plan


# LFM2 / LFM3: a gated short conv (models/hf/mixers/short_conv.py, switched by install_short_conv, which
# parallelize runs) is per channel after its projection, so it shards by channels with no collective
# of its own (ShortConvChannelParallel). Its in_proj is stored per component (in_proj.weight_b,
# weight_c, weight_x: split_short_conv, at every layout, so DCP names do not depend on tp; exports and
# check fuse them back), and rank r holds channels [r C/tp, (r+1) C/tp) of b, c and x:
#   u [B, S, D] (SP: all-gathered from [B, S/tp, D]) -> in_proj components -> [B, S, b_r | c_r | x_r]
#   -> conv (weight [C/tp, 1, K], bias [C/tp]) -> y [B, S, C/tp] -> out_proj rowwise: partial [B, S, D]
#   -> all-reduce (SP: reduce-scatter -> [B, S/tp, D])
# Every parameter is a plain Shard(0), so FSDP composes (dp x tp, cp x tp); the CP halo
# (context/recurrent/short_conv.py) runs on the local channels. Under TP only hybridpar's conv runs.


def split_short_conv(module: nn.Module) -> None:
    """Store a switched short conv's ``in_proj`` per component ``b, c, x`` (idempotent; a LoRA adapter follows)."""
    if isinstance(module.in_proj, SplitInProj):
        return
    channels = module.in_proj.out_features // 3
    sizes = dict(b=channels, c=channels, x=channels)
    fused, module.in_proj = module.in_proj, SplitInProj(module.in_proj, sizes)
    split_lora_components(fused, module.in_proj, sizes)


class ShortConvChannelParallel(MambaHeadParallel):
    """Shard a switched short conv by channels (comment above); ``sequence_parallel``: the output is
    reduce-scattered to a ``Shard(1)`` DTensor ``[B, S/tp, D]``."""

    def __init__(self, *, sequence_parallel: bool = False):
        super().__init__(sequence_parallel=sequence_parallel)
        self.use_local_output = not sequence_parallel  # read by tp_check's SP rules

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        if not getattr(module, SHORT_CONV_MARK, False):
            raise ValueError(f"TP plan entry for {name!r}: ShortConvChannelParallel shards a short conv switched by "
                             f"install_short_conv(model) (parallelize calls it), got {type(module).__name__}")
        if module.conv.in_channels % tp:
            raise ValueError(f"TP plan entry for {name!r}: {module.conv.in_channels} short-conv channels are not "
                             f"divisible by tp={tp}; choose a tp that divides {module.conv.in_channels}")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(type(module).__name__, module, device_mesh.size())
        split_short_conv(module)
        for sub in (module.in_proj, module.conv):  # b, c, x rows and conv channels: [C, ...] -> [C/tp, ...]
            for name in list(sub._parameters):
                self._shard(sub, name, device_mesh, Shard(0))
        row_parallel_exit(module.out_proj, device_mesh, self.sequence_parallel)  # y_local [B, S, C/tp]
        module.register_forward_pre_hook(partial(self._enter_conv, device_mesh), with_kwargs=True)
        return module

    @staticmethod
    def _enter_conv(mesh: DeviceMesh, module: nn.Module, args, kwargs):
        return local_mixer_input(mesh, args, kwargs)  # in_proj (SplitInProj) and the conv read their shards


_LFM = dict(mlp="feed_forward", mlp_in=("w1", "w3"), mlp_out="w2", in_norms=("operator_norm", "ffn_norm"),
            final_norm="embedding_norm")


@register_hf_plan("lfm2", "Lfm2ForCausalLM")
def lfm2_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """LFM2: short convs by channels; attention (``out_proj``, q/k layernorms per head) and MLP."""
    plan = decoder_plan(sequence_parallel, attn_out="out_proj", head_norms=("q_layernorm", "k_layernorm"),
                        shared_norm_output=True, **_LFM)
    plan["model.layers.*.conv"] = ShortConvChannelParallel(sequence_parallel=sequence_parallel)
    return plan


@register_hf_plan("lfm3", "Lfm3ForCausalLM")
def lfm3_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """LFM3: short convs by channels; Qwen3-style attention with its per-head gate ``g_proj``
    (column-parallel: the gate of the local heads); sandwich norms on the block outputs."""
    sandwich = getattr(model.config, "use_sandwich_norm", False)
    plan = decoder_plan(sequence_parallel, head_norms=("q_norm", "k_norm"),
                        post_norms=("post_operator_norm", "post_ffn_norm") if sandwich else (), shared_norm_output=True,
                        **_LFM)
    plan["model.layers.*.self_attn.g_proj"] = HeadGateParallel()
    plan["model.layers.*.conv"] = ShortConvChannelParallel(sequence_parallel=sequence_parallel)
    return plan


# Gated DeltaNets of transformers hybrids (Qwen3-Next, Qwen3.5, OLMo-Hybrid) by heads: GDNHeadParallel, in the
# plans moe_hybrid.qwen3_next_plan and moe_hybrid.olmo_hybrid_plan.
#
# Rank ``r`` of ``tp`` holds key heads ``[r Hk/tp, (r+1) Hk/tp)`` and the value heads that read them,
# ``[r Hv/tp, (r+1) Hv/tp)`` (value head ``j`` reads key head ``j // (Hv/Hk)``), so the whole layer up
# to ``out_proj`` runs on local heads with no collective::
#
#     u [B, S, D] (SP: all-gathered from [B, S/tp, D])
#       -> projections (local rows)  mixed_qkv [B, S, 2 Hk/tp dk + Hv/tp dv], z [B, S, Hv/tp dv], a, b [B, S, Hv/tp]
#       -> core (conv on the local q|k|v channels, A_log, dt_bias on local heads; a CP strategy alike)
#       -> o [B, S, Hv/tp dv] -> per-head gated norm (weight [dv] replicated, gradient summed over TP)
#       -> out_proj rowwise: partial [B, S, D] -> all-reduce [B, S, D] (SP: reduce-scatter [B, S/tp, D])
#
# Every sharded parameter is a plain ``Shard(0)`` of a stored tensor, so FSDP composes:
#
# - Qwen3-Next's ``in_proj_qkvz`` (rows ``[q_h | k_h | v_h | z_h]`` per key head ``h``) and
#   ``in_proj_ba`` (``[b_h | a_h]`` per key head) are grouped by key head already: dim-0 shards as stored.
# - Qwen3.5's ``in_proj_qkv`` (``[q | k | v]``) is stored per component ``weight_q, weight_k, weight_v``
#   (``SplitInProj``); ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (value heads in order) as stored.
# - OLMo-Hybrid's ``q_proj ... b_proj`` as stored.
# - ``conv1d`` over ``[q | k | v]`` is stored per component (``SplitConv1d``: ``weight_q/k/v``).
#
# ``split_gdn`` stores those components at every layout (``parallelize`` calls it through
# ``split_hf_mixers``), so checkpoint names do not depend on tp; ``canonical_state_dict`` and exports fuse
# them back to transformers' names. During the layer's forward its DTensor parameters are swapped for
# their local shards, so ``mixers.gdn.gdn_training_forward`` and the CP cores run unchanged on a shard.


_HEAD_COUNTS = ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")


def split_gdn(layer: nn.Module) -> None:
    """Store a switched gated DeltaNet's ``conv1d`` (and Qwen3.5's ``in_proj_qkv``) per component q, k, v
    (idempotent; a LoRA adapter on ``in_proj_qkv`` follows)."""
    if isinstance(layer.conv1d, SplitConv1d):
        return
    key, value = layer.num_k_heads * layer.head_k_dim, layer.num_v_heads * layer.head_v_dim
    sizes = dict(q=key, k=key, v=value)
    layer.conv1d = SplitConv1d(layer.conv1d, sizes)
    if _layout(layer) == "qkv_z_b_a" and not isinstance(layer.in_proj_qkv, SplitInProj):
        fused, layer.in_proj_qkv = layer.in_proj_qkv, SplitInProj(layer.in_proj_qkv, sizes)
        split_lora_components(fused, layer.in_proj_qkv, sizes)


def _projections(layer: nn.Module) -> list[nn.Module]:
    layout = next(name for name, parts in _LAYOUTS.items() if all(hasattr(layer, p) for p in parts))
    return [getattr(layer, p) for p in _LAYOUTS[layout]]


def gdn_tp_problem(name: str, layer: nn.Module, tp: int) -> str | None:
    """Why ``layer`` cannot be sharded by heads over ``tp`` ranks (None: it can)."""
    if not getattr(layer, GDN_MARK, False):
        return (f"TP plan entry for {name!r}: GDNHeadParallel shards a gated DeltaNet switched by install_gdn_core(model) "
                f"(parallelize calls it), got {type(layer).__name__}")
    if layer.num_k_heads % tp:
        return (f"gated DeltaNet {name!r}: {layer.num_k_heads} key heads ({layer.num_v_heads} value heads) are not "
                f"divisible by tp={tp}; choose a tp that divides {layer.num_k_heads}")
    return None


class GDNHeadParallel(MambaHeadParallel):
    """Shard a switched gated DeltaNet by heads (comment above); ``sequence_parallel``: the output is
    reduce-scattered to a ``Shard(1)`` DTensor ``[B, S/tp, D]``; ``_exit`` restores the DTensors."""

    def __init__(self, *, sequence_parallel: bool = False):
        super().__init__(sequence_parallel=sequence_parallel)
        self.use_local_output = not sequence_parallel  # read by tp_check's SP rules

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        problem = gdn_tp_problem(name, module, tp)
        if problem:
            raise ValueError(problem + ".")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        self.check(type(module).__name__, module, tp)
        split_gdn(module)
        for sub in (module, module.conv1d, *_projections(module)):  # A_log, dt_bias; conv q|k|v; projection rows
            for name in list(sub._parameters):
                self._shard(sub, name, device_mesh, Shard(0))
        norm = _norm(module)
        for name in list(norm._parameters):  # [dv], shared by every head: replicated
            self._shard(norm, name, device_mesh, Replicate())
        for attr in _HEAD_COUNTS:
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, getattr(module, attr) // tp)
        row_parallel_exit(_out(module), device_mesh, self.sequence_parallel)  # o_local [B, S, Hv/tp dv]
        module.register_forward_pre_hook(partial(self._enter, device_mesh), with_kwargs=True)
        module.register_forward_hook(self._exit, always_call=True)  # restore even if forward raises
        return module

    @staticmethod
    def _enter(mesh: DeviceMesh, layer: nn.Module, args, kwargs):
        args, kwargs = local_mixer_input(mesh, args, kwargs)
        saved, norm = [], _norm(layer)
        for sub in (layer, layer.conv1d, norm, *_projections(layer)):
            for name, param in list(sub._parameters.items()):
                if isinstance(param, DTensor):
                    saved.append((sub, name, param))
                    local = param.to_local()  # local shard (or the whole replicated norm weight)
                    # the norm weight: every rank's heads give part of its gradient
                    sub._parameters[name] = AllReduceGrad.apply(local, mesh.get_group()) if sub is norm else local
        layer.__dict__.setdefault("_tp_saved_parameters", []).append(saved)
        return args, kwargs
