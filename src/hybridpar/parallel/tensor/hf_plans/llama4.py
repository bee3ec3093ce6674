"""Tensor-parallel plan for Llama 4 text (``Llama4ForCausalLM``): attention by heads, dense MLPs and the shared expert
on their intermediate dim, the routed experts through ``GroupedExpertsParallel``.

Two things Hugging Face's own plan leaves to chance:

- ``Llama4TextExperts`` stores its experts transposed (``gate_up_proj [E, D, 2I]``, ``down_proj [E, I, D]``) without
  an ``is_transposed`` flag; ``experts_transposed`` reads it off the shapes, so the intermediate dim is the one split;
- ``Llama4TextMoe`` adds the routed experts' sum into the shared expert's output in place
  (``out.add_(routed)``); a row-parallel ``down_proj`` returns its all-reduced ``[T, D]`` as a view made by a custom
  autograd Function, which autograd refuses to modify in place, so that output is handed over as its own tensor.

No sequence parallelism (``Llama4TextMoe`` flattens ``[B, S, D]`` to tokens; the Hugging Face plan has none either).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from hybridpar.parallel.tensor.decoder import decoder_plan
from hybridpar.parallel.tensor.hf_plans.dense import register_hf_plan
from hybridpar.parallel.tensor.moe import GroupedExpertsParallel

__all__ = ["llama4_plan", "OwnOutputRowwiseParallel"]


class OwnOutputRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` whose all-reduced plain output ``[T, D]`` is a tensor of its own (one copy), not the view
    ``to_local`` returns, so the caller may add into it in place."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return outputs.clone() if use_local_output else outputs


@register_hf_plan("llama4", "Llama4ForCausalLM", sequence_parallel=False)
def llama4_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """q/k/v column-parallel, o row-parallel; ``feed_forward`` (dense layers) gate/up column, down row; in MoE layers
    the shared expert likewise (its down's output its own tensor) and the routed experts on their intermediate dim."""
    shared = "model.layers.*.feed_forward.shared_expert"
    plan = decoder_plan(False, mlp="feed_forward")
    plan.update({f"{shared}.gate_proj": ColwiseParallel(), f"{shared}.up_proj": ColwiseParallel(),
                 f"{shared}.down_proj": OwnOutputRowwiseParallel(),
                 "model.layers.*.feed_forward.experts": GroupedExpertsParallel()})
    return plan
