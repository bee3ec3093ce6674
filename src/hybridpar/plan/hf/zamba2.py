"""Zamba2: Mamba2 layers and shared transformer blocks reused at several depths, priced per use.

A Zamba2 hybrid layer (transformers' ``Zamba2HybridLayer``) computes, from the stream ``h`` and the
embeddings ``x0`` (``[T, D]`` each)::

    u = concat([h, x0])                                   [T, 2D]
    a = o_proj(attn(q, k, v))  with  q = W_q norm(u) + B_q A_q norm(u)  (k, v alike; adapters optional)
    f = down(act(g) * p),  [g | p] = W_gu norm(a) + B_gu A_gu norm(a)   (the adapter always)
    h' = h + mamba(norm(h + linear(f)))

The twin spells it ``ZM``: block ``Z`` (the shared block's use and the layer's own ``linear [D, D]``),
then the layer's Mamba block ``M`` (a Mamba layer is ``M`` alone). The shared block's weights
(``input_layernorm [2D]``, q, k, v ``[H dh, 2D]`` with ``dh = 2D/H``, ``o_proj [D, H dh]``,
``pre_ff_layernorm [D]``, ``gate_up_proj [2I, D]``, ``down_proj [D, I]``) exist once per distinct block
(``num_mem_blocks``: use ``j`` of the hybrid layers runs block ``j mod num_mem_blocks``); the adapters
(``A [r, in]``, ``B [out, r]``) exist once per use. FSDP shards each distinct block as one unit of its
own (``parallel/data/fsdp.shared_submodules``), and each hybrid layer (linear + Mamba) and Mamba layer
as one (``zamba2_units``).

Saved per use, policy none (symbols of ``plan/layout.py``; TP-local widths ``q = H dh/tp``,
``kv = H_kv dh/tp``, ``Ip = I/tp``)::

    attention half  u [Ts, 2D] e_s + rstd [Ts] e_c + norm(u) [Tc, 2D] e + 3 [Tc, r] e (adapters)
                    + its norm's float32 product x * rstd [Ts, 2D] e_c (hybridpar's lean norm takes
                      widths D only; from a 16-bit stream u's float32 copy [Ts, 2D] e_c and the product
                      cast back e instead of u and the product)
                    + the attention core (``mixer_saved_bytes``: q, k, v, out, lse)
                    + under TP o_proj's input [Tc, q] e (its own copy of the core's output)
    MLP half        a [Ts, D] e_s + rstd + norm(a) [Tc, D] e + [Tc, r] e (adapter) + its norm's
                    product where transformers' runs (``hf_norm_bytes``: under SP; from a 16-bit
                    stream its float32 copy of a and the cast product, instead of a)
                    + the fused gated MLP (``moe.fused_mlp_saved``): [g | p] [Tc, 2I] (the adapter's sum),
                      act(g) [Tc, I], act(g) * p [Tc, I]; under TP the product's slice [Tc, Ip] instead
    linear          its input f [Ts, D] e

and RoPE's cos, sin ``[Tc, dh]`` once per model (with ``use_mem_rope``). TP (``zamba2_plan``) per use
and pack beyond ``tp_blocks``' one pair (the MLP's entry, its exit): the attention's entry
``[Tc, 2D]`` and exit ``[Tc, D]`` (SP: all-gather + reduce-scatter each), the fused MLP's two
all-gathers, each attention adapter's ``[Tc, r]`` gradient all-reduced, and under SP the linear's
weight gradient ``[D, D]`` (``zamba2_traffic``).

``full`` checkpointing: a hybrid layer is one checkpoint (transformers' ``Zamba2HybridLayer``), which keeps
its input ``[Ts, D] e_s`` (counted with its ``M`` block; ``Z`` keeps nothing of its own) and the embeddings
``x0 [Ts, D] e_s``, one tensor every layer's checkpoint holds (counted once, with the head); its
backward rebuilds ``Z``'s tensors while the ``M`` block's backward runs (``memory_plan``), and its
recomputation repeats the shared block's mid-layer collectives (``zamba2_recomputed``). ``selective``:
the same checkpoint, keeping every matmul output before the layer's Mamba core (``zamba2_selective_bytes``;
the layer's input and ``x0`` as under ``full``). LoRA: ``plan/hf/zamba2_lora.py``.

Under autocast (``mixed_precision=bf16`` without FSDP; ``e = 2``, the stream float32) each projection keeps
its own bf16 cast of its float32 input: q, k, v and each attention adapter's ``A`` one ``[Tc, 2D] e`` each
(not one shared ``norm(u)``), ``gate_up`` and its adapter's ``A`` one ``[Tc, D] e`` each; the MLP norm keeps
o_proj's bf16 output ``[Ts, D] e``. With ``use_mem_rope`` the float32 cos, sin lift q, k and the core's output
to float32 (``+ [Tc, 2q + kv] (e_c - e)``), and o_proj keeps its own cast of that output ``[Tc, q] e``. Each
use keeps bf16 copies of the matrices it reads (its block's, its adapters, its ``linear``: ``2 x`` their
elements), autocast's weight cache being off (``parallel/precision.py``). FSDP's bf16 is priced as above.
"""

from __future__ import annotations

import dataclasses
import math

from hybridpar.parallel.comm.grad_flow import adapted_linear
from hybridpar.parallel.comm.step import ParamShape, StepShape, Tally, dim_label, sent, shard_bytes, tp_adapters, tp_pair
from hybridpar.parallel.comm.units import unit_parameters
from hybridpar.plan.layout import Layout

__all__ = ["zamba2_fields", "is_zamba2", "weights_per_use", "zamba2_reach", "zamba2_units", "shared_uses", "zamba2_saved_bytes", "zamba2_traffic",
           "zamba2_matmul_elements", "zamba2_recomputed", "zamba2_selective_bytes", "attention_twin", "fsdp_groups", "SHARED_UNIT"]

SHARED_UNIT = "shared_blocks.{}"  # FSDP unit of distinct shared block b (its adapters included)


def is_zamba2(config) -> bool:
    return getattr(config, "shared_blocks", 0) > 0


def zamba2_fields(config) -> dict:
    """``TwinConfig`` fields of a transformers ``Zamba2Config``: pattern ``M`` per Mamba layer, ``ZM`` per
    hybrid layer; the attention widths are the shared block's (input ``2D``, ``dh = 2D/H``)."""
    kinds = list(config.layers_block_type)
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        pattern="".join("ZM" if kind == "hybrid" else "M" for kind in kinds),
        mamba_num_heads=config.n_mamba_heads, mamba_head_dim=config.mamba_headdim, mamba_n_groups=config.mamba_ngroups,
        ssm_state_size=config.mamba_d_state, conv_kernel=config.mamba_d_conv, chunk_size=config.chunk_size,
        use_conv_bias=True, mamba_proj_bias=bool(config.add_bias_linear),  # transformers' conv1d always has a bias
        time_step_limit=(config.time_step_min, float("inf")),
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.attention_head_dim, rotary_fraction=1.0 if config.use_mem_rope else 0.0,
        intermediate_size=config.intermediate_size, mlp_activation="gelu", mlp_gated=True,
        mlp_bias=bool(config.add_bias_linear), tie_word_embeddings=bool(config.tie_word_embeddings),
        paired_layers=False, shared_blocks=min(config.num_mem_blocks, kinds.count("hybrid")), shared_adapter_rank=config.adapter_rank,
        shared_attention_adapters=bool(config.use_shared_attention_adapter))


def shared_uses(config) -> list[int]:
    """The distinct shared block each ``Z`` of the pattern runs (``j mod num_mem_blocks``)."""
    return [j % config.shared_blocks for j in range(config.pattern.count("Z"))]


def _shared_parameters(config, block: int, tp: int, sp: bool) -> list[ParamShape]:
    """TP-local parameters of distinct shared block ``block`` and its uses' adapters, as ``zamba2_plan``
    shards them: q, k, v, ``gate_up_proj`` column-parallel, o, down row-parallel, norms replicated, an
    attention adapter's ``A`` replicated and ``B`` column-parallel, the MLP adapter replicated whole."""
    d, r, sharded = config.hidden_size, config.shared_adapter_rank, tp > 1
    q, kv, inter = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim, config.intermediate_size
    name = f"{SHARED_UNIT.format(block)}"
    params = [ParamShape(f"{name}.input_layernorm.weight", (2 * d,), False, sp),
              ParamShape(f"{name}.pre_ff_layernorm.weight", (d,), False, sp)]
    params += [ParamShape(f"{name}.self_attn.{p}.weight", (rows // tp, 2 * d), sharded)
               for p, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))]
    params.append(ParamShape(f"{name}.self_attn.o_proj.weight", (d, q // tp), sharded))
    params.append(ParamShape(f"{name}.feed_forward.gate_up_proj.weight", (2 * inter // tp, d), sharded))
    params.append(ParamShape(f"{name}.feed_forward.down_proj.weight", (d, inter // tp), sharded))
    if config.mlp_bias:  # add_bias_linear: gate_up's bias split with its rows, down's replicated
        params += [ParamShape(f"{name}.feed_forward.gate_up_proj.bias", (2 * inter // tp,), sharded),
                   ParamShape(f"{name}.feed_forward.down_proj.bias", (d,), False)]
    for use, owner in enumerate(shared_uses(config)):
        if owner != block:
            continue
        if config.shared_attention_adapters:
            for p in "qkv":
                params += [ParamShape(f"{name}.self_attn.{p}_adapter.{use}.A", (r, 2 * d), False),
                           ParamShape(f"{name}.self_attn.{p}_adapter.{use}.B", (2 * d // tp, r), sharded)]
        params += [ParamShape(f"{name}.feed_forward.adapter.{use}.A", (r, d), False),
                   ParamShape(f"{name}.feed_forward.adapter.{use}.B", (2 * inter, r), False)]
    return params


def zamba2_units(config, tp: int = 1, sp: bool = False) -> dict[str, list[ParamShape]]:
    """Every parameter per twin unit, TP-local: ``unit_parameters``' for the Mamba blocks and the root, a
    ``Z`` block's its layer's ``linear [D, D]`` (replicated), and one unit per distinct shared block."""
    units = unit_parameters(config, tp, sp)
    for index, kind in enumerate(config.pattern):
        if kind == "Z":
            units[f"backbone.layers.{index}"] = [ParamShape(f"backbone.layers.{index}.linear.weight",
                                                            (config.hidden_size,) * 2, False)]
    for block in range(config.shared_blocks):
        units[SHARED_UNIT.format(block)] = _shared_parameters(config, block, tp, sp and tp > 1)
    return units


def fsdp_groups(config) -> list[tuple[int, ...]]:
    """The FSDP units as twin block indices: a hybrid layer's ``Z`` and ``M`` together, a Mamba layer alone."""
    groups, pattern, i = [], config.pattern, 0
    while i < len(pattern):
        size = 2 if pattern[i] == "Z" else 1
        groups.append(tuple(range(i, i + size)))
        i += size
    return groups


def zamba2_saved_bytes(layout: Layout, w: dict, core: int, hf_norm: int) -> int:
    """What one ``Z`` block keeps for backward, policy none (module docstring); ``core``: its attention
    core's bytes (``activations.mixer_saved_bytes`` of ``*``), ``hf_norm``: its MLP norm's where
    transformers' runs (``activations.hf_norm_bytes``). Under autocast (module docstring) each projection
    keeps its own bf16 cast of its float32 input, and the weights' bf16 copies are kept."""
    c, e, es, ec = layout.model, layout.act_bytes, layout.stream_bytes, layout.compute_bytes
    tc, ts, d, r = layout.tokens, layout.stream_tokens, c.hidden_size, c.shared_adapter_rank
    adapters, wide, cast = (3 if c.shared_attention_adapters else 0), es >= ec, layout.autocast  # wide: a float32 stream
    rope = cast and int(c.head_dim * c.rotary_fraction) // 2 * 2 > 0  # float32 cos, sin lift q, k and the core's out
    attention = ts * ec + tc * 2 * d * e * (3 + adapters if cast else 1) + adapters * tc * r * e + core
    attention += ts * 2 * d * (es + ec if wide else ec + e)  # transformers' norm over 2D: u and x * rstd in
    # float32 (from a 16-bit stream u's float32 copy and the product cast back; the 16-bit u is not kept)
    attention += tc * (2 * w["q"] + w["kv"]) * (ec - e) if rope else 0
    attention += tc * w["q"] * e if layout.tp > 1 or rope else 0  # o_proj's input: its own copy under TP, or a cast
    inter = c.intermediate_size  # the fused MLP (moe.fused_mlp_saved): [g | p] + act(g) + act(g) * p, or under
    fused = tc * e * (3 * inter + (inter // layout.tp if layout.tp > 1 else inter))  # TP down's slice of the last
    norm_input = ts * d * e if cast else (0 if hf_norm and not wide else ts * d * es)  # autocast: o_proj's bf16 out
    mlp = ts * ec + norm_input + hf_norm + tc * d * e * (2 if cast else 1) + tc * r * e + fused
    return attention + mlp + ts * d * e + (2 * weights_per_use(layout) if cast else 0)


def weights_per_use(layout: Layout) -> int:
    """TP-local elements of the matrices one use of a shared block reads, of which autocast keeps a bf16 copy per
    use (its weight cache is off: ``parallel/precision.py``): the block's own, the use's adapters, its layer's
    ``linear [D, D]``."""
    c = layout.model
    matrices = [p for block in range(c.shared_blocks) for p in _shared_parameters(c, block, layout.tp, layout.sp)
                if len(p.shape) == 2]
    adapters = sum(math.prod(p.shape) for p in matrices if ".adapter." in p.name or "_adapter." in p.name)
    block = sum(math.prod(p.shape) for p in matrices) - adapters
    return block // c.shared_blocks + adapters // c.pattern.count("Z") + c.hidden_size ** 2


def zamba2_selective_bytes(layout: Layout, w: dict) -> int:
    """What one ``Z`` block keeps under ``selective``: the outputs of every matmul before its layer's last
    mixing kernel (the Mamba core): q, k, v, each adapter's ``A`` and ``B`` outputs, o_proj's, the fused
    MLP's and its adapter's, down's, the linear's; and the attention core's out and lse (a GPU's flash
    core keeps them; on CPU the eager core recomputes them, as for every attention block)."""
    c, e, ec, tc, ts, d = layout.model, layout.act_bytes, layout.compute_bytes, layout.tokens, layout.stream_tokens, layout.model.hidden_size
    r, inter, tp = c.shared_adapter_rank, c.intermediate_size, layout.tp
    adapters = 3 * tc * (r + 2 * d // tp) * e if c.shared_attention_adapters else 0
    attention = tc * (w["q"] + 2 * w["kv"]) * e + adapters + tc * w["q"] * e + tc * w["hq"] * ec + tc * d * e
    mlp = tc * (2 * inter // tp + r + 2 * inter) * e + tc * d * e
    return attention + mlp + ts * d * e


def zamba2_reach(adapted: set, upstream: bool) -> tuple[bool, bool]:
    """``(core, mlp)``: whether a gradient reaches a ``Z`` block's attention core and its MLP's input (a node's
    backward runs where anything before it trains): ``upstream`` (full training, or under LoRA an adapter in an
    earlier block), or an adapter of this use on q, k, v (the core), or on o_proj (the MLP)."""
    core = upstream or bool(adapted & {"q_proj", "k_proj", "v_proj"})
    return core, core or "o_proj" in adapted


def _adapted_uses(c, shape: StepShape) -> dict[int, set[str]]:
    """Each ``Z`` block's adapted linears (``q_proj``, ``linear``, ...; none in full training), by block index."""
    return {i: {adapted_linear(p.name) for p in (shape.adapters or {}).get(f"backbone.layers.{i}", ())}
            for i, kind in enumerate(c.pattern) if kind == "Z"}


def zamba2_traffic(layout: Layout, shape: StepShape) -> dict[str, Tally]:
    """The sources ``step_collectives`` prices from ``unit_parameters``, for a Zamba2 twin: ``fsdp`` over its
    real units, ``tp_norm_grads`` (each distinct block's two norms once), and ``tp_shared_block``
    (module docstring). ``shape``: the step of ``attention_twin``. Under LoRA a backward collective runs only
    where a gradient reaches (``zamba2_reach``), no norm or linear weight has a gradient, and the adapters on
    the layers' ``linear`` (whole on every TP rank) are reduced over TP only under SP."""
    c, dims, m = layout.model, layout.dims, layout.packs_per_rank
    out, flow, adapted = {}, shape.flow, _adapted_uses(c, shape)
    units = zamba2_units(c, layout.tp, layout.sequence_parallel)
    norms = Tally()
    if layout.sp and flow.base_trains:
        for p in (p for unit in units.values() for p in unit if p.sp_norm):
            norms.add("all_reduce", dim_label(dims, ("tp",)), sent("all_reduce", layout.tp, math.prod(p.shape) * shape.stream_bytes),
                      1 if shape.fsdp else 4)  # FSDP reduces once; else clipping once and AdamW three times
    out["tp_norm_grads"] = norms
    out["fsdp"] = _fsdp(layout, shape, units)
    if shape.adapters is not None:  # the linear's: whole on every rank (equal gradients), or under SP on the
        # rank's tokens, their gradients summed over TP in autograd on each pack (TokenwiseParallel)
        adapters = {u: [dataclasses.replace(p, tp_sum_in_autograd=True) if adapted_linear(p.name) == "linear" else p
                        for p in ps if layout.sp or adapted_linear(p.name) != "linear"]
                    for u, ps in shape.adapters.items()}
        out["tp_adapters"] = tp_adapters(dataclasses.replace(shape, adapters=adapters))
    tp, extra = layout.tp, Tally()
    if tp > 1:
        uses, d, e, tc = c.pattern.count("Z") * m, c.hidden_size, layout.act_bytes, layout.tokens
        entered = m * sum(flow.input[i] for i in adapted)  # a gradient into the attention's norm output
        reach = [zamba2_reach(names, flow.input[i])[1] for i, names in adapted.items()]
        into_mlp = m * sum(reach)  # ... into the MLP's input
        label = dim_label(dims, ("tp",))
        tp_pair(extra, shape, uses, 2 * d, shape.entry_size, entered)  # the attention's entry: norm(u) [Tc, 2D]
        tp_pair(extra, shape, uses, d, backward=into_mlp, exit_=True)  # its exit: o_proj's output
        # tp_blocks prices the MLP's entry on flow.input; its backward runs wherever the MLP's input has a gradient
        tp_pair(extra, shape, 0, d, shape.entry_size, into_mlp - entered)
        extra.add("all_gather", label, sent("all_gather", tp, tc * 2 * c.intermediate_size // tp * e), uses)
        into_down = m * sum(r or "gate_up_proj" in names for r, names in zip(reach, adapted.values()))
        extra.add("all_gather", label, sent("all_gather", tp, tc * c.intermediate_size // tp * e), into_down)  # down's
        # input's gradient (its slice's, gathered)
        if c.shared_attention_adapters:  # B's replicated input [Tc, r]: its gradient is Partial
            extra.add("all_reduce", label, sent("all_reduce", tp, tc * c.shared_adapter_rank * e), 3 * entered)
        if layout.sp and flow.base_trains:  # the linear runs on the local tokens: its weight's gradient summed over TP
            extra.add("all_reduce", label, sent("all_reduce", tp, d * d * shape.stream_bytes), uses)
    out["tp_shared_block"] = extra
    return out


def zamba2_recomputed(layout: Layout, shape: StepShape) -> Tally:
    """Under ``full`` or ``selective`` checkpointing (one checkpoint per hybrid layer) the TP collectives its recomputation
    repeats beyond ``step_traffic``'s (each block's entry gather under SP, the CP exchanges): per use and
    pack the shared block's mid-layer ones, its attention's entry ``[Ts, 2D]`` (SP), the exits of its
    attention and MLP ``[Tc, D]`` (SP: reduce-scatter, else all-reduce) and the fused MLP's forward
    all-gather ``[Tc, 2I/tp]``. The layer's last exit (its Mamba block's) is not repeated."""
    out, c, tp = Tally(), layout.model, layout.tp
    if tp == 1:
        return out
    redone = sum(shape.flow.output[i + 1] for i, kind in enumerate(c.pattern) if kind == "Z")  # LoRA: a gradient
    uses, label, tc, e = redone * layout.packs_per_rank, dim_label(layout.dims, ("tp",)), layout.tokens, layout.act_bytes  # reaches it
    if layout.sp:
        out.add("all_gather", label, sent("all_gather", tp, layout.stream_tokens * 2 * c.hidden_size * (shape.entry_size or e)), uses)
    kind = "reduce_scatter" if layout.sp else "all_reduce"
    out.add(kind, label, sent(kind, tp, tc * c.hidden_size * (shape.exit_size or e)), 2 * uses)
    out.add("all_gather", label, sent("all_gather", tp, tc * 2 * c.intermediate_size // tp * e), uses)
    return out


def attention_twin(config):
    """The twin with every ``Z`` read as an attention block: what ``step_collectives`` prices (its CP
    attention per use; every other source it takes from here is the same for both)."""
    return dataclasses.replace(config, pattern=config.pattern.replace("Z", "*"))


def _fsdp(layout: Layout, shape: StepShape, units: dict) -> Tally:
    """``step.fsdp`` over Zamba2's units: a hybrid layer's linear and Mamba block as one, each distinct
    shared block as one gathered twice per pack (forward and backward, whatever its uses), the root once.
    Under LoRA each unit gathers its adapters too (a use's copy's with its shared block, the linear's with its
    layer) and reduces only theirs; a unit no gradient reaches is not gathered in backward."""
    out, dims, c = Tally(), layout.dims, layout.model
    if not shape.fsdp:
        return out
    shard, rep, m, flow = dims.size("dp_shard_cp"), dims.dp_replicate, layout.packs_per_rank, shape.flow
    shard_label, rep_label = dim_label(dims, ("dp_shard", "cp")), dim_label(dims, ("dp_replicate",))
    reduce_size = max(layout.act_bytes, 4)
    adapters, uses = shape.adapters or {}, shared_uses(c)
    shared_adapters = {b: [] for b in range(c.shared_blocks)}
    for j, i in enumerate(i for i, kind in enumerate(c.pattern) if kind == "Z"):
        shared_adapters[uses[j]] += [p for p in adapters.get(f"backbone.layers.{i}", ()) if adapted_linear(p.name) != "linear"]
    own = {i: [p for p in adapters.get(f"backbone.layers.{i}", ()) if c.pattern[i] != "Z" or adapted_linear(p.name) == "linear"]
           for i in range(len(c.pattern))}
    groups = fsdp_groups(c)
    entries = []  # (base parameters, adapters, gathered again in backward)
    for g, group in enumerate(groups):
        later = groups[min(g + 1, len(groups) - 1)]  # FSDP prefetches a unit in the backward of the one after it
        entries.append(([p for i in group for p in units[f"backbone.layers.{i}"]], [p for i in group for p in own[i]],
                        flow.output[later[-1]]))
    for b in range(c.shared_blocks):
        reached = any(flow.output[i] for j, i in enumerate(i for i, k in enumerate(c.pattern) if k == "Z") if uses[j] == b)
        entries.append((units[SHARED_UNIT.format(b)], shared_adapters[b], reached))
    entries.append((units[""], adapters.get("", []), False))
    for params, extra, backward in entries:
        nbytes = shard_bytes(params, shard, layout.act_bytes) + shard_bytes(extra, shard, shape.adapter_size)
        grad_bytes = shard_bytes(params, shard, reduce_size) if shape.adapters is None else \
            shard_bytes(extra, shard, shape.adapter_grad_size)
        if shard > 1:
            gathers = 1 if not layout.reshard_after_forward else m * (2 if backward else 1)
            out.add("all_gather", shard_label, sent("all_gather", shard, nbytes), gathers)
            if grad_bytes:
                out.add("reduce_scatter", shard_label, sent("reduce_scatter", shard, shard * grad_bytes))
        if rep > 1 and grad_bytes:
            out.add("all_reduce", rep_label, sent("all_reduce", rep, grad_bytes))
    return out


def zamba2_matmul_elements(config) -> tuple[int, int]:
    """Multiply-adds per token of one ``Z`` block (full widths), and of them what every TP rank runs
    whole (the linear, the MLP adapter, the attention adapters' ``A``)."""
    d, r, inter = config.hidden_size, config.shared_adapter_rank, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    attention_adapters = 3 * r * 4 * d if config.shared_attention_adapters else 0
    replicated = d * d + r * (d + 2 * inter) + attention_adapters // 2
    return 2 * d * (q + 2 * kv) + q * d + 3 * d * inter + attention_adapters + replicated, replicated
