"""Peak memory per rank: what is live at the worst moment of a steady-state training step.

Walking one step's last pack (the worst: earlier packs' gradients are live) block by block::

    base          = params (sharded) + AdamW state                  (parameter_memory)
    G_acc         = gradients accumulated from earlier packs: unsharded under FSDP (one reduction
                    per step), 0 when the rank runs one pack
    root          = FSDP's gathered root (embeddings, norm_f, lm_head: never resharded), 0 without FSDP
    forward  i    = base + G_acc + root + sum_{j<i} saved_j + gathered(i) + gathered(i+1) + fwd_ws(i)
                    + sum_{j<i} logits_j (a MoE block's router logits, recorded to the forward's end)
    loss          = base + G_acc + root + sum_j saved_j + saved_head + loss_ws (forward / backward)
                    (+ every E block's logits in the forward, held for the router's load-balancing term)
    router aux    = loss without loss_ws + the term's workspace (``plan/hf/moe.router_aux_workspace``)
    backward i    = base + G_i + root + sum_{j<=i} saved_j - freed(i) + gathered(i) + gathered(i-1)
                    + bwd_ws(i) + unsharded grads of i (FSDP, before its reduce-scatter)
    optimizer     = params + grads + AdamW state + the largest parameter's update temporaries (x2)

with ``G_i`` the gradients of the units already done (root and the units after block i's; sharded
under FSDP) plus ``G_acc``; ``gathered(i)`` is the unsharded parameters of the FSDP unit that holds
block i (only under FSDP with ``reshard_after_forward``; with it off every unit stays gathered),
``gathered(i + 1)`` the next unit's (forward) and ``gathered(i - 1)`` the previous one's (backward's
prefetch). The unit is what ``parallel/data/fsdp.apply_fsdp`` shards: a transformers decoder layer.
A paired twin (``Layout.paired``: a mixer block then its MLP/MoE block per decoder layer, e.g.
Granite's mixer + MoE, Falcon-H1's ``P`` + MLP, Llama's attention + MLP) gathers both blocks as one
unit, and its unsharded gradients in block i's backward are those of the layer's blocks ``j >= i``
(the layer is reduce-scattered once, after its first block's backward); otherwise a unit is one
block. A Zamba2 twin's hybrid layer (``ZM``) is one unit, and a ``Z`` block's moments hold the shared
blocks' unit gathered too; their gradients are live from the backward of their last use on. The peak
is the maximum; the process baseline (CPU: the interpreter and libraries; GPU: the CUDA context) is
stated apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridpar.plan.activations import BLOCK_NAMES, block_kind_totals, block_saved_bytes, head_saved_bytes
from hybridpar.plan.hf.moe import router_aux_bytes, router_aux_workspace, router_logits_bytes
from hybridpar.plan.hf.zamba2 import SHARED_UNIT, fsdp_groups, is_zamba2
from hybridpar.plan.layout import Layout
from hybridpar.plan.lora import lora_block_bytes
from hybridpar.plan.params import ParameterMemory, grad_flow, parameter_memory
from hybridpar.plan.transients import Workspaces, block_workspaces, loss_workspaces

__all__ = ["MemoryPlan", "memory_plan", "fsdp_layers"]


@dataclass
class MemoryPlan:
    params: ParameterMemory
    saved_by_kind: dict  # bytes kept for backward per block kind (+ "head"), one pack
    peak_bytes: int
    peak_moment: str  # e.g. "backward of block 3 (mamba)"
    breakdown: dict = field(default_factory=dict)  # what is live at the peak

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved_by_kind.values())


def fsdp_layers(layout: Layout) -> list[tuple[int, ...]]:
    """The FSDP units as the block indices each holds (``apply_fsdp``'s units: HybridLM's blocks, a
    transformers model's decoder layers): a paired twin's ``(2 l, 2 l + 1)`` per layer, else one block."""
    n = len(layout.model.pattern)
    if is_zamba2(layout.model):  # a hybrid layer's Z and M blocks
        return fsdp_groups(layout.model)
    if layout.paired:
        return [tuple(range(i, min(i + 2, n))) for i in range(0, n, 2)]
    return [(i,) for i in range(n)]


def memory_plan(layout: Layout) -> MemoryPlan:
    params = parameter_memory(layout)
    pattern = layout.model.pattern
    units = [f"backbone.layers.{i}" for i in range(len(pattern))]
    flow = grad_flow(layout)  # LoRA: no backward runs in a block no gradient reaches
    saved = [lora_block_bytes(layout, i) if layout.lora_rank else block_saved_bytes(layout, kind)
             for i, kind in enumerate(pattern)]
    ws = [block_workspaces(layout, kind) for kind in pattern]
    if layout.paired and layout.checkpointing == "full":
        # one checkpoint per decoder layer: the backward of its MLP (MoE) half runs while its mixer's rebuilt
        # tensors are live too (Llama full 0.89-0.95 of the measured peak without; under selective the CPU
        # core's recomputed out and lse, which the plan counts as kept, already cover them)
        for i in range(1, len(pattern), 2):
            rebuilt = block_saved_bytes(layout, pattern[i - 1], "none") - block_saved_bytes(layout, pattern[i - 1])
            ws[i] = Workspaces(ws[i].forward, ws[i].backward + rebuilt, ws[i].freed)
    if is_zamba2(layout.model) and layout.checkpointing != "none":
        # a hybrid layer's one checkpoint: its Mamba block's backward runs first, the shared block's rebuilt tensors live
        rebuilt = block_saved_bytes(layout, "Z", "none") - block_saved_bytes(layout, "Z")
        for i in (i for i, kind in enumerate(pattern) if kind == "Z"):
            ws[i + 1] = Workspaces(ws[i + 1].forward, ws[i + 1].backward + rebuilt, ws[i + 1].freed)
    # router logits the forward holds beyond what a block keeps (plan/hf/moe.py: the load-balancing term's
    # softmax, counted in saved, stands in for its logits during the forward)
    logits = [router_logits_bytes(layout) - router_aux_bytes(layout, flow.input[i]) if kind == "E" else 0
              for i, kind in enumerate(pattern)]
    head = head_saved_bytes(layout)
    loss = loss_workspaces(layout)
    aux_logits = pattern.count("E") * router_logits_bytes(layout) if router_aux_bytes(layout) else 0
    e_p, fsdp, sharded = params.element_bytes, layout.fsdp, layout.shard > 1
    full_grad = {u: n * e_p for u, n in params.trainable_unit_numel.items()}  # LoRA: the adapters' only
    grad_after = {u: (-(-n // layout.shard) * e_p if fsdp else n * e_p) for u, n in params.trainable_unit_numel.items()}
    keep_gathered = sharded and layout.reshard_after_forward is False
    layers = fsdp_layers(layout)  # FSDP units as block indices: a paired twin's decoder layer is one
    layer_of = {i: u for u, blocks in enumerate(layers) for i in blocks}

    def gathered(u: int) -> int:  # FSDP unit u's unsharded parameters
        if not sharded or keep_gathered or not 0 <= u < len(layers):
            return 0
        shared = sum(params.gathered(SHARED_UNIT.format(b)) for b in range(getattr(layout.model, "shared_blocks", 0))
                     ) if any(pattern[i] == "Z" for i in layers[u]) else 0  # Zamba2: the shared blocks' unit
        return sum(params.gathered(units[i]) for i in layers[u]) + shared

    base = {"parameters": params.param_bytes, "optimizer": params.optimizer_bytes}
    accumulated = sum(full_grad.values()) if layout.packs_per_rank > 1 else 0
    root = params.gathered("") if sharded else 0
    all_gathered = sum(params.gathered(u) for u in params.unit_numel if u) if keep_gathered else 0
    moments: list[tuple[str, dict]] = []
    common = {**base, "accumulated_grads": accumulated, "fsdp_root": root + all_gathered}
    for i, kind in enumerate(pattern):
        u = layer_of[i]
        moments.append((f"forward of block {i} ({BLOCK_NAMES[kind]})", {
            **common, "activations": sum(saved[:i]), "fsdp_gathered": gathered(u) + gathered(u + 1),
            "workspace": ws[i].forward, "router_logits": sum(logits[:i])}))
    for name, workspace, held in (("loss forward", loss.forward, aux_logits), ("loss backward", loss.backward, 0),
                                  ("router auxiliary loss", router_aux_workspace(layout), aux_logits)):
        moments.append((name, {**common, "activations": sum(saved) + head, "workspace": workspace,
                               "router_logits": held}))
    for i in reversed(range(len(pattern))):
        if not flow.output[i]:  # no backward runs there
            continue
        u = layer_of[i]
        later = [units[j] for j in range(i + 1, len(units)) if layer_of[j] > u]  # units already reduced
        done = full_grad[""] if not fsdp else grad_after[""]
        done += sum(grad_after[n] if fsdp else full_grad[n] for n in later)
        if "Z" in pattern[i:]:  # Zamba2: the shared blocks' gradients, from the backward of their last use on
            done += sum((grad_after if fsdp else full_grad)[n] for n in full_grad if n.startswith(SHARED_UNIT.format("")))
        own = sum(full_grad[units[j]] for j in layers[u] if j >= i)  # this unit's gradients so far
        if not sharded:  # nothing waits for a reduce-scatter
            done += own - full_grad[units[i]]
        grads = accumulated if layout.packs_per_rank > 1 else done
        moments.append((f"backward of block {i} ({BLOCK_NAMES[pattern[i]]})", {
            **common, "accumulated_grads": 0, "gradients": grads, "activations": sum(saved[: i + 1]) - ws[i].freed,
            "fsdp_gathered": gathered(u) + gathered(u - 1), "workspace": ws[i].backward,
            "unsharded_grads": own if sharded and layout.packs_per_rank == 1 else 0}))
    largest = max((n for n in params.trainable_unit_numel.values()), default=0)
    moments.append(("optimizer step", {**base, "gradients": params.grad_bytes,
                                       "workspace": 2 * min(largest, params.per_rank) * e_p}))
    moment, breakdown = max(moments, key=lambda m: sum(m[1].values()))
    saved_by_kind = block_kind_totals(pattern)
    for kind, nbytes in zip(pattern, saved):
        saved_by_kind[BLOCK_NAMES[kind]] += nbytes
    saved_by_kind["head"] = head
    return MemoryPlan(params, saved_by_kind, sum(breakdown.values()), moment,
                      {k: v for k, v in breakdown.items() if v})
