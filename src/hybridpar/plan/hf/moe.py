"""What a twin's MoE block (pattern ``E``) and a fused gated MLP keep, use and send, per rank and pack.

Symbols of ``plan/layout.py``; ``k`` experts per token, ``E`` experts, ``I = moe_intermediate/tp``,
``Is = shared/tp``, ``S = Tc k`` routed rows. How many rows each expert gets depends on the routing,
but their total is exactly ``Tc k``, and transformers' ``grouped_mm`` experts (its default below
float64; float64 runs the eager loop, which keeps about the same per row, not measured) keep per
routed row, so every saved byte is shape-determined. What an ``E`` block keeps beyond every block's input, rstd, norm output and
transformers' norm product (``plan/activations.py``), policy ``none``::

    router    Granite (softmax of the top-k logits): top-k index [Tc, k] int64, softmax [Tc, k] e_c
              NemotronH (sigmoid, groups): scores [Tc, E] e_c, group top-2 index [Tc, G, 2] and group
              index [Tc, G_top] int64, mask [Tc, E] bool, top-k index [Tc, k] int64, and with
              norm_topk_prob the weights [Tc, k] and their sum [Tc, 1] e_c (its float32 copy of the
              input [Tc, D] e_c from a 16-bit stream)
    experts   S x (gathered input [D] + down output [D] (the weights' product reads it)
                   + gated [4 I] (gate|up, act(gate), product) or ungated [2 I] (relu2: relu, square)) e_s
                (the weights' dtype: ``grouped_mm`` has no autocast rule, so under autocast they run in float32)
              + S x (routing weight w_r e_c + three int64 indices: the sort's, its token index, its inverse)
              + offsets [E] int32
    shared    NemotronH's ungated MLP: [Tc, 2 Is] e; Granite's fused gated MLP: ``fused_mlp_saved``

A fused gated MLP (Granite's ``shared_mlp``: ``input_linear [2 Is_full, D]``) runs whole under TP
(``decoder_plan(gather_mlp=True)``): its ``[Tc, 2 Is/tp]`` output is all-gathered, the activation
runs on ``[Tc, Is_full]``, ``output_linear`` reads its local slice. It keeps ``[Tc, 4 Is]`` at tp=1
and ``[Tc, 2 Is_full + Is_full + Is_full/tp]`` (gathered, silu, slice) under TP.

The transient peak of one expert (its ``mm`` output) moves with the routing; the plan bounds the
forward and backward by the ``S``-row tensors (all rows of all experts at once), which is what the
grouped kernel allocates (``moe_workspaces``).

TP traffic beyond every block's entry and exit (``parallel.comm.step.tp_blocks``), from the plans
in ``parallel/tensor/hf_plans/moe_hybrid.py`` and ``parallel/tensor/moe.py`` (``moe_traffic``).
"""

from __future__ import annotations

from hybridpar.parallel.comm.step import Tally, _ring, dim_label
from hybridpar.plan.layout import Layout
from hybridpar.plan.params import grad_flow

__all__ = ["moe_saved_bytes", "fused_mlp_saved", "moe_workspaces", "moe_traffic", "moe_matmul_elements"]

INDEX = 8  # int64


def _moe(layout: Layout) -> dict:
    c, tp = layout.model, layout.tp
    return dict(experts=c.moe_experts, k=c.moe_top_k, inter=c.moe_intermediate_size // tp,
                shared=c.moe_shared_size // tp, rows=layout.tokens * c.moe_top_k, sigmoid=c.moe_router == "sigmoid")


def fused_mlp_saved(layout: Layout, size: int, frozen_out: bool = False, frozen_in: bool = False) -> int:
    """A fused gated MLP of intermediate ``size`` (full width): see the module docstring. Under LoRA
    ``frozen_out`` (no adapter on ``output_linear``): its input, the product's slice, is not kept;
    ``frozen_in`` (no gradient into ``input_linear``'s output): neither is what the activation keeps."""
    tc, e, tp = layout.tokens, layout.act_bytes, layout.tp
    return tc * e * ((0 if frozen_in else 3 * size) + (0 if frozen_out else size // tp if tp > 1 else size))


def moe_saved_bytes(layout: Layout, adapted: set[str] | None = None, input_grad: bool = True,
                    mlp_grad: bool = True) -> int:
    """What one ``E`` block keeps beyond every block's common terms (policy none). Under LoRA
    (``adapted``: the block's adapted linears, its experts and router frozen) no frozen linear keeps its
    input: not the routed rows' gathered input ``[S, D]`` nor the experts' down input (gated: the
    product; relu2: the square) ``[S, I]``, nor a shared MLP's down input unless adapted; without
    ``input_grad`` the router and experts keep nothing, and without ``mlp_grad`` (no gradient into the
    shared MLP's up projection) neither does its activation."""
    c, m = layout.model, _moe(layout)
    e, ec, tc, d = layout.act_bytes, layout.compute_bytes, layout.tokens, c.hidden_size
    k, experts = m["k"], m["experts"]
    if m["sigmoid"]:
        groups, top_groups = c.moe_groups
        router = tc * (experts * ec + groups * 2 * INDEX + top_groups * INDEX + experts + k * INDEX)
        router += tc * (k + 1) * ec if c.moe_norm_topk else 0
        router += tc * d * ec if layout.stream_bytes < ec else 0  # a 16-bit stream's float32 copy
        weight = ec
    else:
        router, weight = tc * k * (INDEX + ec), ec
    rows, lora = layout.stream_bytes, adapted is not None  # grouped_mm has no autocast rule: the experts
    kept = ((4 if c.moe_gated else 2) - lora) * m["inter"]  # run in the weights' dtype
    per_row = (2 - lora) * d * rows + kept * rows + weight + 3 * INDEX
    routed = m["rows"] * per_row + 4 * experts if input_grad else 0
    for name, (width, fan_in, fan_out) in {"up": (d, (2 if c.moe_gated else 1) * m["inter"], d),
                                           "down": (m["inter"], d, m["inter"])}.items():
        if lora and adapted & {f"lora_{name}_proj", f"lora_gate_{name}_proj"}:  # adapted stacked weights: each
            routed += m["rows"] * width * rows + experts * fan_in * fan_out * rows  # keeps its input rows again
            # and the effective weight W + B A it computed with (models/lora_experts.py)
    if c.mlp_fused:  # Granite: intermediate_size is the shared_mlp's
        shared = fused_mlp_saved(layout, c.intermediate_size, lora and "output_linear" not in adapted, not mlp_grad)
    else:  # NemotronH: up's output (relu's input), the square (down's input)
        shared = tc * (mlp_grad + (not lora or "down_proj" in adapted)) * m["shared"] * e
    return (router if input_grad else 0) + routed + shared


def moe_workspaces(layout: Layout) -> tuple[int, int]:
    """``(forward, backward)`` transient bytes of one ``E`` block beyond its block output: forward the
    weighted rows and their reordered copy ``2 [S, D]`` and the router's logits ``[Tc, E] e_c``;
    backward the larger of the shared MLP's gradients ``[Tc, 3 Is]`` (its backward runs first) and
    the routed rows' ``[S, 2 D + 3 I]`` gated, ``[S, D + 2 I]`` ungated (the up projection's output
    is not kept apart; checked against the allocator's peak of one step, 1 process)."""
    c, m = layout.model, _moe(layout)
    e, ec, d = layout.act_bytes, layout.compute_bytes, c.hidden_size
    forward = 2 * m["rows"] * d * e + layout.tokens * m["experts"] * ec
    routed = m["rows"] * ((2 * d + 3 * m["inter"]) if c.moe_gated else (d + 2 * m["inter"])) * e
    backward = max(routed, layout.tokens * 3 * m["shared"] * e)
    return forward, backward


def moe_traffic(layout: Layout, recomputed: tuple[bool, ...] | None = None) -> Tally:
    """TP collectives of ``E`` blocks and fused MLPs beyond ``parallel.comm.step.tp_blocks``' entry and
    exit pairs, per step. Per ``E`` block:

    - the routing weights' gradient ``[Tc, k] w_r`` all-reduced (backward, ``replicated_local``);
    - without SP, the experts and shared experts (NemotronH) or ``shared_mlp`` (Granite) sum their partial
      outputs before the one exit all-reduce (``PartialBlockExit``; Granite's layer reduces its
      branches once, ``SummedBranchesLayer``): nothing beyond the exit;
    - under SP the block reads the gathered norm output and leaves its experts' and shared experts'
      (NemotronH) or ``shared_mlp``'s (Granite) terms ``Partial``, reduce-scattered once at the exit
      as an MLP's; Granite's layer all-gathers each branch output's gradient once (+1 all-gather
      ``[Ts, D]``, ``SummedBranchesLayer``).

    Each fused gated MLP: forward all-gather of ``[Tc, 2 Is/tp]``, backward all-gather of the
    gradient of ``output_linear``'s input slice ``[Tc, Is/tp]``.

    ``recomputed``: the blocks a checkpoint's recomputation runs again (``full``/``selective``), for
    their fused MLPs' forward all-gathers. Under LoRA a backward row runs only where a gradient
    reaches (``parallel/comm/grad_flow.py``): the routing weights' where the block's input has one
    (the router is frozen), a fused MLP's where its input or ``input_linear`` does."""
    extra, c, tp = Tally(), layout.model, layout.tp
    if tp == 1:
        return extra
    label, tc, e, packs = dim_label(layout.dims, ("tp",)), layout.tokens, layout.act_bytes, layout.packs_per_rank
    flow, pattern, fused = grad_flow(layout), c.pattern, c.mlp_fused
    mlp_kinds = "E-" if fused else ""
    gathered = _ring("all_gather", tp, tc * 2 * c.intermediate_size // tp * e)  # Granite: the shared_mlp's
    if recomputed is not None:
        extra.add("all_gather", label, gathered, flow.count(recomputed, pattern, mlp_kinds) * packs)
        return extra
    weight = e if c.moe_router == "sigmoid" else layout.compute_bytes  # Granite's softmax weights: float32
    extra.add("all_reduce", label, _ring("all_reduce", tp, tc * c.moe_top_k * weight), flow.count(flow.input, pattern, "E") * packs)
    if layout.sp and fused:
        extra.add("all_gather", label, _ring("all_gather", tp, layout.stream_tokens * c.hidden_size * e),
                  flow.count(flow.branches, pattern, "E") * packs)  # where both branches have a gradient
    extra.add("all_gather", label, gathered, sum(pattern.count(k) for k in mlp_kinds) * packs)
    extra.add("all_gather", label, _ring("all_gather", tp, tc * c.intermediate_size // tp * e),
              flow.count(flow.mlp, pattern, mlp_kinds) * packs)
    return extra


def moe_matmul_elements(config) -> int:
    """Multiply-adds per token of one ``E`` block (full widths): router, ``k`` experts, shared MLP."""
    d = config.hidden_size
    experts = config.moe_top_k * config.moe_intermediate_size * d * (3 if config.moe_gated else 2)
    shared = config.moe_shared_size * d * (3 if config.mlp_fused else 2)
    return config.moe_experts * d + experts + shared
