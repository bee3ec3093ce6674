"""Tensor/sequence-parallel plans for Hugging Face mixture-of-experts and Mamba-hybrid models.

- MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, NemotronH ``moe`` layers): experts sharded on the
  intermediate dim (``GroupedExpertsParallel``), router replicated, shared experts column/row
  parallel inside the block; under SP the block reads the all-gathered norm output and
  returns the sequence shard (``moe_block_sp_style``).
- Mamba mixers of Hugging Face classes (Falcon-H1, Bamba, NemotronH) stay replicated: their
  fused ``in_proj`` and single-device kernels are not split by heads here (hybridpar's own
  ``HybridLM`` mixer is, in ``tp_hybrid``). Under SP a replicated mixer's output is sliced
  to the sequence shard (``LocalReplicateParallel(output_layouts=Shard(1))``).

The plans are built per model instance where layers differ (MoE or dense MLP, Mamba or
attention), with concrete layer indices.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from hybridpar.parallel.tensor.decoder import decoder_plan, embedding_style, lm_head_style
from hybridpar.parallel.tensor.moe import GroupedExpertsParallel, is_moe_block, moe_block_sp_style
from hybridpar.parallel.tensor.plans_hf import register_hf_plan
from hybridpar.parallel.tensor.styles import LocalReplicateParallel, SequenceParallelAllGatherActivation

__all__ = ["moe_block_plan", "moe_decoder_plan", "mixtral_plan", "qwen3_moe_plan", "falcon_h1_plan", "bamba_plan",
           "nemotron_h_plan"]


def moe_block_plan(path: str, block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Entries for one MoE block at ``path``: experts, router, shared experts and their gate."""
    plan: dict[str, ParallelStyle] = {f"{path}.experts": GroupedExpertsParallel(), f"{path}.gate": LocalReplicateParallel()}
    for shared in ("shared_expert", "shared_experts"):
        mlp = getattr(block, shared, None)
        if mlp is None:
            continue
        plan.update({f"{path}.{shared}.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj") if hasattr(mlp, p)})
        plan[f"{path}.{shared}.down_proj"] = RowwiseParallel()  # partial [T, D] -> all-reduce inside the block
    plan[f"{path}.shared_expert_gate"] = LocalReplicateParallel()
    for latent in ("fc1_latent_proj", "fc2_latent_proj"):  # NemotronH's optional latent projections
        plan[f"{path}.{latent}"] = LocalReplicateParallel()
    if sequence_parallel:
        plan[path] = moe_block_sp_style()
    return plan


def moe_decoder_plan(model: nn.Module, sequence_parallel: bool, **decoder) -> dict[str, ParallelStyle]:
    """``decoder_plan`` (attention, dense MLP layers, norms) plus every MoE block ``model.layers.i.mlp``."""
    plan = decoder_plan(sequence_parallel, **decoder)
    for index, layer in enumerate(model.model.layers):
        if is_moe_block(layer.mlp):
            plan.update(moe_block_plan(f"model.layers.{index}.mlp", layer.mlp, sequence_parallel))
    return plan


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
    """Falcon-H1: attention and MLP (``feed_forward``) sharded; the parallel Mamba2 branch is
    replicated (seed 004). Under SP the Mamba branch reads the all-gathered norm output and
    its replicated output joins the sequence-sharded attention output as a DTensor."""
    plan = decoder_plan(sequence_parallel, **_HYBRID)
    plan["model.layers.*.mamba"] = LocalReplicateParallel(output_as_dtensor=sequence_parallel)
    return plan


@register_hf_plan("bamba", "BambaForCausalLM")
def bamba_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Bamba: each layer is a Mamba2 mixer (replicated) or attention, then an MLP."""
    plan = decoder_plan(sequence_parallel, **_HYBRID)
    plan["model.layers.*.mamba"] = LocalReplicateParallel(output_layouts=Shard(1) if sequence_parallel else None)
    return plan


@register_hf_plan("nemotron_h", "NemotronHForCausalLM")
def nemotron_h_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """NemotronH: one mixer per layer (Mamba2, attention, MLP or MoE) after one norm. Hugging
    Face's own plan names MoE experts every layer and shards nothing else; this one shards
    attention, MLP and MoE layers and replicates the Mamba2 mixers."""
    sp = sequence_parallel
    reduce_out = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    plan: dict[str, ParallelStyle] = {
        "model.embeddings": embedding_style(sp),
        "model.layers.*.norm": SequenceParallelAllGatherActivation(use_local_output=False) if sp else LocalReplicateParallel(),
        "model.norm_f": SequenceParallel() if sp else LocalReplicateParallel(),
        "lm_head": lm_head_style(sp),
    }
    for index, layer in enumerate(model.model.layers):
        path = f"model.layers.{index}.mixer"
        kind = layer.block_type
        if kind == "full_attention":
            plan.update({f"{path}.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")})
            plan[f"{path}.o_proj"] = RowwiseParallel(**reduce_out)
        elif kind == "mlp":
            plan[f"{path}.up_proj"] = ColwiseParallel()
            plan[f"{path}.down_proj"] = RowwiseParallel(**reduce_out)
        elif kind == "moe":
            plan.update(moe_block_plan(path, layer.mixer, sp))
        else:  # Mamba2 ("linear_attention"): replicated, joins the residual stream as a shard under SP
            plan[path] = LocalReplicateParallel(output_layouts=Shard(1) if sp else None)
    return plan
