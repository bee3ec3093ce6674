"""One attention core signature, three kernels behind it, and the index math each needs.

``attention_core(q, k, v, layout)`` computes document-causal attention of ``q [B, S_q, Hq, Dh]``
over ``k, v [B, S_k, Hkv, Dh]`` for the positions and documents of an ``AttentionLayout``
(``attention/layout.py``). Which kernel runs:

- ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2) on CUDA for
  fp16/bf16 rows in sequence order (``layout.cu_seqlens`` set: one process, ulysses). The
  ``B`` rows are laid end to end, ``[B, S, H, Dh] -> [B*S, H, Dh]`` with
  ``cu_seqlens_of_rows``; causal and the sliding window are ``window_size = (W-1 or -1, 0)``.
  torch 2.11's ``varlen_attn`` has windows but no ``enable_gqa``: there each key/value head is
  repeated to its ``Hq / Hkv`` query heads first (two ``[B, S, Hq, Dh]`` copies, summed back in
  backward); torch >= 2.12 takes the grouped heads as they are. (Before, torch 2.11 fell back to
  flex: at ``small``'s 128K tokens on an H200 its two attention layers took 133 ms of CUDA time,
  ``gpu_profile_small_131072_pure_core.md``.)
- ``"flex"``: FlexAttention on CUDA for any token order (the all-gather layout), fp16, bf16
  or fp32, head_dim up to 256 (zero-padded to a power of two of at least 16: ``q . k`` and the
  kept output columns are unchanged; DeepSeek's 192, Phi-2's 80); also for soft-capped scores (Gemma2), as
  ``score_mod`` ``c * tanh(s / c)``, which varlen cannot apply. Its ``BlockMask`` comes from the same
  block ranges as the pure core at 128-token blocks (``block_visibility``: "all visible"
  blocks are full blocks, the rest of "maybe" get ``mask_mod``), and ``mask_mod`` is the
  token rule on the layout's index tensors.
- ``"blockwise"``: ``flash.blockwise_attention`` (pure PyTorch) everywhere else: CPU,
  float64, other head dims, or no fused kernel in this torch.

The choice is logged once per kernel per process (``logging``, logger
``hybridpar.models.attention.kernels``; skipped while ``torch.compile`` traces). Plans and
block masks are cached in ``layout.cache``: built once per batch, shared by every layer.
"""

from __future__ import annotations

import inspect
import logging
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridpar.models.attention.layout import (
    AttentionLayout,
    block_plan,
    block_ranges,
    block_visibility,
    cached,
    check_block_sizes,
    check_sliding_window,
    cu_seqlens_of_rows,
    invisible,
)
from hybridpar.models.attention.blockwise import BLOCK_SIZE, KEYS_PER_STEP, blockwise_attention, check_qkv, check_softcap
from hybridpar.models.attention.sinks import check_sinks, sink_attention

__all__ = [
    "FLEX_BLOCK_SIZE",
    "KERNELS",
    "attention_core",
    "choose_kernel",
    "flex_block_mask",
    "flex_mask_mod",
    "kernel_for",
    "plan_for",
    "varlen_kernel",
]

logger = logging.getLogger(__name__)

KERNELS = ("varlen", "flex", "blockwise")
FLEX_BLOCK_SIZE = 128
_LOGGED: set[str] = set()
_COMPILED_FLEX = None


_VARLEN: tuple | None = None


def varlen_kernel() -> tuple:
    """``(varlen_attn, takes grouped heads)``: torch's ``varlen_attn`` if it takes sliding windows (torch
    >= 2.11), else None; whether it takes fewer key/value heads than query heads (``enable_gqa``, torch
    >= 2.12). Resolved once, on first use, not at import (torch's varlen module loads ``torch._dynamo``,
    which planning never needs); ``apply_compile`` resolves it before tracing, so ``torch.compile``
    reads two constants."""
    global _VARLEN
    if _VARLEN is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            _VARLEN = (None, False)
        else:
            params = inspect.signature(varlen_attn).parameters
            _VARLEN = ((varlen_attn if "window_size" in params else None), "enable_gqa" in params)
    return _VARLEN


def _varlen_attn():
    """torch's ``varlen_attn`` where it takes sliding windows, else None (``varlen_kernel``)."""
    return varlen_kernel()[0]


def _flex_attention():
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return flex_attention


def kernel_for(device_type: str, dtype: torch.dtype, head_dim: int, sequence_ordered: bool,
               capability: tuple[int, int] | None = None, softcap: bool = False) -> tuple[str, str]:
    """``(kernel, reason)``: the rules above, as a pure function (``capability``: the CUDA device's;
    ``softcap``: soft-capped scores, which varlen cannot apply)."""
    if device_type != "cuda":
        return "blockwise", f"device {device_type}"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return "blockwise", f"dtype {dtype} has no fused CUDA kernel"
    if (sequence_ordered and not softcap and dtype != torch.float32 and head_dim % 8 == 0 and head_dim <= 256
            and capability is not None and capability >= (8, 0) and _varlen_attn() is not None):
        return "varlen", "sequence-ordered rows"
    if head_dim <= 256 and _flex_attention() is not None:
        why = "soft-capped scores" if softcap else "sequence-ordered float32 rows" if sequence_ordered else \
            "out-of-order tokens"
        return "flex", why
    return "blockwise", f"no fused kernel for head_dim {head_dim} in torch {torch.__version__}"


def choose_kernel(q: Tensor, layout: AttentionLayout, softcap: bool = False) -> tuple[str, str]:
    """``(kernel, reason)`` for these inputs (device, dtype, head_dim, token order, soft-capping)."""
    capability = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    return kernel_for(q.device.type, q.dtype, q.shape[-1], layout.sequence_ordered, capability, softcap)


def _log_once(kernel: str, reason: str, q: Tensor) -> None:
    if kernel not in _LOGGED and not torch.compiler.is_compiling():
        _LOGGED.add(kernel)
        logger.info("attention kernel: %s (%s; %s on %s, head_dim %d)", kernel, reason, q.dtype, q.device, q.shape[-1])


def plan_for(layout: AttentionLayout, block_size: int, keys_per_step: int, sliding_window: int | None):
    """The blockwise plan of this layout (cached; None while tracing: the op then builds it)."""
    if torch.compiler.is_compiling():
        return None
    return cached(layout.cache, ("plan", block_size, keys_per_step, sliding_window), lambda: block_plan(
        layout.q_pos, layout.q_doc, layout.k_pos, layout.k_doc, block_size, keys_per_step, sliding_window))


def flex_mask_mod(layout: AttentionLayout, sliding_window: int | None = None):
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``: the token rule on the layout's indices."""
    q_pos, q_doc, k_pos, k_doc = layout.q_pos, layout.q_doc, layout.k_pos, layout.k_doc
    last_q, last_k = q_pos.numel() - 1, k_pos.numel() - 1

    def mask_mod(b, h, q_idx, kv_idx):
        q_idx, kv_idx = q_idx.clamp(max=last_q), kv_idx.clamp(max=last_k)  # padded tiles read in bounds
        return ~invisible(q_pos[q_idx], q_doc[q_idx], k_pos[kv_idx], k_doc[kv_idx], sliding_window)

    return mask_mod


def flex_block_mask(layout: AttentionLayout, sliding_window: int | None = None, block_size: int = FLEX_BLOCK_SIZE):
    """A ``BlockMask`` from the block ranges: no ``[S_q, S_k]`` mask is ever evaluated."""
    from torch.nn.attention.flex_attention import BlockMask

    maybe, every = block_visibility(
        block_ranges(layout.q_pos, layout.q_doc, block_size), block_ranges(layout.k_pos, layout.k_doc, block_size),
        sliding_window,
    )  # [n_q_blocks, n_k_blocks] on the layout's device

    def ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:  # counts [1, 1, n_q], indices [1, 1, n_q, n_k]
        indices = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return blocks.sum(-1).to(torch.int32)[None, None], indices[None, None]

    partial_num, partial_idx = ordered(maybe & ~every)
    full_num, full_idx = ordered(every)
    return BlockMask.from_kv_blocks(
        partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=block_size,
        mask_mod=flex_mask_mod(layout, sliding_window), seq_lengths=(layout.q_pos.numel(), layout.k_pos.numel()),
    )


def flex_score_mod(softcap: float | None):
    """FlexAttention ``score_mod`` of logit soft-capping, ``c * tanh(s / c)`` (None without a cap);
    flex differentiates it, so backward gets the same ``1 - tanh^2`` the blockwise core applies."""
    if softcap is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return score_mod


def flex_head_dim(head_dim: int) -> int:
    """The power of two (at least 16) flex's kernels take a ``head_dim`` up to 256 in."""
    return max(16, 1 << (head_dim - 1).bit_length())


def _run_flex(q, k, v, layout, scale, sliding_window, softcap=None, compiled=True):
    global _COMPILED_FLEX
    head_dim = q.shape[-1]
    padded = flex_head_dim(head_dim)
    if padded != head_dim:  # zeros: q . k unchanged, the padded output columns are dropped
        q, k, v = (F.pad(t, (0, padded - head_dim)) for t in (q, k, v))
    flex = _flex_attention()
    if compiled and not torch.compiler.is_compiling():  # eager flex_attention is a slow dense reference
        _COMPILED_FLEX = _COMPILED_FLEX or torch.compile(flex)
        flex = _COMPILED_FLEX
    mask = cached(layout.cache, ("flex", sliding_window, q.device), lambda: flex_block_mask(layout, sliding_window))
    out = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=flex_score_mod(softcap),
               block_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)[..., :head_dim]  # [B, Hq, S_q, Dh'] -> [B, S_q, Hq, Dh]


def _run_varlen(q, k, v, layout, scale, sliding_window):
    batch, seq_len, heads = q.shape[:3]
    cu = cached(layout.cache, ("cu_seqlens", batch, q.device),
                 lambda: cu_seqlens_of_rows(layout.cu_seqlens.to(q.device), batch))
    window = (-1 if sliding_window is None else sliding_window - 1, 0)
    gqa = {"enable_gqa": True} if varlen_kernel()[1] else {}
    if not gqa and k.shape[2] != heads:  # torch 2.11: each key/value head repeated to its query heads
        k, v = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (k, v))  # [B, S, Hq, Dh]
    out = _varlen_attn()(
        q.reshape(batch * seq_len, *q.shape[2:]), k.reshape(batch * seq_len, *k.shape[2:]),
        v.reshape(batch * seq_len, *v.shape[2:]), cu, cu, layout.max_seqlen, layout.max_seqlen,
        scale=scale, window_size=window, **gqa,
    )  # [B*S, Hq, Dh]
    return out.view(q.shape)


def attention_core(
    q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout, *, scale: float | None = None,
    sliding_window: int | None = None, block_size: int = BLOCK_SIZE, keys_per_step: int = KEYS_PER_STEP,
    kernel: str | None = None, softcap: float | None = None, sinks: Tensor | None = None,
) -> Tensor:
    """Document-causal attention ``[B, S_q, Hq, Dh]`` on the best kernel (or the one named);
    ``softcap`` (Gemma2's logit soft-capping) runs on flex or the blockwise core (varlen cannot cap);
    ``sinks [Hq]`` (GPT-OSS's attention sinks, ``models/attention/sinks.py``) on the blockwise core."""
    check_qkv(q, k, v, "attention_core")
    check_block_sizes(block_size, keys_per_step)
    check_sliding_window(sliding_window)
    check_softcap(softcap)
    if softcap is not None and kernel == "varlen":
        raise ValueError("attention kernel 'varlen' does not soft-cap scores; pass kernel=None, 'flex' or 'blockwise'.")
    if sinks is not None:
        check_sinks(sinks, q.shape[2], "attention_core")
        if kernel not in (None, "blockwise"):
            raise ValueError(f"attention kernel {kernel!r} has no attention sinks; pass kernel=None or 'blockwise'.")
        kernel, reason = "blockwise", "attention sinks"
    if kernel is None:
        kernel, reason = choose_kernel(q, layout, softcap is not None)
    elif kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {list(KERNELS)} or None (automatic).")
    else:
        reason = "requested"
        missing = {"varlen": _varlen_attn, "flex": _flex_attention}.get(kernel)
        if missing is not None and missing() is None:
            raise ValueError(f"attention kernel {kernel!r} is not in torch {torch.__version__} (varlen needs "
                             "torch.nn.attention.varlen.varlen_attn with window_size, torch >= 2.11; "
                             "flex needs torch.nn.attention.flex_attention); pass kernel=None to choose automatically.")
    _log_once(kernel, reason, q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if kernel == "varlen":
        return _run_varlen(q, k, v, layout, scale, sliding_window)
    if kernel == "flex":
        return _run_flex(q, k, v, layout, scale, sliding_window, softcap)
    plan = plan_for(layout, block_size, keys_per_step, sliding_window)
    if sinks is not None:
        return sink_attention(q, k, v, sinks, layout.q_pos, layout.q_doc, layout.k_pos, layout.k_doc, plan, scale=scale,
                              sliding_window=sliding_window, block_size=block_size, keys_per_step=keys_per_step,
                              softcap=softcap)
    return blockwise_attention(q, k, v, layout.q_pos, layout.q_doc, layout.k_pos, layout.k_doc, plan, scale=scale,
                               sliding_window=sliding_window, block_size=block_size, keys_per_step=keys_per_step,
                               softcap=softcap)
