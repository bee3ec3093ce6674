"""The largest short-lived tensors: workspaces of one block's forward and backward, the loss,
FSDP's gathered parameters and communication buffers (per rank, one pack; symbols in ``layout.py``).

Forward of one block, on top of what earlier blocks keep (``e_c`` compute dtype)::

    Mamba2     conv + SiLU outputs [Tc, W_conv] e_c, dt terms [Tc, 4 H], chunk states [Tc/Q, H, P, N] e_c
    attention  K, V transposed to [Hkv, S_k, Dh] e_c, the scores of one step [Hq, 256, 1024] e_c
               (flash.py: blocks of 256 queries x 1024 keys, exponentiated in place)
    MLP        the pre-activation [Tc, I] (gated: 2 I)
    MoE (E)    ``plan/hf/moe.moe_workspaces``: the routed rows [Tc k, ...] of every expert at once
    Zamba2 (Z) the larger of its attention's and its fused MLP's ([g | p] and the adapter's output 2 [Tc, 2I])
    every      the block output [Ts, D] (+ the mixer output [Tc, D] before SP's reduce-scatter)

Backward of one block: its recomputation (the forward workspace again; under ``full`` and
``selective`` also the block's dropped tensors, rebuilt for this block only), the gradients of its
saved tensors and inputs, and the residual gradient ``[Ts, D] + [Tc, D]``:

    Mamba2     the core's backward (``mamba_core`` + ``ssd_chunked.backward``), below; the block's
               out_proj input, y and gated-norm rstd are already freed (``Workspaces.freed``), and so
               are a transformers gated norm's float32 ``silu(z)``, product and normalized product
    P          (a twin's Falcon-H1 layer) max(Mamba2's, attention's + freed): the attention branch ran
               last, so its backward runs first, before anything is freed, and frees the branch's
               input copy, q, k, v, out and lse (+ ``freed``) before the Mamba2 branch's backward
               (measured: none of them live at the peak of its core's backward)
    attention  K, V copies + 1.5 score steps + dq, dk, dv in e_c and in e
    MLP        [Tc, 2 I] (gated: 3 I)

Mamba2's core backward, in the core's own layout (under ``cp_mamba=a2a`` all ``T = cp Tc`` tokens
and ``1/cp`` of the heads and groups; ``d = H P``, ``W = d + 2 G N``, chunks ``K = T/Q``, chunk
states ``St = K N d e_c``), everything in ``e_c`` but the norm's gradients::

    common  = dy, dz [T, d] e (gated norm's gradients, waiting; a 16-bit dy's float32 copy [T, d] e_c
              too) + conv pre-activation and SiLU output
              2 [T, W] + dt terms 2-3 [T, H] + xdt, dxdt 2 [T, d] + B, C, dB, dC 4 [T, G N]
              + cs, cs_excl, u, w, dcs 5 [T, H] + start states St
    part    = one slice of chunks, Tp = Q * min(K, 16 MiB / (H Q max(Q, P) e_c)) tokens:
              dy, dy rows 2 [Tp, d] + decay, scores, d_scores 3 [Tp, H, Q] + C.B [Tp, G, Q] (dCB is made
              once decay and scores are freed)
    left    = the last slice's tensors still bound after the loop: dy, dy rows 2 [Tp, d] + d_scores
              [Tp, H, Q] + C.B, dCB 2 [Tp, G, Q]
    loop    = common + dstart St + part + one matmul product [Tp, G, Q]
    passing = common + left + 4 St (grad_h, its flip, the recurrence's local and final states)
    backward = max(loop, passing)

checked against the allocator's live tensors at the peak of a ``tiny`` step at 16K tokens
(``benchmarks/planner.py``: 0.878 of the measured peak before, when the form left out the
state passing and the slice temporaries).

Loss (``lm_head_loss``, chunk ``C = 4096``, blocks of ``min(4 C, Tc)`` tokens): forward one
``[min(4 C, Tc), min(C, V/tp)]`` block of logits and its exponentials in ``e_c``; backward
``grad_hidden [Tc, D] e_c``, the weight gradient ``[V/tp, D] e_p``, one block ``dz`` and the block's
``[C, D]`` weight gradient in ``e_c``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from hybridpar.models.attention.blockwise import BLOCK_SIZE, KEYS_PER_STEP
from hybridpar.models.lm_head_loss import block_shape
from hybridpar.models.mamba.ssd_chunked import DIAGONAL_SLICE_BYTES
from hybridpar.train.loss import lm_head_loss

from hybridpar.plan.activations import (block_saved_bytes, block_widths, hf_gated_norm_bytes, hf_mixer_bytes,
                                        mixer_saved_bytes)
from hybridpar.plan.hf.moe import moe_workspaces
from hybridpar.plan.layout import Layout

__all__ = ["Workspaces", "block_workspaces", "mamba_core_backward", "loss_workspaces", "LOSS_CHUNK", "ATTENTION_STEP"]

LOSS_CHUNK = inspect.signature(lm_head_loss).parameters["chunk_size"].default  # the trainer's (4096)
ATTENTION_STEP = (BLOCK_SIZE, KEYS_PER_STEP)  # queries x keys per step of the flash core


@dataclass(frozen=True)
class Workspaces:
    forward: int
    backward: int
    freed: int = 0  # bytes of the block's saved tensors released before its backward's peak


def mamba_core_backward(layout: Layout) -> int:
    """Peak bytes of the Mamba2 core's backward beyond its saved inputs (the form above)."""
    c, w = layout.model, block_widths(layout)
    e, ec = layout.act_bytes, layout.compute_bytes
    scale = layout.cp if layout.cp > 1 and layout.cp_mamba == "a2a" else 1
    tokens, heads = layout.tokens * scale, w["heads"] // scale
    groups = max(1, w["groups"] // scale) if scale > 1 else w["groups"]
    d, gn, p, n = heads * c.mamba_head_dim, groups * c.ssm_state_size, c.mamba_head_dim, c.ssm_state_size
    q = min(c.chunk_size, tokens)
    chunks = -(-tokens // q)
    states = chunks * n * d * ec
    per_slice = max(1, DIAGONAL_SLICE_BYTES // (heads * q * max(q, p) * ec))
    slice_tokens = min(chunks, per_slice) * q
    dt_terms = 3 if tuple(c.time_step_limit) != (0.0, float("inf")) else 2
    upcast_dy = tokens * d * ec if e < ec else 0  # the core's float32 copy of a 16-bit dy
    common = (2 * tokens * d * e + upcast_dy
              + tokens * ec * (2 * (d + 2 * gn) + dt_terms * heads + 2 * d + 4 * gn + 5 * heads) + states)
    part = slice_tokens * ec * (2 * d + 3 * heads * q + groups * q)
    left = slice_tokens * ec * (2 * d + heads * q + 2 * groups * q)
    loop = common + states + part + slice_tokens * groups * q * ec
    passing = common + left + 4 * states
    return max(loop, passing)


def block_workspaces(layout: Layout, kind: str) -> Workspaces:
    """Transient bytes of one block's forward and backward (beyond what it keeps)."""
    w, e, tc, ts = block_widths(layout), layout.act_bytes, layout.tokens, layout.stream_tokens
    flow = ts * w["d"] * e + tc * w["d"] * e  # block output (+ mixer output) / residual gradients
    if kind == "P":  # a twin's Falcon-H1 layer: one branch's output is live while the other runs
        (mamba_fwd, mamba_bwd, freed), (attention_fwd, attention_bwd, _) = (
            _mixer_workspaces(layout, mixer, w) for mixer in "M*")
        forward = max(mamba_fwd, attention_fwd) + tc * w["d"] * e
        if not layout.lora_rank:  # attention ran last, so its backward runs first and frees what it kept
            freed += _attention_branch_saved(layout, w)  # before the Mamba branch's backward
        backward = max(mamba_bwd, attention_bwd + freed)  # attention's runs before anything is freed
    else:
        forward, backward, freed = _mixer_workspaces(layout, kind, w)
    forward, backward = forward + flow, backward + flow
    if layout.checkpointing != "none":  # backward first rebuilds the block's tensors
        backward += block_saved_bytes(layout, kind, "none") - block_saved_bytes(layout, kind)
    return Workspaces(forward, backward, freed)


def _attention_branch_saved(layout: Layout, w: dict) -> int:
    """What a Falcon-H1 layer's attention branch keeps (its multiplied input copy, q, k, v, out, lse):
    freed by its backward, which runs before the Mamba branch's (``block_workspaces``)."""
    copy = 0 if layout.autocast else layout.tokens * w["d"] * layout.act_bytes
    return copy + mixer_saved_bytes(layout, "*", w, True) + hf_mixer_bytes(layout, "*", w)


def _mixer_workspaces(layout: Layout, kind: str, w: dict) -> tuple[int, int, int]:
    """``(forward, backward, freed)`` of one mixer or MLP, beyond the residual flow."""
    c, e, ec, tc, seq = layout.model, layout.act_bytes, layout.compute_bytes, layout.tokens, layout.pack_size
    if kind == "M":
        w_conv = w["w_core"] - w["heads"]
        states = -(-tc // c.chunk_size) * w["d_inner"] * c.ssm_state_size * ec  # [Tc/Q, H, P, N]
        freed = tc * 2 * w["d_inner"] * e + tc * w["groups"] * ec  # out_proj input, y, gated-norm rstd
        freed += hf_gated_norm_bytes(layout, w) if layout.hf_decoder else 0  # transformers' float32 gated norm
        return tc * (w_conv + 4 * w["heads"]) * ec + states, mamba_core_backward(layout), freed
    if kind == "*":
        ulysses = layout.cp > 1 and layout.cp_attention == "ulysses"
        kv_tokens = seq if layout.cp > 1 and layout.cp_attention != "ring" else tc
        q_tokens, scale = (seq, layout.cp) if ulysses else (tc, 1)
        step = max(1, w["hq"] // scale) * ATTENTION_STEP[0] * min(ATTENTION_STEP[1], kv_tokens) * ec
        kv_copy = kv_tokens * 2 * w["kv"] // scale * ec
        grads = (q_tokens * w["q"] + kv_tokens * 2 * w["kv"]) // scale * ec
        return kv_copy + step, kv_copy + 3 * step // 2 + grads + tc * (w["q"] + 2 * w["kv"]) * e, 0
    if kind == "E":
        return *moe_workspaces(layout), 0
    if kind == "Z":  # a Zamba2 shared block's use: its attention's, or its fused MLP's [Tc, 2I] output and
        attention = _mixer_workspaces(layout, "*", w)  # adapter's output (forward), [Tc, 3I] (backward)
        inter = c.intermediate_size
        return max(attention[0], tc * 4 * inter * e), max(attention[1], tc * 3 * inter * e), 0
    gated = c.mlp_gated
    return tc * w["inter"] * e * (2 if gated else 1), tc * w["inter"] * e * (3 if gated else 2), 0


def loss_workspaces(layout: Layout) -> Workspaces:
    c, ec, tc = layout.model, layout.compute_bytes, layout.tokens
    vocab = c.vocab_size // layout.tp
    token_block, row_block = block_shape(tc, vocab, LOSS_CHUNK)
    block = token_block * row_block * ec
    forward = 2 * block
    backward = tc * c.hidden_size * ec + vocab * c.hidden_size * layout.param_bytes + 2 * block + \
        row_block * c.hidden_size * ec
    return Workspaces(forward, backward)
