"""Zamba2 under LoRA (``peft.method=lora``): the linears a shared block's use may adapt, what it keeps for backward.

Every hybrid layer holds its own copy of the shared block's modules, the weights tied (``plan/hf/zamba2.py``), so
LoRA puts adapters on each use's copy: each use has its own (FSDP shards them with the shared block's unit, as
Zamba2's own per-use adapters). The base, Zamba2's own adapters included, is frozen.
"""

from __future__ import annotations

from hybridpar.plan.hf.zamba2 import weights_per_use, zamba2_reach
from hybridpar.plan.layout import Layout

__all__ = ["zamba2_lora_linears", "zamba2_lora_bytes"]


def zamba2_lora_linears(config) -> dict[str, tuple[int, int, str]]:
    """The linears LoRA may adapt in one ``Z`` block, as ``plan/params.adapter_params`` reads them
    (``(in, out, TP style)``): its use's copy of the shared block (every hybrid layer holds its own copy, the
    weights tied, so each use has adapters of its own): q, k, v ``[2D -> H dh]`` and ``gate_up_proj`` column-
    parallel, o and ``down_proj`` row-parallel; and its layer's ``linear [D, D]``, which TP leaves whole."""
    d, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"q_proj": (2 * d, q, "col"), "k_proj": (2 * d, kv, "col"), "v_proj": (2 * d, kv, "col"),
            "o_proj": (q, d, "row"), "gate_up_proj": (d, 2 * inter, "col"), "down_proj": (inter, d, "row"),
            "linear": (d, d, "whole")}


def zamba2_lora_bytes(layout: Layout, w: dict, core: int, hf_norm: int, adapted: set, upstream: bool) -> int:
    """What one ``Z`` block keeps under LoRA, policy none, beyond its adapters' ``h`` (``plan/lora.py``): the base
    (and Zamba2's own per-use adapters) frozen, a tensor is kept only for a gradient into what lies before it.
    ``upstream``: an adapter before this block (``grad_flow``'s ``input``); ``adapted``: this use's adapted linears.
    Walking the block, a node's backward runs where anything before it trains::

        the 2D norm           u (a 16-bit stream: its float32 copy), rstd       where upstream
        attention core        q, k, v, out, lse (+ RoPE's float32 lift)         ... or q, k, v adapted
        the MLP norm          a, rstd (+ transformers' copy under SP)           ... or o_proj adapted
        the fused MLP         [g | p], act(g)                                   ... or gate_up_proj adapted

    and each adapter's ``A`` keeps what it reads: norm(u) ``[Tc, 2D]`` (one, or under autocast each its own cast),
    o_proj's input ``[Tc, q]``, norm(a) ``[Tc, D]``, down's ``[Tc, I/tp]``, the linear's ``[Ts, D]``. Under
    autocast the bf16 copies of the matrices the use reads (its LoRA factors too), where a gradient passes."""
    c, e, es, ec = layout.model, layout.act_bytes, layout.stream_bytes, layout.compute_bytes
    tc, ts, d, cast = layout.tokens, layout.stream_tokens, c.hidden_size, layout.autocast
    qkv = adapted & {"q_proj", "k_proj", "v_proj"}
    reach_core, reach_mlp = zamba2_reach(adapted, upstream)
    rope = cast and int(c.head_dim * c.rotary_fraction) // 2 * 2 > 0
    out = ts * ec + ts * 2 * d * max(es, ec) if upstream else 0
    out += tc * 2 * d * e * (len(qkv) if cast else 1) if qkv else 0
    out += core + (tc * (2 * w["q"] + w["kv"]) * (ec - e) if rope else 0) if reach_core else 0
    if "o_proj" in adapted and (layout.tp > 1 or rope or not reach_core):  # else the core's out, counted
        out += tc * w["q"] * e
    if reach_mlp:
        out += ts * ec + (ts * d * e if cast else (0 if hf_norm and es < ec else ts * d * es)) + hf_norm
    if reach_mlp or "gate_up_proj" in adapted:
        out += tc * 3 * c.intermediate_size * e
    out += tc * d * e if "gate_up_proj" in adapted else 0
    out += tc * c.intermediate_size // layout.tp * e if "down_proj" in adapted else 0
    out += ts * d * e if "linear" in adapted else 0
    if cast and upstream:
        tp = {"col": (1, layout.tp), "row": (layout.tp, 1), "whole": (1, 1)}  # A [r, in], B [out, r], TP-local
        lora = sum(layout.lora_rank * (i // tp[style][0] + o // tp[style][1])
                   for name, (i, o, style) in zamba2_lora_linears(c).items() if name in adapted)
        out += 2 * (weights_per_use(layout) + lora)
    return out
