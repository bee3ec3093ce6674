"""What a block keeps for backward under LoRA (``peft.method=lora``: a frozen base, adapters on some linears).

Autograd keeps a tensor only for a gradient something needs. With the base frozen, a linear layer
keeps its input only where an adapter's ``A`` reads it, a norm keeps its input and rstd only where
its input needs a gradient, and a mixing core keeps its inputs only where they need one. Per block
``i`` (the flags of ``parallel/comm/grad_flow.py``; policy ``none``; the widths of ``activations.py``)::

    no gradient reaches it (not output[i])        nothing
    input[i]                                      its input x [Ts, D] and rstd (+ a transformers norm's
                                                  float32 copy of a 16-bit x; autocast's bf16 weights)
    an adapter on a projection of the norm output  that output [Tc, D] (under SP the all-gathered one;
                                                  + each projection's bf16 cast under autocast)
    Mamba2     mamba[i]                           in_proj output, y, the gated norm's rstd (+ a2a's
                                                  exchanged inputs; transformers' own gated norm)
               an adapter on out_proj             its input, the gated norm's output [Tc, d_inner]
    attention  q[i], k[i] or v[i]                 q, k, v, out, lse (+ their CP copies, RoPE's)
               else an adapter on o_proj          its input, out [Tc, Hq Dh]
    MLP        input[i] or an adapter on gate/up  gate and up (ungated: up) [Tc, I/tp] (Falcon-H1: act's
                                                  scaled input too; Granite's fused MLP: mlp[i])
               an adapter on down_proj            its input, the product (ungated: act(up)) [Tc, I/tp]
    MoE (E)    input[i]                           router and experts, less what frozen experts' weight
                                                  gradients would need (``plan/hf/moe.py``); adapted
                                                  stacked experts keep their input rows and W + B A
    parallel (P)                                  Mamba2 and attention as above, each adapted branch
                                                  its own multiplied copy of the norm output
    Zamba2 use (Z)                                its copy of the shared block walked the same way
                                                  (``plan/hf/zamba2_lora.py``)
    each adapter                                  h = A x [Tc, r]

Under ``full`` checkpointing a block a gradient reaches keeps its input, under ``selective`` the
policy's matmul outputs too, which include an adapter's ``h`` and ``B h`` [Tc, out/tp] on
``in_proj``, q, k and v (run before the mixing kernel).
"""

from __future__ import annotations

from hybridpar.parallel.comm.grad_flow import adapted_linear
from hybridpar.plan.activations import (block_saved_bytes, block_widths, hf_mixer_bytes, hf_norm_bytes, linear_weights,
                                        mixer_saved_bytes)
from hybridpar.plan.hf.moe import fused_mlp_saved, moe_saved_bytes, router_aux_bytes
from hybridpar.plan.hf.zamba2_lora import zamba2_lora_bytes
from hybridpar.plan.layout import Layout
from hybridpar.plan.params import adapter_params, grad_flow

__all__ = ["lora_block_bytes", "lora_saved_bytes"]

INPUT_SIDE = ("in_proj", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "input_linear")  # they read the norm output
READS = {"M": {"in_proj"}, "*": {"q_proj", "k_proj", "v_proj"}}  # a mixer's projections of the norm output


def lora_block_bytes(layout: Layout, index: int) -> int:
    """Bytes block ``index`` keeps for backward under LoRA, adapters included (module docstring)."""
    flow, kind = grad_flow(layout), layout.model.pattern[index]
    if not flow.recomputed(layout.paired and layout.checkpointing != "none")[index]:
        return 0  # no gradient reaches it, so no backward (a decoder layer's checkpoint: its output's)
    if layout.checkpointing != "none":
        return block_saved_bytes(layout, kind) + lora_saved_bytes(layout, index)
    adapted = {adapted_linear(p.name) for p in adapter_params(layout)[f"backbone.layers.{index}"]}
    w, e, ec, tc, ts = block_widths(layout), layout.act_bytes, layout.compute_bytes, layout.tokens, layout.stream_tokens
    out = lora_saved_bytes(layout, index)
    if kind == "Z":  # a Zamba2 shared block's use (plan/hf/zamba2.py)
        core = mixer_saved_bytes(layout, "*", w)
        return out + zamba2_lora_bytes(layout, w, core, hf_norm_bytes(layout), adapted, flow.input[index])
    if flow.input[index]:
        out += ts * w["d"] * layout.stream_bytes + ts * ec + (2 * linear_weights(layout, kind) if layout.autocast else 0)
    if layout.hf_decoder and flow.input[index] and layout.stream_bytes < ec:
        out += hf_norm_bytes(layout)  # a 16-bit x's float32 copy
    hf_casts = layout.autocast and layout.hf_decoder  # each projection's own bf16 cast of the norm output
    casts = {"M": tc * w["d"] * e if hf_casts else 0, "*": 2 * tc * w["d"] * e if hf_casts else 0}
    mixers = "M*" if kind == "P" else kind
    if kind == "P":  # each adapted branch reads its own multiplied copy of the norm output (autocast: its casts)
        branches = [m for m in mixers if adapted & READS[m]]
        out += tc * w["d"] * e * (min(1, len(branches)) if layout.autocast else len(branches))
        out += sum(casts[m] for m in branches)
    elif adapted & set(INPUT_SIDE):  # the norm output (and its casts)
        out += tc * w["d"] * e + casts.get(kind, 0)
    for mixer in mixers if kind in "M*P" else "":
        core = mixer_saved_bytes(layout, mixer, w, kind == "P")
        core += hf_mixer_bytes(layout, mixer, w) - casts[mixer] if layout.hf_decoder else 0
        if mixer == "M":
            if flow.mamba[index]:
                out += core - tc * w["d_inner"] * e  # less the gated norm's output, out_proj's input
            out += tc * w["d_inner"] * e if "out_proj" in adapted else 0
        elif flow.q[index] or flow.k[index] or flow.v[index]:
            out += core
        elif "o_proj" in adapted:
            out += tc * w["q"] * e
    if kind in "M*P":
        return out
    if kind == "E":
        out += moe_saved_bytes(layout, adapted, flow.input[index], flow.mlp[index])
        out += router_aux_bytes(layout, flow.input[index])  # the load-balancing term's softmax (frozen router)
    elif getattr(layout.model, "mlp_fused", False):  # Granite's shared_mlp
        out += fused_mlp_saved(layout, layout.model.intermediate_size, "output_linear" not in adapted,
                               not flow.mlp[index])
    else:  # gate, up (Falcon-H1's multipliers: act's scaled input too)
        gated, scaled = layout.model.mlp_gated, getattr(layout.model, "mlp_multipliers", False)
        if flow.input[index] or adapted & {"gate_proj", "up_proj"}:
            out += tc * w["inter"] * e * ((3 if scaled else 2) if gated else 1)
        out += tc * w["inter"] * e if "down_proj" in adapted else 0
    return out


def lora_saved_bytes(layout: Layout, index: int) -> int:
    """The adapters of block ``index``: each keeps ``h = A x`` [Tc, r] for ``B``'s gradient (``full``
    checkpointing recomputes it); under ``selective`` those on ``in_proj``, q, k, v (of a Zamba2 use: every one)
    keep ``h`` and ``B h`` [Tc, out/tp] (the policy keeps every matmul output before the mixing kernel; a block
    without one keeps its input only)."""
    if not layout.lora_rank or layout.checkpointing == "full":
        return 0
    params = adapter_params(layout)[f"backbone.layers.{index}"]
    r, tc, e = layout.lora_rank, layout.tokens, layout.act_bytes
    if layout.checkpointing == "none":
        return sum(p.name.endswith(".lora_A") for p in params) * tc * r * e
    kind = layout.model.pattern[index]
    if kind not in "M*PZ":
        return 0
    before = [p for p in params if kind == "Z" or adapted_linear(p.name) in INPUT_SIDE[:4]]  # Z: all, before its
    # layer's Mamba core
    return sum(tc * (r if p.name.endswith(".lora_A") else p.shape[0]) * e for p in before)
