"""Gated short convolutions (LFM2, LFM2-MoE, LFM3) that reset at document boundaries, recognised by
structure, never by class name.

A transformers module is a *short conv* when it has ``in_proj`` / ``out_proj`` (``nn.Linear``) and a
depthwise causal ``conv`` (``nn.Conv1d``, ``C`` channels, kernel ``K``, padding ``K-1``), with
``in_proj`` of width ``3C`` (``[B | C | x]``), ``out_proj`` reading ``C`` and no ``A_log`` (not a
Mamba mixer). Per token ``t`` of document ``d`` (``u [T, D]`` the mixer's input)::

    [b | c | x]_t = in_proj(u_t)                                  each [C]
    v_t = b_t * x_t
    s_t = bias + sum_{lag=0}^{K-1} w[:, K-1-lag] * v_{t-lag}       (v_{t-lag} = 0 before d's start)
    out_t = out_proj(c_t * s_t)

No activation follows the conv (Mamba's SiLU does not apply). transformers' own forward runs the
conv over the whole row, so a packed row leaks the last ``K-1`` tokens of one document into the
next; ``install_short_conv`` switches the module's forward to ``module.core(module, bcx, packed)``
(default ``local_short_conv``), which runs ``gated_short_conv``: the document-resetting conv of
``models/mamba/conv.py`` (the Mamba2 conv, exact, no per-tap copies) inside one autograd
Function that keeps only ``in_proj``'s output ``[T, 3C]`` (transformers' autograd keeps ``b, c, x``,
``v`` and ``s``: ``5C`` per token) and recomputes ``v`` and ``s`` in backward::

    ds = c * g,  dc = s * g,  (dv, dw, dbias, dhistory) = conv_backward(v, ds),  db = dv * x,  dx = dv * b

A document starting at ``init_at`` reads its ``K-1`` earlier ``v`` from ``history [m, K-1, C]``
(the context-parallel halo, ``parallel/context/recurrent/short_conv.py``), whose gradient flows back.
``module.core`` is the seam CP strategies replace. Low-precision inputs run the conv in float32
and round ``v`` and ``s`` as transformers does. The batch's ``PackedSeqParams`` arrive as
``packed_seq_params`` through the decoder layer's ``**kwargs``. Parameter names do not change
(``parallelize`` later stores ``in_proj`` per component ``b, c, x``: ``parallel/tensor/hf_plans/dense.py``).
With a cache (generation) or a padding ``attention_mask`` the module's own forward runs.

Single-device code (no process group).
"""

from __future__ import annotations


import torch
from torch import Tensor, nn

from hybridpar.models.hf.mixers.fallback import takes_transformers_forward
from hybridpar.models.hf.mixers.mamba2 import switch_mixers
from hybridpar.models.mamba.conv import conv_backward, conv_forward
from hybridpar.models.mamba.core import row_documents

__all__ = ["SHORT_CONV_MARK", "is_short_conv", "short_conv_problem", "install_short_conv", "short_convs",
           "gated_short_conv", "local_short_conv", "short_conv_training_forward"]

SHORT_CONV_MARK = "hybridpar_short_conv"  # set on a short conv whose forward resets at document boundaries


def _local(t: Tensor | None) -> Tensor | None:
    """The rank-local tensor of a (DTensor) parameter, differentiable."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def is_short_conv(module: nn.Module) -> bool:
    """Whether ``module`` has the structure of a gated short conv (module docstring)."""
    if type(module).__module__.startswith("hybridpar") or "A_log" in dict(module.named_parameters(recurse=False)):
        return False
    conv, in_proj, out_proj = (getattr(module, a, None) for a in ("conv", "in_proj", "out_proj"))
    if not (isinstance(conv, nn.Conv1d) and isinstance(in_proj, nn.Linear) and isinstance(out_proj, nn.Linear)):
        return False
    channels = conv.in_channels
    return (conv.out_channels == conv.groups == channels and in_proj.out_features == 3 * channels
            and out_proj.in_features == channels)


def short_conv_problem(name: str, module: nn.Module) -> str | None:
    """Why ``gated_short_conv`` cannot run short conv ``module`` exactly (None: it can)."""
    conv = module.conv
    where = f"short conv {name!r} ({type(module).__name__})"
    k = conv.kernel_size[0]
    if conv.stride != (1,) or conv.dilation != (1,) or conv.padding_mode != "zeros":
        return (f"{where} has conv stride {conv.stride}, dilation {conv.dilation}, padding_mode "
                f"{conv.padding_mode!r}; hybridpar's short conv takes stride 1, dilation 1, zero padding")
    if conv.padding != (k - 1,):
        return f"{where} has conv padding {conv.padding} with kernel {k}; a causal short conv pads kernel - 1 = {k - 1}"
    return None


class _GatedShortConv(torch.autograd.Function):
    """``y = c * conv(b * x)`` on the token stream; saves its inputs only (module docstring)."""

    @staticmethod
    def forward(ctx, bcx, weight, bias, cu_docs, init_at, history):
        _, s = _conv(bcx, weight, bias, cu_docs, init_at, history)
        ctx.save_for_backward(bcx, weight, bias, cu_docs, init_at, history)
        return (bcx.chunk(3, dim=-1)[1].to(s.dtype) * s).to(bcx.dtype)  # c * s

    @staticmethod
    def backward(ctx, grad_y):
        bcx, weight, bias, cu_docs, init_at, history = ctx.saved_tensors
        v, s = _conv(bcx, weight, bias, cu_docs, init_at, history)  # recomputed: K multiply-adds
        b, c, x = (part.to(s.dtype) for part in bcx.chunk(3, dim=-1))
        grad = grad_y.to(s.dtype)
        dv, dweight, dbias, dhistory = conv_backward(v, weight.to(s.dtype), bias is not None, cu_docs, init_at,
                                                     None if history is None else history.to(s.dtype), grad * c)
        dbcx = torch.cat([dv * x, grad * s, dv * b], dim=-1).to(bcx.dtype)  # [T, 3C]: d[b | c | x]
        return (dbcx, dweight.to(weight.dtype), None if dbias is None else dbias.to(bias.dtype), None, None,
                None if dhistory is None else dhistory.to(history.dtype))


def _conv(bcx, weight, bias, cu_docs, init_at, history):
    """``(v, s)`` in the compute dtype (float32 for low-precision activations), rounded to the
    activations' dtype as transformers computes them (``b * x`` in the activation dtype, the conv in
    the weight's, its output cast back)."""
    dtype = torch.promote_types(bcx.dtype, torch.float32)
    b, _, x = bcx.chunk(3, dim=-1)  # [T, C] views
    v = (b * x).to(dtype)
    s = conv_forward(v, weight.to(dtype), None if bias is None else bias.to(dtype), cu_docs, init_at,
                     None if history is None else history.to(dtype))
    return v, s.to(bcx.dtype).to(dtype)


def gated_short_conv(bcx: Tensor, weight: Tensor, bias: Tensor | None, cu_docs: Tensor, init_at: Tensor | None = None,
                     history: Tensor | None = None) -> Tensor:
    """``y [T, C] = c * conv(b * x)`` for the stream ``bcx [T, 3C]`` (``[b | c | x]``) with documents
    ``cu_docs``, conv ``weight [C, K]`` and ``bias [C]``; ``history [m, K-1, C]`` enters the documents
    starting at ``init_at [m]`` (module docstring)."""
    if bcx.dim() != 2 or bcx.shape[-1] != 3 * weight.shape[0]:
        raise ValueError(f"short conv input of shape {tuple(bcx.shape)} is not [T, 3C] for C={weight.shape[0]} conv "
                         "channels; pass in_proj's output flattened over tokens, sharded like the conv.")
    return _GatedShortConv.apply(bcx, weight, bias, cu_docs, init_at, history)


def conv_parameters(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """The conv's rank-local ``weight [C, K]`` and ``bias [C]`` (or None)."""
    return _local(module.conv.weight).squeeze(1), _local(module.conv.bias)


def local_short_conv(module: nn.Module, bcx: Tensor, packed=None) -> Tensor:
    """The single-process core: ``bcx [B, L, 3C] -> y [B, L, C]`` over this process's tokens in
    sequence order; packed documents (``packed.cu_seqlens_padded``) reset the conv."""
    batch, seq_len, width = bcx.shape
    cu_seqlens = None if packed is None else packed.cu_seqlens_padded
    weight, bias = conv_parameters(module)
    y = gated_short_conv(bcx.reshape(batch * seq_len, width), weight, bias,
                         row_documents(cu_seqlens, batch, seq_len, bcx.device))
    return y.view(batch, seq_len, width // 3)


def short_conv_training_forward(module: nn.Module, hidden_states: Tensor, cache=None,
                                attention_mask: Tensor | None = None, packed_seq_params=None, **kwargs) -> Tensor:
    """The short conv's forward through ``module.core`` (module docstring); ``hidden_states [B, L, D]``."""
    sharded = "channels" if hasattr(module.conv.weight, "to_local") else None  # a DTensor: tensor parallel
    if takes_transformers_forward(module, cache, attention_mask, packed_seq_params, kwargs, sharded):
        return module._hybridpar_transformers_forward(hidden_states, cache=cache, attention_mask=attention_mask,
                                                      **kwargs)
    bcx = module.in_proj(hidden_states)  # [B, L, 3C]
    y = module.core(module, bcx, packed_seq_params)  # [B, L, C]
    return module.out_proj(y)


def install_short_conv(model: nn.Module) -> list[str]:
    """Give every short conv of ``model`` the document-resetting forward through ``module.core``
    (idempotent); returns their names. Raises ``ValueError`` for a variant it cannot run exactly."""
    return switch_mixers(model, is_short_conv, short_conv_problem, SHORT_CONV_MARK, short_conv_training_forward,
                         local_short_conv, "a causal depthwise short conv")


def short_convs(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the short convs ``install_short_conv`` switched."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, SHORT_CONV_MARK, False)]
