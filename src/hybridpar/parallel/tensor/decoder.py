"""The plan builder for decoder-only causal LMs, and the LM head style.

Without sequence parallelism (SP) activations between blocks are replicated plain tensors
and norms are replicated (``LocalReplicateParallel``). With SP the residual stream is a
``Shard(1)`` DTensor:

    ids [B, S] -> vocab-parallel embedding -> reduce-scatter -> [B, S/tp, D]
    in-norm (input_layernorm, ...) [B, S/tp, D] -> all-gather once -> [B, S, D]
        -> column-parallel projections [B, S, n/tp] -> block -> row-parallel out projection
        -> partial [B, S, D] -> reduce-scatter -> [B, S/tp, D]
    post-norm (Gemma, OLMo2: on the block output) stays on [B, S/tp, D]
    final norm [B, S/tp, D] -> LM head: all-gather -> [B, S, V/tp] -> all-gather -> [B, S, V]
                                 (the loss: all-gather -> [B, S, D] -> vocab-parallel lm_head_loss)

A block without an input norm (OLMo2) reads the residual stream directly: its column-parallel
projections declare a ``Shard(1)`` input and each all-gather it.

A layer whose two branches are added into the residual (Phi, Cohere, GPT-NeoX, StableLM with a
parallel residual; Falcon-H1's attention and Mamba2; Granite 4.0-H's MoE block and shared MLP) leaves
each branch's row-parallel output ``Partial`` and reduces their sum once (``SummedBranchesLayer``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

from hybridpar.parallel.tensor.styles import (
    LocalReplicateParallel,
    RotaryEmbedParallel,
    SequenceParallelAllGatherActivation,
    VocabParallelEmbedding,
    map_first_input,
    replicated_input,
)

__all__ = ["VocabParallelLMHead", "SummedBranchesLayer", "PARTIAL_EXIT", "lm_head_style", "embedding_style",
           "decoder_plan"]

# a row-parallel branch exit left to its layer: partial [B, S, D], reduced with the other branch (SummedBranchesLayer)
PARTIAL_EXIT = dict(output_layouts=Partial(), use_local_output=False)


class VocabParallelLMHead(ColwiseParallel):
    """``ColwiseParallel`` for an LM head whose loss is vocab-parallel.

    A forward that computes logits gathers them to ``[B, S, V]`` (``output_layouts``). The
    training loss computes none: ``hf_causal_lm_loss``'s seam takes the head's input (after the
    input all-gather under SP, the one the loss needs) to the vocab-parallel ``lm_head_loss``
    and hands the head zero positions, whose ``[B, 0, V]`` output is made here, with no
    collective, as in ``HybridLM``, whose loss never calls its head.
    """

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.numel() == 0:  # the loss seam: no logits, nothing to gather
            return outputs.to_local().new_empty(outputs.shape)
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


class SummedBranchesLayer(ParallelStyle):
    """A decoder layer whose branches' row-parallel outputs stay ``Partial`` (``PARTIAL_EXIT``) and
    are reduced once, after transformers' forward has added them, instead of once per branch.

    DTensor adds ``Partial`` terms without a collective, and a ``Replicate`` residual joins the sum as
    ``x / tp`` per rank (its ``Replicate -> Partial``, no collective)::

        without SP: x [B, S, D] plain -> Replicate DTensor on entry
                    x + p_attn + p_mlp (any order): Partial [B, S, D] -> one all-reduce on exit -> plain
        with SP:    x [B, S/tp, D] Shard(1); (p_a + p_b) + x: one reduce-scatter as the Partial sum meets
                    the shard (Phi, GPT-NeoX, Falcon-H1, Granite 4.0-H); x + p_a + p_b (Cohere, StableLM)
                    still reduce-scatters each branch, as before. That reduce-scatter is DTensor's, inside
                    the add, so the gradient reaches the branches as Shard(1): each branch output's is
                    all-gathered once as it leaves the branch (``_ReplicatedGrad``), as a row-parallel
                    exit's backward does, not by each of the out projection's two gradient matmuls

    A norm that reads a ``Partial`` mid-layer sum (Falcon-H1's ``pre_ff_layernorm``, Granite's
    ``post_attention_layernorm``; a sequential GPT-NeoX layer) all-reduces it once on entry
    (``LocalReplicateParallel``), so a sequential layer keeps its two reductions. Backward: no
    collective here (the gradient of a ``Partial -> Replicate`` reduction is the replicated one).
    """

    def __init__(self, *, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _enter(self, mesh: DeviceMesh, mod, args, kwargs):
        if self.sequence_parallel:  # already a Shard(1) DTensor
            return args, kwargs
        return map_first_input(args, kwargs, "hidden_states", partial(replicated_input, mesh=mesh))

    def _exit(self, mesh: DeviceMesh, mod, args, output):
        def reduce(y):
            if not isinstance(y, DTensor):
                return y
            if self.sequence_parallel:  # Partial [B, S, D] -> reduce-scatter [B, S/tp, D] (Shard(1): as is)
                return y.redistribute(mesh, [Shard(1)])
            return y.redistribute(mesh, [Replicate()]).to_local()  # Partial [B, S, D] -> all-reduce
        return (reduce(output[0]), *output[1:]) if isinstance(output, tuple) else reduce(output)

    @staticmethod
    def _branch_exit(mod, args, output):
        def wrap(y):
            return _ReplicatedGrad.apply(y) if isinstance(y, DTensor) and y.placements == (Partial(),) else y
        return (wrap(output[0]), *output[1:]) if isinstance(output, tuple) else wrap(output)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(partial(self._enter, device_mesh), with_kwargs=True)
        module.register_forward_hook(partial(self._exit, device_mesh))
        if self.sequence_parallel:
            for child in module.children():  # the branches (a norm's Replicate output is left alone)
                child.register_forward_hook(self._branch_exit)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_parallel={self.sequence_parallel})"


class _ReplicatedGrad(torch.autograd.Function):
    """Identity on a branch's ``Partial [B, S, D]`` output; backward: its gradient as ``Replicate``
    (``Shard(1)`` ``[B, S/tp, D]`` -> all-gather -> ``[B, S, D]``), the layout a row-parallel exit's needs."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and grad.placements != (Replicate(),):
            grad = grad.redistribute(grad.device_mesh, [Replicate()])
        return grad


def lm_head_style(sequence_parallel: bool) -> ParallelStyle:
    """The LM head: column-parallel (vocab-sharded weight), logits gathered to [B, S, V] when
    computed; the training loss is vocab-parallel and gathers none (``VocabParallelLMHead``).

    The one place that decides the LM head's layout for the Hugging Face plans.
    """
    if sequence_parallel:  # [B, S/tp, D] -> all-gather -> [B, S, V/tp] -> all-gather -> [B, S, V]
        return VocabParallelLMHead(input_layouts=Shard(1), output_layouts=Replicate())
    return VocabParallelLMHead(output_layouts=Replicate())  # [B, S, V/tp] -> [B, S, V]


def embedding_style(sequence_parallel: bool) -> ParallelStyle:
    """Vocab-parallel token embedding; under SP its output is the sequence-sharded stream."""
    if sequence_parallel:  # [B, S] ids -> [B, S/tp, D] DTensor
        return VocabParallelEmbedding(output_layouts=Shard(1), use_local_output=False)
    return VocabParallelEmbedding()


def decoder_plan(sequence_parallel: bool, *, prefix: str = "model", layers: str = "layers",
                 embed: str = "embed_tokens", rotary: str | None = "rotary_emb", final_norm: str = "norm",
                 lm_head: str = "lm_head", attn: str = "self_attn", qkv=("q_proj", "k_proj", "v_proj"),
                 attn_out: str = "o_proj", gather_attention: bool = False, mlp: str = "mlp",
                 mlp_in=("gate_proj", "up_proj"), gather_mlp: bool = False, mlp_out: str = "down_proj",
                 in_norms=("input_layernorm", "post_attention_layernorm"), post_norms=(), head_norms=(),
                 residual_inputs: bool = False, shared_norm_output: bool = False,
                 summed_branches: bool = False) -> dict[str, ParallelStyle]:
    """A decoder plan; module names are relative to one decoder layer (``prefix.layers.*``).

    - ``gather_attention``: q/k/v (or a fused qkv) column-parallel with the output gathered,
      attention computed whole on every rank, the out projection row-parallel on a replicated
      input. For attention code that needs every head (OLMo2's q/k norm over all heads,
      Phi3's qkv split by config head counts). Weights are still sharded.
    - ``gather_mlp``: the same for the MLP (a fused ``[gate | up]`` projection that is chunked
      after the projection: Phi3); the activation runs whole on every rank.
    - ``in_norms`` normalize a block's input (all-gathered under SP); ``post_norms`` a block's
      output before the residual add (stay sequence-sharded); ``head_norms`` are norms inside
      the attention (q/k norms), on local heads (gradients summed over TP) or on the gathered
      heads with ``gather_attention``.
    - ``residual_inputs``: blocks read the residual stream without an input norm (OLMo2).
    - ``shared_norm_output`` (without SP): an in-norm's output is one replicated DTensor that every
      column-parallel projection of its block reads, so their input gradients (partial sums over
      TP) add up before one all-reduce instead of one each (q, k, v: 3 -> 1; gate, up: 2 -> 1), as
      under SP. Every reader of it takes the DTensor: column-parallel projections, a mixer on
      hybridpar's core (``local_mixer_input``), a MoE block (``moe.expert_input``: router, experts and
      shared experts add up as well). With ``residual_inputs`` (no in-norm) the attention's and the
      MLP's input is made that DTensor on entry (``PrepareModuleInput``).
    - ``summed_branches``: the attention's and the MLP's out projections leave ``Partial`` outputs that
      the layer adds and reduces once (``SummedBranchesLayer``); a layer whose branches are added into
      the residual together (Phi, Cohere, GPT-NeoX, Falcon-H1, Granite 4.0-H).
    """
    sp = sequence_parallel
    layer = f"{prefix}.{layers}.*"
    reduce_out = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    if summed_branches:
        reduce_out = PARTIAL_EXIT
    col_in = dict(input_layouts=Shard(1)) if sp and residual_inputs else {}
    plan: dict[str, ParallelStyle] = {f"{prefix}.{embed}": embedding_style(sp), lm_head: lm_head_style(sp)}
    if summed_branches:
        plan[layer] = SummedBranchesLayer(sequence_parallel=sp)
    if gather_attention:
        plan.update({f"{layer}.{attn}.{p}": ColwiseParallel(output_layouts=Replicate(), **col_in) for p in qkv})
        # [B, S, H d] replicated -> local column slice -> partial [B, S, D] -> all-reduce / reduce-scatter
        plan[f"{layer}.{attn}.{attn_out}"] = RowwiseParallel(input_layouts=Replicate(), **reduce_out)
    else:
        plan.update({f"{layer}.{attn}.{p}": ColwiseParallel(**col_in) for p in qkv})
        plan[f"{layer}.{attn}.{attn_out}"] = RowwiseParallel(**reduce_out)
    # per-head norms: on local heads the gradients are partial sums over TP; on gathered heads full
    plan.update({f"{layer}.{attn}.{n}": LocalReplicateParallel(grad_allreduce=not gather_attention) for n in head_norms})
    if gather_mlp:
        plan.update({f"{layer}.{mlp}.{p}": ColwiseParallel(output_layouts=Replicate(), **col_in) for p in mlp_in})
        plan[f"{layer}.{mlp}.{mlp_out}"] = RowwiseParallel(input_layouts=Replicate(), **reduce_out)
    else:
        plan.update({f"{layer}.{mlp}.{p}": ColwiseParallel(**col_in) for p in mlp_in})
        plan[f"{layer}.{mlp}.{mlp_out}"] = RowwiseParallel(**reduce_out)
    if not sp:
        if shared_norm_output and residual_inputs:  # plain [B, S, D] -> Replicate DTensor: one gradient all-reduce
            replicated = {"hidden_states": Replicate()}
            plan[f"{layer}.{attn}"] = PrepareModuleInput(input_kwarg_layouts=replicated,
                                                         desired_input_kwarg_layouts=replicated)
            plan[f"{layer}.{mlp}"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                        desired_input_layouts=(Replicate(),))
        shared = dict(output_layouts=Replicate()) if shared_norm_output else {}
        for norm in in_norms:  # [B, S, D] replicated; a DTensor: one all-reduce of its gradient in backward
            plan[f"{layer}.{norm}"] = LocalReplicateParallel(**shared)
        for norm in post_norms:
            plan[f"{layer}.{norm}"] = LocalReplicateParallel()
        plan[f"{prefix}.{final_norm}"] = LocalReplicateParallel()
        return plan
    if rotary:
        plan[f"{prefix}.{rotary}"] = RotaryEmbedParallel()
    for norm in in_norms:  # [B, S/tp, D] -> [B, S, D] once per norm
        plan[f"{layer}.{norm}"] = SequenceParallelAllGatherActivation(use_local_output=False)
    for norm in post_norms:
        plan[f"{layer}.{norm}"] = SequenceParallel()
    plan[f"{prefix}.{final_norm}"] = SequenceParallel()
    return plan
