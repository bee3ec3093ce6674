"""The token-mixing core of a Kimi Delta Attention layer (Kimi Linear), documents reset.

    mixed_qkv [B, L, 3*H*d] (pre-conv, channels q | k | v), f [B, L, H*d], b [B, L, H]
      -> depthwise causal conv over the sequence, documents reset   (models/mamba/conv.py) -> SiLU
      -> q, k l2-normed per head (x / sqrt(|x|^2 + 1e-6)), from here in float32 or wider
      -> beta = sigmoid(b),  g = -exp(A_log[h]) * softplus(f + dt_bias)    (per head and key channel)
      -> chunked KDA rule, documents reset                          (kda.py; on CUDA with fla-core,
         FLA's chunk_kda on the row-major stream: kda_fused.py, chosen as the gated DeltaNet's)
      -> o [B, L, H*d]

the steps of transformers' ``KimiLinearDeltaAttention.forward`` between its projections
(``q_proj, k_proj, v_proj``; ``f = forget_gate.f_b_proj(forget_gate.f_a_proj(u))``; ``b_proj``) and
its gated output norm. The head count is read from ``b``, so a context-parallel share of the heads
runs the same code; document boundaries come as ``cu_docs`` on the row-major token stream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridpar.models.linear.gdn_core import document_conv1d, l2norm, rule_on_rows
from hybridpar.models.linear.kda import chunk_kda_rule
from hybridpar.models.linear.kda_fused import choose_kda_kernel, fused_kda_rule
from hybridpar.models.mamba.core import row_documents

__all__ = ["kda_inputs", "kimi_delta_core"]


def kda_inputs(mixed: Tensor, f: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor, *,
               head_dim: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q, k, v [.., H, d], g [.., H, d], beta [.., H])`` of the conv output ``mixed`` (after SiLU),
    ``A_log`` (``H`` values, any shape) and ``dt_bias [H*d]``, in float32 or wider; q, k l2-normed."""
    heads = b.shape[-1]
    dtype = torch.promote_types(torch.float32, mixed.dtype)
    q, k, v = (x.unflatten(-1, (heads, head_dim)) for x in mixed.to(dtype).split(heads * head_dim, dim=-1))
    q, k = l2norm(q), l2norm(k)
    decay_rate = A_log.to(dtype).reshape(heads, 1).exp()  # [H, 1]
    g = -decay_rate * F.softplus((f.to(dtype) + dt_bias.to(dtype)).unflatten(-1, (heads, head_dim)))
    return q, k, v, g, b.to(dtype).sigmoid()


def kimi_delta_core(
    mixed_qkv: Tensor, f: Tensor, b: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, A_log: Tensor,
    dt_bias: Tensor, *, head_dim: int, chunk_size: int = 64, cu_docs: Tensor | None = None,
) -> Tensor:
    """The core above for the heads in the inputs: ``conv_weight [3*H*d, K]``, ``A_log`` (``H``
    values), ``dt_bias [H*d]``; returns ``o [B, L, H*d]`` in ``mixed_qkv``'s dtype."""
    batch, seqlen, width = mixed_qkv.shape
    heads = b.shape[-1]
    if width != 3 * heads * head_dim or f.shape[-1] != heads * head_dim or conv_weight.shape[0] != width:
        raise ValueError(f"KDA core: mixed_qkv width {width}, forget-gate width {f.shape[-1]} and conv channels "
                         f"{conv_weight.shape[0]} must be 3*H*d, H*d and 3*H*d for H={heads} heads of d={head_dim}; "
                         "pass q | k | v, f and b of the same heads.")
    if cu_docs is None:
        cu_docs = row_documents(None, batch, seqlen, mixed_qkv.device)
    mixed = F.silu(document_conv1d(mixed_qkv, conv_weight, conv_bias, cu_docs))
    q, k, v, g, beta = kda_inputs(mixed, f, b, A_log, dt_bias, head_dim=head_dim)
    return rule_on_rows(q, k, v, g, beta, cu_docs, choose_kda_kernel(mixed_qkv)[0], fused_kda_rule, chunk_kda_rule,
                        chunk_size, mixed_qkv.dtype)
