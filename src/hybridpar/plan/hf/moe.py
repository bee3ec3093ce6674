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

Latent projections (NemotronH's ``moe_latent_size = L``): ``fc1_latent_proj [L, D]`` maps the
norm output ``[Tc, D]`` to ``[Tc, L]``, the routed experts run at width ``L`` (``up [E, I, L]``,
``down [E, L, I]``: every routed row's ``D`` above reads ``L``), ``fc2_latent_proj [D, L]`` maps
their combined output back; the router and the shared experts read ``[Tc, D]``. Both projections
are replicated under TP (``LocalReplicateParallel``). Beyond the above an ``E`` block keeps fc2's
input, the experts' output ``[Tc, L] e`` (fc1's input is the norm output every block keeps); its
forward holds fc1's output ``[Tc, L] e`` while the experts run. Multiply-adds ``2 D L`` per token more.

Router logits (``output_router_logits``; ``moe_router_logits``, ``moe_aux_loss``): each router's
``logits [Tc, E]`` are float32 whatever the model dtype (Granite's router casts them, NemotronH's
computes in float32), ``R = Tc E 4`` bytes per ``E`` block (``router_logits_bytes``).
transformers' output recorder holds them from the router to the forward's end. NemotronH's forward
computes no auxiliary loss and a Granite with ``router_aux_loss_coef = 0`` adds none to the
objective: there they are gone with the model's output, before the loss (forward moments only).
With the term (Granite; ``models/hf/router_aux.py``), transformers' ``load_balancing_loss_func``
takes per layer ``p = softmax(z) [Tc, E]`` float32 and keeps it for backward (softmax's backward
reads its output; ``topk`` and ``histc`` are not differentiated; the sums and the final product
keep ``[E]``), outside every checkpoint, so each ``E`` block keeps ``R`` more under every policy
(``router_aux_bytes``; under LoRA only where its input has a gradient: the router is frozen). In
backward each softmax's gradient ``[Tc, E]`` waits for its layer's router: the same ``R``, freed
at the same block. The trainer's hook holds the logits too until it takes the term, after the
head's loss: the loss moment holds ``n_E R`` more. At cp > 1, and wherever the pack holds padding
(the term leaves it out; ``data.pad_to_multiple_of``, so nearly always), ``router_aux.switch_parts`` computes
the softmax of every layer's logits again (kept instead of the model's, whose graph goes when the
term is taken), each with a ``one_hot [Tc k, E]`` int64 and a ``topk [Tc, k]`` (values ``e_c``,
indices int64) at a time: one moment of ``saved + head + 2 n_E R + Tc k (8 E + 12)``
(``router_aux_workspace``). The term's arithmetic (softmax, sums: about ``5 Tc E`` per layer) is no
matmul and left out of the FLOPs.
"""

from __future__ import annotations

from hybridpar.parallel.comm.step import Tally, dim_label, sent
from hybridpar.plan.layout import Layout
from hybridpar.plan.params import grad_flow

__all__ = ["moe_saved_bytes", "fused_mlp_saved", "moe_workspaces", "moe_traffic", "moe_matmul_elements",
           "moe_replicated_elements", "router_logits_bytes", "router_aux_bytes", "router_aux_workspace",
           "router_aux_traffic"]

INDEX = 8  # int64


def _moe(layout: Layout) -> dict:
    c, tp = layout.model, layout.tp
    return dict(experts=c.moe_experts, k=c.moe_top_k, inter=c.moe_intermediate_size // tp,
                shared=c.moe_shared_size // tp, rows=layout.tokens * c.moe_top_k, sigmoid=c.moe_router == "sigmoid",
                width=getattr(c, "moe_latent_size", 0) or c.hidden_size, latent=getattr(c, "moe_latent_size", 0))


def router_logits_bytes(layout: Layout) -> int:
    """``R = Tc E 4``: one ``E`` block's float32 router logits, where the model records them (module docstring)."""
    c = layout.model
    return layout.tokens * c.moe_experts * 4 if getattr(c, "moe_router_logits", False) else 0


def router_aux_bytes(layout: Layout, input_grad: bool = True) -> int:
    """What the load-balancing term keeps for backward per ``E`` block, under every policy: its softmax ``R``."""
    return router_logits_bytes(layout) if getattr(layout.model, "moe_aux_loss", False) and input_grad else 0


def router_aux_workspace(layout: Layout) -> int:
    """Beyond every saved byte, the head's and the held logits (``memory_plan`` adds those), while the trainer
    takes the term over a pack's real tokens: the second softmax of every ``E`` block and one layer's ``one_hot``
    and ``topk``; 0 without the term (a pack without padding at cp = 1 keeps the model's own: less)."""
    if not router_aux_bytes(layout):
        return 0
    c, tc = layout.model, layout.tokens
    return c.pattern.count("E") * router_logits_bytes(layout) + tc * c.moe_top_k * (8 * c.moe_experts + 12)


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
    per_row = (2 - lora) * m["width"] * rows + kept * rows + weight + 3 * INDEX
    routed = m["rows"] * per_row + 4 * experts if input_grad else 0
    if m["latent"] and input_grad and (not lora or "fc2_latent_proj" in adapted):
        routed += tc * m["latent"] * e  # fc2_latent_proj's input, the experts' output
    for name, (width, fan_in, fan_out) in {"up": (m["width"], (2 if c.moe_gated else 1) * m["inter"], m["width"]),
                                           "down": (m["inter"], m["width"], m["inter"])}.items():
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
    e, ec = layout.act_bytes, layout.compute_bytes
    width = m["width"]  # the experts' (NemotronH: the latent L, whose [Tc, L] fc1 output the forward holds)
    forward = 2 * m["rows"] * width * e + layout.tokens * m["experts"] * ec + layout.tokens * m["latent"] * e
    routed = m["rows"] * ((2 * width + 3 * m["inter"]) if c.moe_gated else (width + 2 * m["inter"])) * e
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

    With latent projections (NemotronH; ``moe_block_plan``: the terms are not summed) the experts
    all-reduce their output ``[Tc, L]`` before ``fc2_latent_proj`` and their input's gradient
    ``[Tc, L]`` after it in backward (+2 all-reduces). Under SP the block then reads the gathered
    norm output whole and is sliced back: the shared experts all-reduce their ``[Tc, D]`` output,
    the input's gradient ``[Tc, D]`` is all-reduced, and the exit's forward and entry's backward
    reduce-scatters of ``tp_blocks`` do not run (+2 all-reduces, -2 reduce-scatters; the slice's
    backward all-gather is the exit's). A recomputation repeats the experts' all-reduce. Under autocast the
    block leaves through ``fc2_latent_proj`` in ``e``: its exit (all-reduce; SP: the slice's backward
    all-gather) moves ``e``, not the float32 of a MoE block whose experts' rows leave it directly.

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
    gathered = sent("all_gather", tp, tc * 2 * c.intermediate_size // tp * e)  # Granite: the shared_mlp's
    latent = sent("all_reduce", tp, tc * getattr(c, "moe_latent_size", 0) * e)  # 0 without latent projections
    if recomputed is not None:
        extra.add("all_gather", label, gathered, flow.count(recomputed, pattern, mlp_kinds) * packs)
        extra.add("all_reduce", label, latent, flow.count(recomputed, pattern, "E") * packs)
        return extra
    if latent:
        blocks, backward = pattern.count("E") * packs, flow.count(flow.input, pattern, "E") * packs
        entry = layout.stream_bytes if layout.hf_decoder else e  # tp_blocks' entry and MoE exit (the experts' input)
        extra.add("all_reduce", label, latent, blocks + backward)
        if layout.sp:
            extra.add("all_reduce", label, sent("all_reduce", tp, tc * c.hidden_size * e), blocks)
            extra.add("all_reduce", label, sent("all_reduce", tp, tc * c.hidden_size * entry), backward)
            for calls in (blocks, backward):  # tp_blocks' exit (forward) and entry (backward) reduce-scatters
                _take(extra, "reduce_scatter", label, sent("reduce_scatter", tp, tc * c.hidden_size * entry), calls)
        if e != entry:  # under autocast the block leaves through fc2 in e, not in its experts' float32
            kind, tokens = ("all_gather", layout.stream_tokens) if layout.sp else ("all_reduce", tc)
            calls = flow.count(flow.output, pattern, "E") * packs if layout.sp else blocks  # SP: the slice's backward
            _take(extra, kind, label, sent(kind, tp, tokens * c.hidden_size * entry), calls)
            extra.add(kind, label, sent(kind, tp, tokens * c.hidden_size * e), calls)
    if c.moe_router == "sigmoid":  # NemotronH's weights: float32 scores (under autocast too: precision.float32_modules)
        weight = layout.compute_bytes
    else:  # Granite's softmax is cast to the experts' input (type_as): float32 under autocast, FSDP's bf16 e
        weight = layout.stream_bytes if layout.hf_decoder else e
    extra.add("all_reduce", label, sent("all_reduce", tp, tc * c.moe_top_k * weight), flow.count(flow.input, pattern, "E") * packs)
    if layout.sp and fused:
        extra.add("all_gather", label, sent("all_gather", tp, layout.stream_tokens * c.hidden_size * e),
                  flow.count(flow.branches, pattern, "E") * packs)  # where both branches have a gradient
    extra.add("all_gather", label, gathered, sum(pattern.count(k) for k in mlp_kinds) * packs)
    extra.add("all_gather", label, sent("all_gather", tp, tc * c.intermediate_size // tp * e),
              flow.count(flow.mlp, pattern, mlp_kinds) * packs)
    return extra


def _take(tally: Tally, kind: str, dim: str, nbytes: int, calls: int) -> None:
    """Remove ``calls`` collectives of ``nbytes`` that another source counts but do not run."""
    if calls > 0:
        entry = tally.setdefault((kind, dim), [0, 0])
        entry[0] -= calls
        entry[1] -= calls * nbytes


def router_aux_traffic(layout: Layout) -> Tally:
    """The router load-balancing term's collectives per step (``train/trainer.py``, ``models/hf/router_aux.py``):
    at cp > 1 each pack's ranks sum Switch's counts ``[E]`` and row count ``[]`` (float32) over CP; once
    per step the term is summed over dp x cp (float64) for the reported loss."""
    out = Tally()
    if not getattr(layout.model, "moe_aux_loss", False):
        return out
    dims, packs = layout.dims, layout.packs_per_rank
    if layout.cp > 1:
        for nbytes in (layout.model.moe_experts * 4, 4):
            out.add("all_reduce", dim_label(dims, ("cp",)), sent("all_reduce", layout.cp, nbytes), packs)
    dp_cp = dims.size("dp") * layout.cp
    if dp_cp > 1:
        out.add("all_reduce", dim_label(dims, ("dp_replicate", "dp_shard", "cp")), sent("all_reduce", dp_cp, 8))
    return out


def moe_replicated_elements(config) -> int:
    """Of ``moe_matmul_elements``, what every TP rank runs whole: the router ``E D`` and the latent
    projections ``2 D L`` (replicated; the experts and shared experts split over TP)."""
    return config.moe_experts * config.hidden_size + 2 * config.hidden_size * getattr(config, "moe_latent_size", 0)


def moe_matmul_elements(config) -> int:
    """Multiply-adds per token of one ``E`` block (full widths): router, ``k`` experts (at the latent
    width ``L`` with latent projections), shared MLP, the two latent projections ``2 D L``."""
    d, latent = config.hidden_size, getattr(config, "moe_latent_size", 0)
    experts = config.moe_top_k * config.moe_intermediate_size * (latent or d) * (3 if config.moe_gated else 2)
    shared = config.moe_shared_size * d * (3 if config.mlp_fused else 2)
    return config.moe_experts * d + experts + shared + 2 * d * latent
