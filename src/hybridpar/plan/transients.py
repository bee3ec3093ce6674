"""The largest short-lived tensors: workspaces of one block's forward and backward, the loss,
FSDP's gathered parameters and communication buffers (per rank, one pack; symbols in ``layout.py``).

Forward of one block, on top of what earlier blocks keep (``e_c`` compute dtype)::

    Mamba2     conv + SiLU outputs [Tc, W_conv] e_c, dt terms [Tc, 4 H], chunk states [Tc/Q, H, P, N] e_c
    attention  K, V transposed to [Hkv, S_k, Dh] e_c, the scores of one step [Hq, 256, 1024] e_c
               (flash.py: blocks of 256 queries x 1024 keys, exponentiated in place)
    MLP        the pre-activation [Tc, I] (gated: 2 I)
    every      the block output [Ts, D] (+ the mixer output [Tc, D] before SP's reduce-scatter)

Backward of one block: its recomputation (the forward workspace again; under ``full`` and
``selective`` also the block's dropped tensors, rebuilt for this block only), the gradients of its
saved tensors and inputs, and the residual gradient ``[Ts, D] + [Tc, D]``:

    Mamba2     core recompute + d(core inputs) [Tc, W_core] e_c + conv grads [Tc, W_conv] e_c
               + d(in_proj output) [Tc, W_in] e + 2 more chunk-state tensors + the diagonal
               blocks min(16 MiB, 4 Tc H Q e_c)
    attention  K, V copies + 1.5 score steps + dq, dk, dv in e_c and in e
    MLP        [Tc, 2 I] (gated: 3 I)

These workspace forms were checked against allocator peaks of single blocks (``tiny`` at 4K and
``small`` at 2K tokens, ``benchmarks/planner.py --section blocks``): within about 15%, the tiny
Mamba2 backward lower (its 16-token chunks add per-chunk tensors the form leaves out).

Loss (``lm_head_loss``, chunk ``C = 4096``): forward one ``[C, min(C, V/tp)]`` block of logits and its
exponentials in ``e_c``; backward ``grad_hidden [Tc, D] e_c``, the weight gradient ``[V/tp, D] e_p``,
one block ``dz`` and the block's ``[C, D]`` weight gradient in ``e_c``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from hybridpar.models.flash import BLOCK_SIZE, KEYS_PER_STEP
from hybridpar.models.ssd_chunked import DIAGONAL_SLICE_BYTES
from hybridpar.train.loss import lm_head_loss

from hybridpar.plan.activations import _widths, block_saved_bytes
from hybridpar.plan.layout import Layout

__all__ = ["Workspaces", "block_workspaces", "loss_workspaces", "LOSS_CHUNK", "ATTENTION_STEP"]

LOSS_CHUNK = inspect.signature(lm_head_loss).parameters["chunk_size"].default  # the trainer's (4096)
ATTENTION_STEP = (BLOCK_SIZE, KEYS_PER_STEP)  # queries x keys per step of the flash core


@dataclass(frozen=True)
class Workspaces:
    forward: int
    backward: int


def block_workspaces(layout: Layout, kind: str) -> Workspaces:
    """Transient bytes of one block's forward and backward (beyond what it keeps)."""
    c, w = layout.model, _widths(layout)
    e, ec, tc, ts, seq = layout.act_bytes, layout.compute_bytes, layout.tokens, layout.stream_tokens, layout.pack_size
    flow = ts * w["d"] * e + tc * w["d"] * e  # block output (+ mixer output) / residual gradients
    if kind == "M":
        w_conv = w["w_core"] - w["heads"]
        states = -(-tc // c.chunk_size) * w["d_inner"] * c.ssm_state_size * ec  # [Tc/Q, H, P, N]
        diagonal = min(DIAGONAL_SLICE_BYTES, 4 * tc * w["heads"] * c.chunk_size * ec)
        core = tc * (w_conv + 4 * w["heads"]) * ec + states
        forward = core + flow
        backward = core + tc * (w["w_core"] + w_conv) * ec + tc * w["w_in"] * e + 2 * states + diagonal + flow
    elif kind == "*":
        ulysses = layout.cp > 1 and layout.cp_attention == "ulysses"
        kv_tokens = seq if layout.cp > 1 and layout.cp_attention != "ring" else tc
        q_tokens, scale = (seq, layout.cp) if ulysses else (tc, 1)
        step = max(1, w["hq"] // scale) * ATTENTION_STEP[0] * min(ATTENTION_STEP[1], kv_tokens) * ec
        kv_copy = kv_tokens * 2 * w["kv"] // scale * ec
        forward = kv_copy + step + flow
        grads = (q_tokens * w["q"] + kv_tokens * 2 * w["kv"]) // scale * ec
        backward = kv_copy + 3 * step // 2 + grads + tc * (w["q"] + 2 * w["kv"]) * e + flow
    else:
        gated = c.mlp_gated
        forward = tc * w["inter"] * e * (2 if gated else 1) + flow
        backward = tc * w["inter"] * e * (3 if gated else 2) + flow
    if layout.checkpointing != "none":  # backward first rebuilds the block's tensors
        backward += block_saved_bytes(layout, kind, "none") - block_saved_bytes(layout, kind)
    return Workspaces(forward, backward)


def loss_workspaces(layout: Layout) -> Workspaces:
    c, ec, tc = layout.model, layout.compute_bytes, layout.tokens
    vocab = c.vocab_size // layout.tp
    block = min(LOSS_CHUNK, tc) * min(LOSS_CHUNK, vocab) * ec
    forward = 2 * block
    backward = tc * c.hidden_size * ec + vocab * c.hidden_size * layout.param_bytes + 2 * block + \
        min(LOSS_CHUNK, vocab) * c.hidden_size * ec
    return Workspaces(forward, backward)
