"""Tensor-parallel plans: Hugging Face plan translation, the registered plans, the default.

The registry (``tp_registry``) maps a model class's ``module.qualname`` to a plan function
``plan_fn(model, sequence_parallel) -> {module pattern: ParallelStyle}``. Importing this
module registers:

- ``hf_plans.dense``: dense Hugging Face decoders (Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3,
  Granite, Cohere, Starcoder2, Phi, Phi3, OLMo2, GPT-NeoX, StableLM, GPT-2), with sequence
  parallelism;
- ``hf_plans.moe_hybrid``: mixture-of-experts and Mamba hybrids (Mixtral, Qwen2-MoE, Qwen3-MoE,
  NemotronH, Falcon-H1, Bamba);
- ``hf_plans.mamba1``: Jamba, FalconMamba, Mamba (Mamba1 mixers by channel);
- ``hf_plans.mla``: multi-head latent attention by heads (DeepSeek-V2/V3); ``hf_plans.kimi_linear``: Kimi
  Linear (KDA layers by heads, MLA layers as DeepSeek-V3's); ``hf_plans.sinks``: Granite-SWA, Granite-MoE-SWA,
  MiMo-V2-Flash, Flint (attention sinks sharded with their heads); ``hf_plans.recurrent_gemma``: RecurrentGemma
  (RG-LRU blocks and MQA by heads);
- ``HybridLM`` (lazily, ``tp_hybrid``) and ``"default"``, a Llama-shaped guess for unknown
  classes (``tp_check`` refuses it where it does not fit).

``hf_tp_plan`` translates a model's own ``tp_plan`` strings (no sequence parallelism),
including the MoE styles ``moe_tp_experts`` / ``packed_colwise`` (``GroupedExpertsParallel``
shards every parameter of the experts module itself).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from hybridpar.parallel.tensor.decoder import decoder_plan, lm_head_style
from hybridpar.parallel.tensor.linear_styles import PackedColwiseParallel
from hybridpar.parallel.tensor.moe import GroupedExpertsParallel
from hybridpar.parallel.tensor.registry import (
    PlanEntry,
    class_key,
    known_plan_names,
    lookup_tp_plan,
    register_tp_plan,
    unregister_tp_plan,
)
from hybridpar.parallel.tensor.styles import LocalReplicateParallel, VocabParallelEmbedding

__all__ = [
    "PlanEntry", "register_tp_plan", "unregister_tp_plan", "lookup_tp_plan", "known_plan_names", "class_key",
    "hf_style", "hf_tp_plan", "default_plan",
]

_MOE_EXPERTS = "moe_tp_experts"


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
        "packed_colwise": lambda: PackedColwiseParallel(split_factor=2),
        _MOE_EXPERTS: lambda: GroupedExpertsParallel(),
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
    only covers the LM head (then it shards nothing worth having).

    Entries naming a parameter of an experts module (``...experts.gate_up_proj``) are
    covered by that module's ``moe_tp_experts`` entry and dropped.
    """
    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    if not any(k != "lm_head" for k in plan):
        return None
    experts = [k for k, v in plan.items() if v == _MOE_EXPERTS]
    plan = {k: v for k, v in plan.items() if k.rpartition(".")[0] not in experts}
    embed = getattr(getattr(model, "base_model", None), "embed_tokens", None)
    prefix = getattr(model, "base_model_prefix", "model")
    if isinstance(embed, nn.Embedding) and not any(k.endswith("embed_tokens") for k in plan):
        plan[f"{prefix}.embed_tokens"] = "embedding_rowwise"
    styles = {pattern: hf_style(style) for pattern, style in plan.items()}
    if "lm_head" in styles:
        styles["lm_head"] = lm_head_style(False)
    return styles


@register_tp_plan("default", aliases=("llama_style",))
def default_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Generic fallback for Llama-shaped models (``model.layers.*.self_attn``/``mlp``);
    fused ``qkv_proj``/``gate_up_proj`` are left out: a plain column split of a fused
    weight mixes q, k and v rows. Each norm's output is one replicated DTensor (``shared_norm_output``)."""
    return decoder_plan(sequence_parallel, shared_norm_output=True)


# Our own model: the plan (Mamba2 mixer by heads, attention, MLP, vocab-parallel embedding
# and head) lives in hybridpar.parallel.tensor.hybrid and is imported on first use.
if lookup_tp_plan("hybridpar.models.hybrid.HybridLM") is None:  # tensor.hybrid registers itself when imported first
    register_tp_plan("hybridpar.models.hybrid.HybridLM", "hybridpar.parallel.tensor.hybrid:hybrid_lm_plan",
                     aliases=("HybridLM",))

# The Hugging Face plans register themselves on import.
from hybridpar.parallel.tensor.hf_plans import (  # noqa: E402,F401
    dense, gemma3n, kimi_linear, llama4, mamba1, mla, moe_hybrid, recurrent_gemma, sinks)
