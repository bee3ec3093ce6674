"""Bytes each rank sends per training step, by collective kind and mesh dimension.

The closed forms are ``parallel.comm.step``'s (held equal to ``CommStats``' counts of a real step in
``tests/distributed/comm/test_step.py``): the trainer's all-reduces, TP/SP entry and exit of every
block, the embedding and the vocab-parallel loss, CP attention and CP Mamba, FSDP all-gathers,
reduce-scatters and HSDP all-reduces, and gradient clipping. They count one step without
activation checkpointing. With ``full`` or ``selective`` the recomputation of each block repeats
its forward collectives (TP/SP entry and exit, CP exchanges) once more per pack; that share is
listed as source ``recompute`` (the forward half of ``tp_blocks``, ``cp_attention``, ``cp_mamba``; a
transformers decoder planned through its twin also repeats each attention's exit reduction, which
sits mid-layer in its one checkpoint per layer; with one Mamba group under TP, each Mamba layer's
gated norm all-reduces its sum of squares again). Under SP a twin's parallel layer (``P``, Falcon-H1)
reduce-scatters its two branches' sum once, and each branch all-gathers its gradient in backward:
one ``[Ts, D]`` all-gather per layer and pack more (source ``tp_branches``).
A Zamba2 twin's shared blocks (``Z``: ``plan/hf/zamba2.zamba2_traffic``) replace the ``fsdp`` and
``tp_norm_grads`` sources (their weights are one unit and their norms trained once, whatever the uses) and
add ``tp_shared_block`` (each use's attention entry and exit, fused MLP gathers, adapter gradients).
``cp_attention=ring`` sends point to point (kind ``send``; ``context/ring.py``'s
count, not yet held to a measurement). ``cp_mamba=state`` sends per document: ``docs_per_pack`` documents are assumed in every pack.
Under LoRA (``peft.method=lora``) the closed forms read the adapters (``plan/params.adapter_params``):
FSDP gathers them with their units and reduces only theirs, each replicated factor's gradient is
all-reduced over TP (``tp_adapters``), and a backward collective runs only where a gradient
reaches it (``parallel/comm/grad_flow.py``: none in the blocks before the first adapter, no
entry gradient into the first, no embedding or norm gradient); only the blocks a gradient
reaches are recomputed under checkpointing.
"""

from __future__ import annotations

import dataclasses

from hybridpar.models.mamba.mixer import replicated_groups
from hybridpar.parallel.comm.step import SOURCES, StepShape, Tally, attention_layers, dim_label, sent, step_collectives
from hybridpar.plan.hf.moe import moe_traffic, router_aux_traffic
from hybridpar.plan.hf.zamba2 import attention_twin, is_zamba2, zamba2_recomputed, zamba2_traffic
from hybridpar.plan.layout import Layout
from hybridpar.plan.params import adapter_params, grad_flow

__all__ = ["step_traffic", "by_kind", "by_kind_and_dim"]

# The forward collectives a block's recomputation runs again: (source, kind) -> share of that source's calls.
# The CP exchanges into and out of the core are half of the all-to-alls and every all-gather; SP's norm
# all-gather (a block's entry) is repeated too (``step_traffic``). The exit reduce-scatter / all-reduce is
# not repeated (the recomputation stops before a block's last matmul).
RECOMPUTED = {("cp_attention", "all_gather"): 1.0, ("cp_attention", "all_to_all"): 0.5, ("cp_mamba", "all_gather"): 1.0,
              ("cp_mamba", "all_to_all"): 0.5}


def step_shape(layout: Layout, docs_per_pack: int = 1) -> StepShape:
    """What the step's closed forms read. Under autocast a transformers decoder's norms return the stream's
    dtype, so its blocks' entries move ``e_s``; its layers that reduce their branches with the residual
    (Falcon-H1, Granite 4.0-H: ``summed_branches``) exit in ``e_s`` too, except under SP; a MoE block's
    output is its input's dtype (transformers' experts cast their combined rows back to it: ``e_s`` under
    autocast, ``e`` under FSDP's bf16; ``e_c`` before, 2 bytes off under FSDP's bf16 with TP); under mixed
    precision (FSDP's too: buffers stay float32) Falcon-H1's ``mup_vector`` makes its Mamba core's inputs
    float32 (``e_c``)."""
    m, e, es = layout.packs_per_rank, layout.act_bytes, layout.stream_bytes
    entry = es if layout.hf_decoder else e
    exit_ = es if layout.hf_decoder and getattr(layout.model, "summed_branches", False) and not layout.sp else e
    mamba = layout.compute_bytes if "P" in layout.model.pattern and layout.mixed_precision == "bf16" else e
    adapters = adapter_params(layout) if layout.lora_rank else None
    return StepShape(layout.model, layout.dims, layout.pack_size, m, e, layout.sequence_parallel, layout.cp_attention,
                     layout.cp_mamba, layout.reshard_after_forward, (docs_per_pack,) * m, es, entry, exit_,
                     entry, mamba, adapters, 2 if layout.mixed_precision == "bf16" else layout.adapter_bytes,
                     layout.adapter_bytes, layout.paired)


def ring_attention(layout: Layout) -> Tally:
    """``cp_ring``: K, V hop P-1 times forward and again backward, dK, dV (compute dtype) P hops, as sends."""
    c, cp, e = layout.model, layout.cp, layout.act_bytes
    kv = layout.tokens * 2 * c.num_key_value_heads // layout.tp * c.head_dim
    out, layers = Tally(), (attention_layers(c.pattern) + c.pattern.count("Z")) * layout.packs_per_rank
    out.add("send", "cp", kv * e, 2 * (cp - 1) * layers)
    out.add("send", "cp", kv * layout.compute_bytes, cp * layers)
    return out


def step_traffic(layout: Layout, docs_per_pack: int = 1) -> dict[str, Tally]:
    """Each source's ``Tally`` ``{(kind, dim): [calls, bytes]}`` for one step, ``recompute`` included."""
    shape = step_shape(layout, docs_per_pack)
    if is_zamba2(layout.model):  # every shared block's use attends (Z read as *); its units, norms and TP
        shape = dataclasses.replace(shape, model=attention_twin(layout.model))  # collectives: plan/hf/zamba2.py
    priced = StepShape(**{**shape.__dict__, "cp_attention": "allgather"}) if layout.cp_attention == "ring" else shape
    sources = step_collectives(priced)
    if is_zamba2(layout.model):
        sources.update(zamba2_traffic(layout, priced))
    if layout.cp_attention == "ring" and layout.cp > 1:
        sources["cp_attention"] = ring_attention(layout)
    if "E" in layout.model.pattern or getattr(layout.model, "mlp_fused", False):
        sources["tp_moe"] = moe_traffic(layout)  # routing weights, Granite's fused shared_mlp, latent projections
        sources["router_aux"] = router_aux_traffic(layout)  # the load-balancing term's sums (cp, dp x cp)
    if layout.sp and "P" in layout.model.pattern:
        sources["tp_branches"] = branch_gradients(layout)
    if layout.checkpointing != "none":
        extra, c = Tally(), shape.model  # a Zamba2's Z read as *
        flow, pattern, m = shape.flow, c.pattern, layout.packs_per_rank
        # the blocks recomputed: those a gradient reaches (a decoder layer's checkpoint: where its output's does)
        redo = flow.recomputed(shape.paired)
        redone = {name: flow.count(redo, pattern, kinds) / max(1, sum(pattern.count(k) for k in kinds))
                  for name, kinds in (("cp_attention", "*P"), ("cp_mamba", "MP"))}
        trained = dataclasses.replace(shape, adapters=None)  # every backward runs: the shares below hold
        for (name, kind), share in RECOMPUTED.items():
            if layout.cp == 1 or (name == "cp_attention" and layout.cp_attention == "ring"):
                continue
            for (k, dim), (calls, nbytes) in SOURCES[name](trained).items():
                if k == kind and calls:
                    extra.add(kind, dim, nbytes // calls, round(calls * share * redone[name]))
        tp, label = layout.tp, dim_label(layout.dims, ("tp",))
        blocks, width = flow.count(redo, pattern) * m, c.hidden_size
        if layout.sp:  # each block's norm output is all-gathered again
            extra.add("all_gather", label, sent("all_gather", tp, layout.stream_tokens * width * shape.entry_size),
                      blocks)
        if tp > 1 and layout.paired:  # one checkpoint per decoder
            exit_kind = "reduce_scatter" if layout.sp else "all_reduce"  # layer: its mixer's exit runs again
            mixers = flow.count(redo, pattern, "*MP")  # P: one exit for both branches
            extra.add(exit_kind, label, sent(exit_kind, tp, layout.tokens * width * shape.exit_size),
                      mixers * layout.packs_per_rank)
        if replicated_groups(c.mamba_n_groups, layout.tp) and getattr(c, "mamba_gated_norm", True):  # one B/C group:
            # each Mamba layer's gated norm
            sums = sent("all_reduce", layout.tp, layout.tokens * layout.compute_bytes)  # all-reduces its sum of
            extra.add("all_reduce", dim_label(layout.dims, ("tp",)), sums,  # squares [Tc, 1] again
                      flow.count(redo, pattern, "MP") * layout.packs_per_rank)
        if "tp_moe" in sources:
            extra = extra + moe_traffic(layout, recomputed=redo)
        if is_zamba2(layout.model):  # a hybrid layer's recomputation: its shared block's mid-layer collectives
            extra = extra + zamba2_recomputed(layout, shape)
        sources["recompute"] = extra
    return sources


def branch_gradients(layout: Layout) -> Tally:
    """Under SP, a parallel layer's second branch all-gathers its own ``[Ts, D]`` output gradient (under
    LoRA where both branches have one)."""
    out, c, flow = Tally(), layout.model, grad_flow(layout)
    nbytes = sent("all_gather", layout.tp, layout.stream_tokens * c.hidden_size * layout.act_bytes)
    out.add("all_gather", dim_label(layout.dims, ("tp",)), nbytes, flow.count(flow.branches, c.pattern, "P") * layout.packs_per_rank)
    return out


def by_kind_and_dim(sources: dict[str, Tally]) -> dict[str, int]:
    """``{"all_gather/cp": bytes, ...}`` summed over sources."""
    total = Tally()
    for tally in sources.values():
        total = total + tally
    return {f"{kind}/{dim}": nbytes for (kind, dim), (calls, nbytes) in sorted(total.items()) if calls or nbytes}


def by_kind(sources: dict[str, Tally]) -> dict[str, int]:
    """``{"all_gather": bytes, ...}`` summed over sources and mesh dims."""
    out: dict[str, int] = {}
    for key, nbytes in by_kind_and_dim(sources).items():
        kind = key.split("/")[0]
        out[kind] = out.get(kind, 0) + nbytes
    return out
