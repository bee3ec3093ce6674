"""Tensor-parallel plan for Gemma 3n text (``Gemma3nForCausalLM``): Hugging Face's plan, but the MLP of a layer
with activation sparsity stays whole.

A sparse layer's MLP keeps ``gelu(g)`` only where ``g > mean(g) + z * std(g)`` (``z = Phi^-1(sparsity)``), the mean
and standard deviation taken over the intermediate dim: column-parallel ``gate_proj`` would give each rank the
statistics of its own half, a different cut-off (the real E2B/E4B checkpoints make their first 10 layers 95% sparse).
Those MLPs are left to the replicated fallback (every rank computes the whole MLP, exact); the dense layers' MLPs and
every attention keep the column/row split. No sequence parallelism (the Hugging Face plan has none).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle

from hybridpar.parallel.tensor.decoder import decoder_plan
from hybridpar.parallel.tensor.hf_plans.dense import register_hf_plan

__all__ = ["gemma3n_plan"]

_MLP = ("gate_proj", "up_proj", "down_proj")


@register_hf_plan("gemma3n", "Gemma3nForCausalLM", sequence_parallel=False)
def gemma3n_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Hugging Face's plan (q/k/v and gate/up column-parallel, o and down row-parallel, the per-head norms replicated
    with their gradients summed) with ``layers.*.mlp.*`` written out for the layers whose activation sparsity is 0."""
    prefix = "model"
    styles = decoder_plan(False, prefix=prefix, head_norms=("q_norm", "k_norm", "v_norm"))
    wildcard = f"{prefix}.layers.*.mlp"
    mlp = {name: styles.pop(f"{wildcard}.{name}") for name in _MLP if f"{wildcard}.{name}" in styles}
    sparsity = list(getattr(model.config, "activation_sparsity_pattern", None) or [])
    for index in range(model.config.num_hidden_layers):
        if index >= len(sparsity) or not sparsity[index]:
            for name, style in mlp.items():
                styles[f"{prefix}.layers.{index}.mlp.{name}"] = style  # as the wildcard did: one style, many modules
    return styles
