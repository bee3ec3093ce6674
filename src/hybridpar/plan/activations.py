"""Bytes each block keeps for backward, from its shapes, per checkpointing policy.

Per rank and packed row (symbols in ``layout.py``; widths are TP-local: ``W/tp``). What the code
saves today (``models/blocks.py``, ``mamba/mixer.py``, ``attention/mixer.py``, ``attention/blockwise.py``, ``mamba/core.py``):

    every block    input x [Ts, D] and rstd [Ts] (RMSNorm saves its input and rstd)
                   + the projections' input [Tc, D] (under SP the all-gathered norm output)
    Mamba2         + in_proj output [Tc, 2 d_in + 2 G N + H]   (z for the gated norm; x, B, C, dt
                     are views the core op saves: it saves its inputs only)
                   + y [Tc, d_in] + gated-norm rstd [Tc, G] + gated-norm output [Tc, d_in] (out_proj input)
                   cp_mamba=a2a: + the core's exchanged inputs [T, (d_in + 2 G_eff N + H)/cp]
    attention      + q, k, v [Tc, (Hq + 2 Hkv) Dh] (rotated copies with RoPE, + cos, sin [Tc, 2 r]; a
                     transformers decoder computes them once for every layer: one copy, with the head)
                   + out [Tc, Hq Dh] + lse [Tc, Hq] (flash core: q, k, v, out, lse)
                   cp_attention=allgather: k, v are the gathered [T, 2 Hkv Dh]
                   cp_attention=ulysses: + the core's own out [T, Hq Dh / cp] (exchanged back after)
    MLP            + up output and act(up) [Tc, 2 I] (gated: gate, up, product: 3 I; ``gated_product``
                     recomputes act(gate), as transformers' Llama-form MLPs do through it)
    shared (Z)     a Zamba2 shared block's use: ``plan/hf/zamba2.py``
    MoE (E)        + router, routed experts and shared experts (a transformers twin's; ``plan/hf/moe.py``);
                     + the router load-balancing term's softmax [Tc, E] float32 under every policy
    parallel (P)   a twin's Falcon-H1 layer: the Mamba2 and attention terms after one norm, each branch
                     reading its own multiplied copy of the norm output (one more [Tc, D]; under
                     autocast the projections' bf16 casts instead, below); its ``mup_vector`` product
                     makes the Mamba branch float32 under mixed precision (``e_c``, out_proj's cast ``e``);
                     without ``mamba_rms_norm`` y * silu(z) keeps y, silu(z) and the product, no rstd
    head           final norm x [Ts, D] + rstd; loss: hidden [Tc, D], lse [Tc], labels [Tc] int64;
                   embedding: input ids [Tc] int64

``full`` keeps each block's input x [Ts, D] only. ``selective`` (``parallel/checkpointing.py``)
keeps the input and the outputs of the matmuls before a block's last sequence-mixing kernel, and
the attention core's out and lse: Mamba2 in_proj [Tc, W_in]; attention q, k, v + out + lse; an
MLP block (no mixing kernel) its input only; P both mixers' and the Mamba branch's out_proj output
(it runs before the attention kernel, the layer's last). (On CPU the eager blockwise attention core's out and
lse are recomputed instead, so there the plan is high by ``Tc (Hq Dh e + Hq e_c)`` per attention block.)
Statistics (rstd, lse) are in the compute dtype ``e_c``.

A transformers decoder planned through its twin (``plan/hf/twin.py``, ``layout.hf_decoder``): each
norm (the final one too) keeps ``x * rstd`` in float32, ``[Ts, D] e_c`` (from a 16-bit stream x's
float32 copy and the product cast back instead, ``[Ts, D] (e_c + e)``); under autocast more
(``_hf_block_bytes``); under ``full``/``selective`` a decoder layer is one checkpoint, so the MLP
block keeps nothing of its own.

Under autocast (``mixed_precision=bf16`` without FSDP) the residual stream and norm inputs stay in
the model dtype (``e_s``); norm outputs (cast once, ``blocks.matmul_input``) and what matmuls
produce are bf16 (``e = 2``), and every linear saves the bf16 copy of its weight that autocast
made: ``2 * (linear weights of the block)`` more per block that is not checkpointed (``full`` and
``selective`` recompute the casts).
"""

from __future__ import annotations

from hybridpar.models.mamba.mixer import replicated_groups, tp_groups
from hybridpar.parallel.comm.units import attention_layers
from hybridpar.plan.hf.moe import fused_mlp_saved, moe_saved_bytes, router_aux_bytes
from hybridpar.plan.hf.zamba2 import zamba2_saved_bytes, zamba2_selective_bytes
from hybridpar.plan.layout import Layout

__all__ = ["block_saved_bytes", "head_saved_bytes", "saved_bytes", "BLOCK_NAMES", "block_kind_totals", "block_widths",
           "mixer_saved_bytes", "hf_norm_bytes", "hf_mixer_bytes", "hf_gated_norm_bytes", "linear_weights"]

BLOCK_NAMES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "P": "mamba+attention", "Z": "shared_block"}


def block_widths(layout: Layout) -> dict:
    c, tp = layout.model, layout.tp
    d_inner = c.mamba_num_heads * c.mamba_head_dim // tp
    groups, heads = tp_groups(c.mamba_n_groups, tp), c.mamba_num_heads // tp
    groups_sent = groups * max(1, layout.cp // groups) if layout.cp > 1 and groups else groups  # 0: no Mamba block
    return dict(
        d=c.hidden_size, d_inner=d_inner, groups=groups, heads=heads,
        w_in=2 * d_inner + 2 * groups * c.ssm_state_size + heads,
        w_core=d_inner + 2 * groups_sent * c.ssm_state_size + heads,
        q=c.num_attention_heads * c.head_dim // tp, kv=c.num_key_value_heads * c.head_dim // tp,
        hq=c.num_attention_heads // tp, rot=int(c.head_dim * c.rotary_fraction) // 2 * 2,
        inter=c.intermediate_size // tp,
    )


def block_saved_bytes(layout: Layout, kind: str, policy: str | None = None) -> int:
    """Bytes one block of ``kind`` ("M", "*", "-") keeps for backward on this rank, one pack; a MoE block's
    router load-balancing term keeps its softmax under every policy (outside the checkpoints)."""
    return (router_aux_bytes(layout) if kind == "E" else 0) + _block_saved_bytes(layout, kind, policy or layout.checkpointing)


def _block_saved_bytes(layout: Layout, kind: str, policy: str) -> int:
    w, e, ec = block_widths(layout), layout.act_bytes, layout.compute_bytes
    tc, ts = layout.tokens, layout.stream_tokens
    block_input = ts * w["d"] * layout.stream_bytes
    paired = layout.paired
    if paired and policy in ("full", "selective") and kind in "-E":
        return 0  # one checkpoint per decoder layer: the attention block's input is the layer's
    if kind == "Z":  # a Zamba2 shared block's use (plan/hf/zamba2.py); under full its
        if policy == "full":  # layer's one checkpoint keeps the layer's input, counted with its Mamba block
            return 0
        if policy == "selective":
            return zamba2_selective_bytes(layout, w)
        return zamba2_saved_bytes(layout, w, mixer_saved_bytes(layout, "*", w), hf_norm_bytes(layout))
    if policy == "full":
        return block_input
    if policy == "selective":
        kept = {"M": tc * w["w_in"] * e, "*": tc * (w["q"] + 2 * w["kv"]) * e + tc * w["q"] * e + tc * w["hq"] * ec}
        if kind == "P":  # the Mamba branch's out_proj runs before the attention kernel: its [Tc, D] output too
            return block_input + kept["M"] + kept["*"] + tc * w["d"] * e
        return block_input + kept.get(kind, 0)
    weight_copies = 2 * linear_weights(layout, kind) if layout.autocast else 0  # autocast's bf16 weights
    common = block_input + weight_copies + ts * ec + tc * w["d"] * e  # input, rstd, projections' input
    if layout.hf_decoder:
        common += _hf_block_bytes(layout, kind, w)
    if kind == "P" and not layout.autocast:  # the second branch's multiplied input
        common += tc * w["d"] * e
    if kind in "M*P":
        return common + sum(mixer_saved_bytes(layout, mixer, w, kind == "P") for mixer in _mixers(kind))
    if kind == "E":
        return common + moe_saved_bytes(layout)
    if getattr(layout.model, "mlp_fused", False):  # Granite's shared_mlp, gathered under TP
        return common + fused_mlp_saved(layout, layout.model.intermediate_size)
    kept = (4 if getattr(layout.model, "mlp_multipliers", False) else 3) if layout.model.mlp_gated else 2
    return common + tc * w["inter"] * e * kept  # Falcon-H1's MLP keeps act's (scaled) input too


def _mixers(kind: str) -> str:
    """The mixers of a block kind: a twin's parallel layer ``P`` holds Mamba2 and attention."""
    return "M*" if kind == "P" else kind


def mixer_saved_bytes(layout: Layout, mixer: str, w: dict, parallel: bool = False) -> int:
    """What a Mamba2 (``M``) or attention (``*``) mixer keeps beyond its block's input and norm;
    ``parallel``: inside a Falcon-H1 layer (module docstring)."""
    e, ec, tc, seq = layout.act_bytes, layout.compute_bytes, layout.tokens, layout.pack_size
    if mixer == "M":
        wide = ec if parallel and layout.mixed_precision == "bf16" else e  # mup_vector's float32 product
        rstd = tc * w["groups"] * ec if getattr(layout.model, "mamba_gated_norm", True) else tc * w["d_inner"] * wide
        out = tc * (w["w_in"] + w["d_inner"]) * wide + tc * w["d_inner"] * e + rstd  # no norm: silu(z), not rstd
        if layout.cp > 1 and layout.cp_mamba == "a2a":
            out += tc * w["w_core"] * wide
        return out
    kv_tokens = seq if layout.cp > 1 and layout.cp_attention == "allgather" else tc
    out = tc * w["q"] * e + kv_tokens * 2 * w["kv"] * e + tc * w["q"] * e + tc * w["hq"] * ec
    if w["rot"] and not layout.hf_decoder:
        out += tc * 2 * w["rot"] * e
    if layout.cp > 1 and layout.cp_attention == "ulysses":
        out += tc * w["q"] * e
    return out


def hf_norm_bytes(layout: Layout) -> int:
    """What a transformers RMSNorm keeps beyond ours: ``x * rstd`` in float32 for the weight's
    gradient; from a 16-bit stream instead x's float32 copy and the product cast back to 16 bits
    (under LoRA the weight is frozen: the copy only). None where it runs ours (``models/hf/activations.use_lean_rms_norms``: Llama's forward on plain
    tensors; under sequence parallelism its inputs are DTensors and transformers' forward runs)."""
    if getattr(layout.model, "lean_norms", False) and not layout.sp:
        return 0
    e, ec = layout.act_bytes, layout.compute_bytes
    if layout.lora_rank:  # a frozen weight: no product for its gradient, only a 16-bit x's float32 copy
        return 0 if layout.stream_bytes >= ec else layout.stream_tokens * layout.model.hidden_size * ec
    per_element = ec if layout.stream_bytes >= ec else ec + e
    return layout.stream_tokens * layout.model.hidden_size * per_element


def _hf_block_bytes(layout: Layout, kind: str, w: dict) -> int:
    """What a transformers decoder keeps beyond the twin's block ``kind`` (policy none): its norm's
    product; a Mamba2 mixer's float32 gated norm where transformers' runs, three ``[Tc, d_inner/tp]``;
    Qwen3's q/k head norms (``[Tc, q + kv]`` input and product, ``[Tc, H + H_kv]`` rstd);
    under autocast each projection's own bf16 cast of the norm output (ours casts once: q, k, v two
    more, gate, up one more) and, with RoPE, bf16 q, k times float32 cos/sin: float32 q, k into
    the attention core, its float32 output and o_proj's bf16 cast of it."""
    extra = hf_norm_bytes(layout)
    for mixer in _mixers(kind):
        extra += hf_mixer_bytes(layout, mixer, w)
    return extra


def hf_mixer_bytes(layout: Layout, kind: str, w: dict) -> int:
    """``_hf_block_bytes``' terms of one mixer (``M``, ``*``) or MLP (``-``, ``E``). Under LoRA the norms'
    weights are frozen: no normalized product is kept for their gradient."""
    e, ec, tc, extra = layout.act_bytes, layout.compute_bytes, layout.tokens, 0
    frozen = bool(layout.lora_rank)
    if kind == "*" and getattr(layout.model, "qk_norm", False):  # Qwen3's per-head q/k RMSNorms: their input
        heads = (layout.model.num_attention_heads + layout.model.num_key_value_heads) // layout.tp  # (float32
        extra += tc * (w["q"] + w["kv"]) * ((not frozen) * e + ec) + tc * heads * ec  # copy), product (cast), rstd
    if kind == "M":
        extra += hf_gated_norm_bytes(layout, w)
    if layout.autocast:
        extra += tc * w["d"] * e * (2 if kind == "*" else 1)
        if kind == "*" and w["rot"]:
            extra += tc * (w["q"] + w["kv"]) * (ec - e) + tc * w["q"] * ec
    return extra


def hf_gated_norm_bytes(layout: Layout, w: dict) -> int:
    """A Mamba2 mixer's transformers gated RMSNorm where it runs (a norm not of Bamba's form; none:
    ``y * silu(z)``): in float32 ``silu(z)``, ``y * silu(z)`` and its normalized product, ``3 [Tc, d_inner/tp]``
    (under LoRA no product: the weight is frozen). One group under TP runs ``parallel/tensor/hybrid.
    spanning_group_norm`` instead, which keeps what ours keeps; Bamba's form runs ours
    (``models/hf/activations.use_lean_rms_norms``). Freed before the Mamba core's backward."""
    c = layout.model
    if replicated_groups(c.mamba_n_groups, layout.tp) or not getattr(c, "mamba_gated_norm", True) or getattr(
            c, "lean_gated_norms", False):
        return 0
    return (3 - bool(layout.lora_rank)) * layout.tokens * w["d_inner"] * layout.compute_bytes


def linear_weights(layout: Layout, kind: str) -> int:
    """TP-local elements of the linear weights (the 2-D parameters) of one block of ``kind``."""
    from hybridpar.parallel.comm.step import unit_parameters

    index = layout.model.pattern.index(kind)
    units = unit_parameters(layout.model, layout.tp, layout.sp)
    return sum(p.shape[0] * p.shape[1] for p in units[f"backbone.layers.{index}"] if len(p.shape) == 2)


def head_saved_bytes(layout: Layout) -> int:
    """Final norm, loss and embedding: kept under every policy (they are not checkpointed)."""
    e, es, ec = layout.act_bytes, layout.stream_bytes, layout.compute_bytes
    tc, ts, d = layout.tokens, layout.stream_tokens, layout.model.hidden_size
    final_norm = rope = 0
    if layout.hf_decoder:  # a transformers RMSNorm's own; the model's one cos, sin [Tc, r] pair, which every
        final_norm = hf_norm_bytes(layout)  # attention layer reads (and each layer's checkpoint keeps)
        rot = int(layout.model.head_dim * layout.model.rotary_fraction) // 2 * 2
        rope = tc * 2 * rot * es if rot and (attention_layers(layout.model.pattern) or "Z" in layout.model.pattern) else 0
    embeddings = ts * d * es if "Z" in layout.model.pattern and layout.checkpointing != "none" else 0  # Zamba2's
    return ts * (d * es + ec) + tc * d * e + tc * ec + 2 * tc * 8 + final_norm + rope + embeddings  # x0, which
    # every hybrid layer's checkpoint keeps (one tensor)


def saved_bytes(layout: Layout, policy: str | None = None) -> dict:
    """``{"mamba": bytes, "attention": ..., "mlp": ..., "head": ...}`` summed over the pattern, one pack."""
    out = block_kind_totals(layout.model.pattern)
    for kind in layout.model.pattern:
        out[BLOCK_NAMES[kind]] += block_saved_bytes(layout, kind, policy)
    out["head"] = head_saved_bytes(layout)
    return out


def block_kind_totals(pattern: str) -> dict[str, int]:
    """Zero per block name: every kind's, a parallel layer's (``P``) and a Zamba2 shared block's (``Z``)
    only where the pattern has one."""
    return {name: 0 for kind, name in BLOCK_NAMES.items() if kind not in "PZ" or kind in pattern}
