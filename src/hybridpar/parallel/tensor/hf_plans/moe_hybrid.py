"""Tensor/sequence-parallel plans for Hugging Face mixture-of-experts and Mamba2-hybrid models.

- MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, NemotronH ``moe`` layers, Granite 4.0-H, GPT-OSS):
  experts sharded on the intermediate dim (``GroupedExpertsParallel``, biases included), router
  replicated, shared experts column/row parallel inside the block (``moe.moe_block_plan``); under
  SP the block reads the all-gathered norm output and reduce-scatters its partial sum to the
  sequence shard (``moe_block_sp_style``). GPT-OSS's attention sinks follow their heads (``HeadShardedSinks``).
- Mamba2 mixers of transformers classes (Falcon-H1, Bamba, NemotronH, GraniteMoeHybrid) running
  hybridpar's core (``install_mamba_core``; ``parallelize`` installs it) are sharded by heads
  (``HFMambaHeadParallel``), as ``HybridLM``'s mixer (``tensor/hybrid.py``); a mixer on
  transformers' own forward stays replicated (its output sliced to the sequence shard under SP).

``HFMambaHeadParallel``: ``in_proj`` and ``conv1d`` are stored per component (``SplitInProj`` /
``SplitConv1d``: ``in_proj.weight_z ... weight_dt``; ``canonical_state_dict`` fuses them back
to transformers' names for export and ``hybridpar check``), then rank ``r`` of ``tp`` holds heads
``[r H/tp, (r+1) H/tp)`` of ``z, x, dt``, conv ``x`` channels, ``dt_bias``, ``A_log``, ``D``
and the gated norm weight, and groups ``[r G/tp, (r+1) G/tp)`` of ``B, C``: whole norm groups
(size ``d_inner/G``), so the gated norm needs no collective. With one group (``n_groups=1``:
Granite 4.0-H, Falcon-H1, Bamba) ``B, C`` are replicated (their gradient summed over TP) and
the norm's sum of squares is all-reduced over TP (``[B, S, 1]`` per layer)::

    u [B, S, D] (SP: all-gathered from [B, S/tp, D]) (* ssm_in_multiplier)
      -> in_proj (local components) [B, S, d/tp | d/tp + 2 G/tp N | H/tp] (* local mup_vector rows)
      -> mixer.core on the local heads (a CP strategy too) -> y [B, S, d/tp]
      -> gated norm on G/tp groups -> out_proj rowwise: partial [B, S, D]
      -> all-reduce -> [B, S, D]   (SP: reduce-scatter -> [B, S/tp, D])

Falcon-H1's ``mup_vector`` (a non-persistent buffer over the ``in_proj`` rows) is cut to this
rank's rows of each component and its gated norm's ``n_groups`` (it reshapes with it) becomes
the local count; the other gated norms reshape with ``group_size``, which does not change. Under
TP only hybridpar's core runs: a cache or a padding mask is refused. Parameter names under TP are
the split ones (a DCP checkpoint resumes at another tp > 1, not at tp = 1; exports are fused).

The plans are built per model instance where layers differ (MoE or dense MLP, Mamba or
attention), with concrete layer indices.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from hybridpar.models.hf.mixers.gdn import MARK as GDN_MARK
from hybridpar.models.hf.mixers.kda import KDA_MARK
from hybridpar.models.hf.mixers.mamba1 import MAMBA1_MARK
from hybridpar.models.hf.mixers.mamba2 import MARK
from hybridpar.models.hf.mixers.short_conv import SHORT_CONV_MARK
from hybridpar.parallel.data.fsdp import register_first_pre_hook
from hybridpar.parallel.lora import split_lora_components
from hybridpar.parallel.tensor.decoder import decoder_plan, embedding_style, lm_head_style
from hybridpar.parallel.tensor.hybrid import (MambaHeadParallel, SplitConv1d, SplitInProj, replicate_shared_groups,
                                              spanning_group_norm)
from hybridpar.parallel.tensor.linear_styles import HeadShardedSinks
from hybridpar.parallel.tensor.moe import is_moe_block, moe_block_plan, moe_block_sp_style, moe_blocks_plan, moe_decoder_plan
from hybridpar.parallel.tensor.hf_plans.kimi_linear import split_kda
from hybridpar.parallel.tensor.hf_plans.mamba1 import split_mamba1
from hybridpar.parallel.tensor.hf_plans.dense import (GDNHeadParallel, lfm2_plan, olmo2_plan, register_hf_plan, split_gdn,
                                               split_short_conv)
from hybridpar.parallel.tensor.styles import (LocalReplicateParallel, RotaryEmbedParallel,
                                             SequenceParallelAllGatherActivation, TokenwiseParallel)

__all__ = ["mamba_tp_problem", "split_hf_mixer", "split_hf_mixers", "HFMambaHeadParallel", "hf_mamba_style",
           "mixtral_plan", "qwen3_moe_plan", "falcon_h1_plan", "bamba_plan", "nemotron_h_plan",
           "granite_moe_hybrid_plan", "qwen3_next_plan", "olmo_hybrid_plan", "gpt_oss_plan"]


def mamba_tp_problem(name: str, mixer: nn.Module, tp: int) -> str | None:
    """Why ``mixer`` cannot be sharded by heads over ``tp`` ranks (None: it can)."""
    heads, groups = mixer.num_heads, mixer.n_groups
    if heads % tp == 0 and (groups % tp == 0 or groups == 1):
        return None
    valid = [t for t in range(1, heads + 1) if heads % t == 0 and (groups % t == 0 or groups == 1)]
    value = f"num_heads={heads}" if heads % tp else f"n_groups={groups}"
    return (f"Mamba2 mixer {name!r} ({type(mixer).__name__}) has {value}, not divisible by tp={tp}: tensor "
            "parallelism splits its heads and its B/C groups over the TP ranks (one group is replicated); use a tp "
            f"dividing both (one of {valid})")


def _component_sizes(mixer: nn.Module) -> dict[str, int]:
    d_inner, gn = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size
    return dict(z=d_inner, x=d_inner, B=gn, C=gn, dt=mixer.num_heads)


def split_hf_mixer(mixer: nn.Module) -> None:
    """Store ``in_proj`` and ``conv1d`` of a transformers Mamba2 mixer per component (idempotent)."""
    if isinstance(mixer.in_proj, SplitInProj):
        return
    sizes = _component_sizes(mixer)
    fused, mixer.in_proj = mixer.in_proj, SplitInProj(mixer.in_proj, sizes)
    split_lora_components(fused, mixer.in_proj, sizes)  # a LoRA adapter follows, B per component
    mixer.conv1d = SplitConv1d(mixer.conv1d, dict(x=sizes["x"], B=sizes["B"], C=sizes["C"]))


def split_hf_mixers(model: nn.Module) -> None:
    """``split_hf_mixer`` for every transformers Mamba2 mixer on hybridpar's core (and the other switched
    mixers' fused projections or convs), at every layout so DCP names do not depend on tp, before TP applies
    (with its LoRA adapter attached: ``apply_tp`` detaches adapters while the styles run)."""
    for module in model.modules():
        if getattr(module, MARK, False):
            split_hf_mixer(module)
        elif getattr(module, SHORT_CONV_MARK, False):  # LFM2's short convs: in_proj per b, c, x
            split_short_conv(module)
        elif getattr(module, GDN_MARK, False):  # gated DeltaNets: conv1d (Qwen3.5: in_proj_qkv) per q, k, v
            split_gdn(module)
        elif getattr(module, MAMBA1_MARK, False):  # Jamba, FalconMamba, Mamba: in_proj per x, z
            split_mamba1(module)
        elif getattr(module, KDA_MARK, False):  # Kimi Linear's KDA layers: conv1d per q, k, v
            split_kda(module)


def _local_rows(vector: torch.Tensor, sizes: dict[str, int], tp: int, rank: int, shared: bool) -> torch.Tensor:
    """This rank's rows of every component of a ``[..., z | x | B | C | dt]`` vector (B, C whole if ``shared``)."""
    parts = vector.split(list(sizes.values()), dim=-1)
    return torch.cat([part if shared and name in "BC" else part.chunk(tp, dim=-1)[rank]
                      for name, part in zip(sizes, parts)], dim=-1)


class HFMambaHeadParallel(MambaHeadParallel):
    """``MambaHeadParallel`` for a transformers Mamba2 mixer on hybridpar's core (module docstring);
    ``partial_output``: its partial ``[B, S, D]`` is left to the layer (``SummedBranchesLayer``)."""

    def __init__(self, *, sequence_parallel: bool = False, partial_output: bool = False):
        super().__init__(sequence_parallel=sequence_parallel)
        self.partial_output = partial_output
        self.use_local_output = not (sequence_parallel or partial_output)  # read by tp_check's SP rules

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        if not getattr(module, MARK, False):
            raise ValueError(f"TP plan entry for {name!r}: HFMambaHeadParallel shards a transformers Mamba2 mixer "
                             f"that runs hybridpar's core, got {type(module).__name__}; call install_mamba_core(model) "
                             "first (parallelize does), or replicate it (LocalReplicateParallel)")
        problem = mamba_tp_problem(name, module, tp)
        if problem:
            raise ValueError(problem + ".")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        self.check(type(module).__name__, module, tp)
        sizes = _component_sizes(module)
        split_hf_mixer(module)
        norm = module.norm
        subs = (module, module.in_proj, module.conv1d) + (() if isinstance(norm, nn.Identity) else (norm,))
        shared = replicate_shared_groups(module, device_mesh)  # one B/C group read by every rank's heads
        for sub in subs:
            for name in list(sub._parameters):  # heads (z, x, dt, conv x, per head, norm) or groups (B, C)
                if (sub, name) not in shared:
                    self._shard(sub, name, device_mesh, Shard(0))
        if shared and not isinstance(norm, nn.Identity):
            norm.forward = spanning_group_norm(norm, device_mesh.get_group(), module.intermediate_size)
        mup = getattr(module, "mup_vector", None)
        if isinstance(mup, torch.Tensor):  # Falcon-H1: [1, 1, W] -> [1, 1, W/tp], a non-persistent buffer
            module.mup_vector = _local_rows(mup, sizes, tp, rank, shared)
        if isinstance(getattr(norm, "n_groups", None), int) and not shared:  # Falcon-H1's reshapes with n_groups
            norm.n_groups //= tp
        # y_local [B, S, d/tp] -> partial [B, S, D] -> all-reduce [B, S, D] / reduce-scatter [B, S/tp, D] / as is
        output = Partial() if self.partial_output else Shard(1) if self.sequence_parallel else Replicate()
        RowwiseParallel(output_layouts=output, use_local_output=self.use_local_output)._apply(module.out_proj, device_mesh)
        module.register_forward_pre_hook(partial(self._enter, device_mesh), with_kwargs=True)
        module.register_forward_hook(self._exit, always_call=True)
        module._hybridpar_head_sharded = True
        return module


def hf_mamba_style(mixer: nn.Module, sequence_parallel: bool, replicated: ParallelStyle,
                   partial_output: bool = False) -> ParallelStyle:
    """By heads for a mixer on hybridpar's core, else ``replicated`` (transformers' own forward)."""
    return (HFMambaHeadParallel(sequence_parallel=sequence_parallel, partial_output=partial_output)
            if getattr(mixer, MARK, False) else replicated)


@register_hf_plan("mixtral", "MixtralForCausalLM")
@register_hf_plan("qwen2_moe", "Qwen2MoeForCausalLM")
def mixtral_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Mixtral, Qwen2-MoE (with a gated shared expert): Llama attention, MoE blocks."""
    return moe_decoder_plan(model, sequence_parallel)


@register_hf_plan("qwen3_moe", "Qwen3MoeForCausalLM")
def qwen3_moe_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Qwen3-MoE: Qwen3 attention (per-head q/k norms), MoE blocks."""
    return moe_decoder_plan(model, sequence_parallel, head_norms=("q_norm", "k_norm"))


_HYBRID = dict(mlp="feed_forward", in_norms=("input_layernorm", "pre_ff_layernorm"), final_norm="final_layernorm")


@register_hf_plan("falcon_h1", "FalconH1ForCausalLM")
def falcon_h1_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Falcon-H1: attention and MLP (``feed_forward``) sharded; the parallel Mamba2 branch by heads
    (replicated on transformers' own forward, seed 004). Both branches read the input norm's output;
    their partial outputs are added and reduced once (``SummedBranchesLayer``: one all-reduce, under
    SP one reduce-scatter), as is the MLP's."""
    plan = decoder_plan(sequence_parallel, shared_norm_output=True, summed_branches=True, **_HYBRID)
    replicated = LocalReplicateParallel(output_layouts=Replicate())  # a Replicate DTensor joins the Partial sum
    for index, layer in enumerate(model.model.layers):
        plan[f"model.layers.{index}.mamba"] = hf_mamba_style(layer.mamba, sequence_parallel, replicated, True)
    return plan


@register_hf_plan("bamba", "BambaForCausalLM")
def bamba_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Bamba: each layer is a Mamba2 mixer (by heads) or attention, then a dense MLP. Without SP each
    norm's output is one replicated DTensor (``shared_norm_output``): q, k, v (gate, up) all-reduce
    their summed input gradient once, as the Mamba mixer does (``local_mixer_input``)."""
    plan = decoder_plan(sequence_parallel, shared_norm_output=True, **_HYBRID)
    replicated = LocalReplicateParallel(output_layouts=Shard(1) if sequence_parallel else None)
    for index, layer in enumerate(model.model.layers):
        if getattr(layer, "mamba", None) is not None:
            plan[f"model.layers.{index}.mamba"] = hf_mamba_style(layer.mamba, sequence_parallel, replicated)
    return plan


@register_hf_plan("nemotron_h", "NemotronHForCausalLM")
def nemotron_h_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """NemotronH: one mixer per layer (Mamba2, attention, MLP or MoE) after one norm. Hugging
    Face's own plan names MoE experts every layer and shards nothing else; this one shards
    attention, MLP and MoE layers and shards the Mamba2 mixers by heads. Without SP every norm returns
    one replicated DTensor: q, k, v (a MoE block's router, experts and shared experts) all-reduce their
    summed input gradient once."""
    sp = sequence_parallel
    reduce_out = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    plan: dict[str, ParallelStyle] = {
        "model.embeddings": embedding_style(sp),
        "model.norm_f": SequenceParallel() if sp else LocalReplicateParallel(),
        "lm_head": lm_head_style(sp),
    }
    for index, layer in enumerate(model.model.layers):
        path = f"model.layers.{index}.mixer"
        kind = layer.block_type
        plan[f"model.layers.{index}.norm"] = (SequenceParallelAllGatherActivation(use_local_output=False) if sp
                                              else LocalReplicateParallel(output_layouts=Replicate()))
        if kind == "full_attention":
            plan.update({f"{path}.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")})
            plan[f"{path}.o_proj"] = RowwiseParallel(**reduce_out)
        elif kind == "mlp":
            plan[f"{path}.up_proj"] = ColwiseParallel()
            plan[f"{path}.down_proj"] = RowwiseParallel(**reduce_out)
        elif kind == "moe":
            plan.update(moe_block_plan(path, layer.mixer, sp))
        else:  # Mamba2 ("linear_attention"): by heads (replicated on transformers' forward)
            plan[path] = hf_mamba_style(layer.mixer, sp, LocalReplicateParallel(output_layouts=Shard(1) if sp else None))
    return plan


@register_hf_plan("granitemoehybrid", "GraniteMoeHybridForCausalLM")
def granite_moe_hybrid_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Granite 4.0-H: per layer a Mamba2 mixer (by heads) or attention (RoPE or NoPE, multipliers
    outside the projections), then the MoE block (experts sharded, router replicated) plus a shared
    MLP whose fused ``[gate | up]`` ``input_linear`` is column-parallel with its output gathered
    (chunked after the projection; a plain weight shard composes with FSDP). Every branch leaves its
    partial output to the layer (``SummedBranchesLayer``): the MoE block's and the shared MLP's, added,
    are reduced once (one all-reduce, under SP one reduce-scatter)."""
    sp = sequence_parallel
    plan = decoder_plan(sp, mlp="shared_mlp", mlp_in=("input_linear",), gather_mlp=True, mlp_out="output_linear",
                        shared_norm_output=True, summed_branches=True,
                        rotary="rotary_emb" if getattr(model.model, "rotary_emb", None) is not None else None)
    replicated = LocalReplicateParallel(output_layouts=Replicate())  # a Replicate DTensor joins the Partial sum
    for index, layer in enumerate(model.model.layers):
        if layer.mamba is not None:
            plan[f"model.layers.{index}.mamba"] = hf_mamba_style(layer.mamba, sp, replicated, True)
        if layer.block_sparse_moe is not None and is_moe_block(layer.block_sparse_moe):
            path = f"model.layers.{index}.block_sparse_moe"
            plan.update(moe_block_plan(path, layer.block_sparse_moe, sp, partial_output=True))
            plan[f"{path}.router"] = LocalReplicateParallel()
    return plan


class _WithoutEmbeddings(ParallelStyle):
    """A Zamba2 Mamba layer is called with the embeddings it never reads (``original_hidden_states``);
    under SP they are a DTensor, and FSDP2 hands an unused DTensor input a plain zero gradient in
    backward, which then meets the hybrid layers' DTensor gradient ("mixed torch.Tensor and
    DTensor"). Pass None instead, ahead of FSDP's pre-hook (``register_first_pre_hook``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def drop(mod, args, kwargs):
            if len(args) > 1:
                return (args[0], None, *args[2:]), kwargs
            return args, {**kwargs, "original_hidden_states": None} if "original_hidden_states" in kwargs else kwargs

        register_first_pre_hook(module, drop)
        return module


def _zamba2_block_plan(prefix: str, block: nn.Module, sp: bool, in_norm) -> dict[str, ParallelStyle]:
    """Zamba2's shared attention block at ``prefix``: ``concat([h, embeddings]) -> norm -> attention
    (q/k/v column-parallel, each plus its per-layer adapter ``Linear(2D, r) -> Linear(r, 2D)``: the
    first replicated, the second column-parallel like q) -> o_proj row-parallel -> norm -> MLP``, whose
    fused ``[gate | up]`` (plus its adapter, replicated) is gathered before the chunk (a plain weight
    shard composes with FSDP) and ``down_proj`` reads its slice of it."""
    reduce_out = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    attn, mlp = f"{prefix}.self_attn", f"{prefix}.feed_forward"
    plan: dict[str, ParallelStyle] = {f"{prefix}.input_layernorm": in_norm(), f"{prefix}.pre_ff_layernorm": in_norm()}
    plan.update({f"{attn}.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")})
    plan[f"{attn}.o_proj"] = RowwiseParallel(**reduce_out)
    for name in ("linear_q_adapter_list", "linear_k_adapter_list", "linear_v_adapter_list"):
        for index, adapter in enumerate(getattr(block.self_attn, name, None) or ()):
            if isinstance(adapter, nn.Sequential):
                plan[f"{attn}.{name}.{index}.0"] = LocalReplicateParallel()
                plan[f"{attn}.{name}.{index}.1"] = ColwiseParallel()
    plan[f"{mlp}.gate_up_proj"] = ColwiseParallel(output_layouts=Replicate())
    for index, adapter in enumerate(block.feed_forward.gate_up_proj_adapter_list):
        if isinstance(adapter, nn.Sequential):
            plan[f"{mlp}.gate_up_proj_adapter_list.{index}"] = LocalReplicateParallel()
    plan[f"{mlp}.down_proj"] = RowwiseParallel(input_layouts=Replicate(), **reduce_out)
    return plan


@register_hf_plan("zamba2", "Zamba2ForCausalLM")
def zamba2_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Zamba2: embeddings and head vocab-parallel; every Mamba2 mixer (a Mamba layer's and each hybrid
    layer's) by heads; the shared attention block by heads (``_zamba2_block_plan``; each hybrid layer
    holds its own copy of the module with the parameters tied, which ``apply_tp`` re-ties after
    sharding, and FSDP2 shards as one unit: ``data/fsdp.shared_submodules``); each hybrid layer's own
    ``linear`` replicated. Under SP the residual stream (and the embeddings the blocks concatenate
    to it) stays sequence-sharded: every norm before a TP region all-gathers, row-parallel outputs
    reduce-scatter, and ``linear`` runs on the local tokens (its gradient summed over TP)."""
    sp = sequence_parallel

    def in_norm() -> ParallelStyle:
        return (SequenceParallelAllGatherActivation(use_local_output=False) if sp
                else LocalReplicateParallel(output_layouts=Replicate()))

    plan: dict[str, ParallelStyle] = {"model.embed_tokens": embedding_style(sp), "lm_head": lm_head_style(sp),
                                      "model.final_layernorm": SequenceParallel() if sp else LocalReplicateParallel()}
    if sp and getattr(model.model, "rotary_emb", None) is not None:
        plan["model.rotary_emb"] = RotaryEmbedParallel()
    mamba_out = LocalReplicateParallel(output_layouts=Shard(1) if sp else None)
    for index, layer in enumerate(model.model.layers):
        path = f"model.layers.{index}"
        decoder = getattr(layer, "mamba_decoder", layer)
        decoder_path = path + (".mamba_decoder" if decoder is not layer else "")
        plan[f"{decoder_path}.input_layernorm"] = in_norm()
        if getattr(decoder.mamba, MARK, False):
            plan[f"{decoder_path}.mamba"] = hf_mamba_style(decoder.mamba, sp, mamba_out)
        block = getattr(layer, "shared_transformer", None)
        if block is None:
            if sp:
                plan[path] = _WithoutEmbeddings()
            continue
        plan[f"{path}.linear"] = TokenwiseParallel() if sp else LocalReplicateParallel()
        plan.update(_zamba2_block_plan(f"{path}.shared_transformer", block, sp, in_norm))
    return plan


@register_hf_plan("lfm2_moe", "Lfm2MoeForCausalLM")
def lfm2_moe_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """LFM2-MoE: LFM2's plan; its MoE blocks (``feed_forward``) with experts on their intermediate dim."""
    return {**lfm2_plan(model, sequence_parallel), **moe_blocks_plan(model, sequence_parallel, "feed_forward")}


@register_hf_plan("qwen3_next", "Qwen3NextForCausalLM")
@register_hf_plan("qwen3_5_text", "Qwen3_5ForCausalLM")
@register_hf_plan("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")
def qwen3_next_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Qwen3-Next, Qwen3.5 (dense and MoE): gated DeltaNets (``linear_attn``) by heads
    (``tensor/gdn.py``); gated attention by heads (``q_proj`` rows are ``[q_h | gate_h]`` per head,
    a plain column split) with per-head q/k norms; MoE blocks or dense MLPs."""
    plan = moe_decoder_plan(model, sequence_parallel, head_norms=("q_norm", "k_norm"))
    plan["model.layers.*.linear_attn"] = GDNHeadParallel(sequence_parallel=sequence_parallel)
    return plan


@register_hf_plan("olmo_hybrid", "OlmoHybridForCausalLM")
def olmo_hybrid_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """OLMo-Hybrid: attention layers as OLMo3 (q/k norms over all heads: gathered attention, post-block
    norms); gated DeltaNet layers (pre-block norms) by heads; per layer index."""
    attention = olmo2_plan(model, sequence_parallel)
    linear = decoder_plan(sequence_parallel, rotary=None, in_norms=("input_layernorm", "post_attention_layernorm"),
                          shared_norm_output=True)
    every = "model.layers.*."
    plan = {k: v for k, v in attention.items() if not k.startswith(every)}  # embeddings, rotary, final norm
    for index, layer in enumerate(model.model.layers):
        gdn = hasattr(layer, "linear_attn")
        own = {k[len(every):]: v for k, v in (linear if gdn else attention).items() if k.startswith(every)}
        plan.update({f"model.layers.{index}.{k}": v for k, v in own.items() if not (gdn and k.startswith("self_attn."))})
        if gdn:
            plan[f"model.layers.{index}.linear_attn"] = GDNHeadParallel(sequence_parallel=sequence_parallel)
    if getattr(model.model, "rotary_emb", None) is None:
        plan.pop("model.rotary_emb", None)
    return plan


@register_hf_plan("gpt_oss", "GptOssForCausalLM")
def gpt_oss_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """GPT-OSS: Llama attention (biased q/k/v/o) with its sinks by head (``HeadShardedSinks``), MoE
    blocks (router ``router``, replicated; biased, interleaved experts split on the intermediate dim)."""
    plan = moe_decoder_plan(model, sequence_parallel)
    plan["model.layers.*.self_attn"] = HeadShardedSinks()
    for i in range(len(model.model.layers)):
        plan[f"model.layers.{i}.mlp.router"] = LocalReplicateParallel()
        if sequence_parallel:  # the block returns (partial hidden states -> reduce-scatter, router scores)
            plan[f"model.layers.{i}.mlp"] = moe_block_sp_style(extra_outputs=1)
    return plan
