"""The token-mixing core of a gated DeltaNet layer (Qwen3-Next, Qwen3.5, OLMo-Hybrid), documents reset.

    mixed_qkv [B, L, 2*Hk*dk + Hv*dv] (pre-conv, channels q | k | v), a, b [B, L, Hv]
      -> depthwise causal conv over the sequence, documents reset   (models/mamba/conv.py) -> SiLU
      -> q, k l2-normed per head (x / sqrt(|x|^2 + 1e-6)), from here in float32 or wider
      -> beta = beta_scale * sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias)
      -> chunked gated delta rule, documents reset                (gated_delta.py; on CUDA with
         fla-core, FLA's chunk_gated_delta_rule: gdn_fused.py)
      -> o [B, L, Hv*dv]

the steps of transformers' ``*GatedDeltaNet.forward`` between its projections and its gated norm.
Head counts are read from the tensors (``Hv`` from ``a``; ``Hk`` from the width), so a
context-parallel share of the heads runs the same code. Document boundaries come as ``cu_docs`` on
the row-major token stream (``models.mamba.core.row_documents``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridpar.models.linear.gated_delta import chunk_gated_delta_rule, document_ids
from hybridpar.models.linear.gdn_fused import choose_gdn_kernel, fused_gated_delta_rule
from hybridpar.models.mamba.conv import conv_backward, conv_forward
from hybridpar.models.mamba.core import row_documents

__all__ = ["document_conv1d", "gated_delta_core", "gdn_inputs", "l2norm", "rule_on_rows"]


class _DocumentConv(torch.autograd.Function):
    """``conv_forward`` / ``conv_backward`` as an autograd function on ``[T, C]`` (history optional)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, cu_docs: Tensor, init_at: Tensor | None,
                history: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight, cu_docs, init_at, history)
        ctx.has_bias = bias is not None
        return conv_forward(x, weight, bias, cu_docs, init_at, history)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, cu_docs, init_at, history = ctx.saved_tensors
        dx, dweight, dbias, dhistory = conv_backward(x, weight, ctx.has_bias, cu_docs, init_at, history,
                                                     grad.contiguous())
        return dx, dweight, dbias, None, None, dhistory


def document_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, cu_docs: Tensor, init_at: Tensor | None = None,
                    history: Tensor | None = None) -> Tensor:
    """Causal depthwise conv (pre-activation) of ``x [B, L, C]`` with ``weight [C, K]``; no tap reads
    across a boundary of ``cu_docs`` (every row start among them); the documents starting at stream
    positions ``init_at [m]`` read their ``K-1`` earlier inputs from ``history [m, K-1, C]``."""
    batch, seqlen, width = x.shape
    dtype = torch.promote_types(x.dtype, weight.dtype)
    bias = None if bias is None else bias.to(dtype)
    history = None if history is None else history.to(dtype)
    flat = x.reshape(batch * seqlen, width).to(dtype)
    return _DocumentConv.apply(flat, weight.to(dtype), bias, cu_docs, init_at, history).view(batch, seqlen, width)


def gdn_inputs(mixed: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor, *, head_k_dim: int,
               head_v_dim: int, beta_scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q, k [.., Hk, dk] l2-normed, v [.., Hv, dv], g, beta [.., Hv])`` of the conv output ``mixed``
    (after SiLU), in float32 or wider."""
    v_heads = a.shape[-1]
    key_width = (mixed.shape[-1] - v_heads * head_v_dim) // 2
    dtype = torch.promote_types(torch.float32, mixed.dtype)  # norms, gates and the rule in float32 or wider
    q, k, v = mixed.to(dtype).split([key_width, key_width, v_heads * head_v_dim], dim=-1)
    q, k = (l2norm(x.unflatten(-1, (-1, head_k_dim))) for x in (q, k))  # [.., Hk, dk]
    beta = b.to(dtype).sigmoid() * beta_scale
    g = -A_log.to(dtype).exp() * F.softplus(a.to(dtype) + dt_bias.to(dtype))
    return q, k, v.unflatten(-1, (v_heads, head_v_dim)), g, beta


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's and transformers' ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_core(
    mixed_qkv: Tensor, a: Tensor, b: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, A_log: Tensor,
    dt_bias: Tensor, *, head_k_dim: int, head_v_dim: int, chunk_size: int = 64, cu_docs: Tensor | None = None,
    beta_scale: float = 1.0,
) -> Tensor:
    """The core above for the heads in the inputs: ``conv_weight [2*Hk*dk + Hv*dv, K]``, ``A_log`` and
    ``dt_bias [Hv]``; returns ``o [B, L, Hv*dv]`` in ``mixed_qkv``'s dtype."""
    batch, seqlen, width = mixed_qkv.shape
    v_heads = a.shape[-1]
    key_width, remainder = divmod(width - v_heads * head_v_dim, 2)
    if remainder or key_width <= 0 or key_width % head_k_dim or conv_weight.shape[0] != width:
        raise ValueError(f"gated DeltaNet core: mixed_qkv width {width} is not 2*Hk*{head_k_dim} + {v_heads}*{head_v_dim} "
                         f"or the conv has {conv_weight.shape[0]} channels; pass q | k | v of the same heads as a, b.")
    if cu_docs is None:
        cu_docs = row_documents(None, batch, seqlen, mixed_qkv.device)
    mixed = F.silu(document_conv1d(mixed_qkv, conv_weight, conv_bias, cu_docs))
    q, k, v, g, beta = gdn_inputs(mixed, a, b, A_log, dt_bias, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                                  beta_scale=beta_scale)
    return rule_on_rows(q, k, v, g, beta, cu_docs, choose_gdn_kernel(mixed_qkv)[0], fused_gated_delta_rule,
                        chunk_gated_delta_rule, chunk_size, mixed_qkv.dtype)


def rule_on_rows(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_docs: Tensor, kernel: str,
                 fused_rule, pure_rule, chunk_size: int, dtype: torch.dtype) -> Tensor:
    """A delta rule on rows ``[B, L, H, ...]`` of the documents ``cu_docs``: ``o [B, L, Hv*dv]`` in ``dtype``.

    ``kernel != "pure"`` (CUDA + fla-core, or a test's stand-in): ``fused_rule`` on the row-major stream
    ``[1, B*L, ...]`` with ``cu_docs`` as FLA's ``cu_seqlens``, q, k, v in ``dtype`` and g, beta in
    float32 or wider; else ``pure_rule`` with each token's document id."""
    batch, seqlen = q.shape[:2]
    if kernel != "pure":
        def stream(t: Tensor, to) -> Tensor:  # [B, L, ...] -> [1, B*L, ...]
            return t.reshape(1, batch * seqlen, *t.shape[2:]).to(to)

        o, _ = fused_rule(stream(q, dtype), stream(k, dtype), stream(v, dtype), stream(g, g.dtype),
                          stream(beta, beta.dtype), cu_seqlens=cu_docs, rule=kernel)
        return o.reshape(batch, seqlen, -1).to(dtype)
    o, _ = pure_rule(q, k, v, g, beta, doc_ids=document_ids(cu_docs, batch, seqlen), chunk_size=chunk_size)
    return o.flatten(-2).to(dtype)
