"""The Mamba2 mixer core as one opaque op that saves only its inputs.

    x, B, C (conv inputs), dt (raw)
      -> depthwise causal conv + SiLU on x, B, C          (conv.py, document resets)
      -> dt = clamp(softplus(dt + dt_bias), dt_min, dt_max)
      -> chunked SSD scan                                  (ssd_chunked.py)
      -> y [B, L, H, P] (D skip included), states after chosen tokens [m, H, P, N]

``hybridpar::ssd_chunk_scan`` is a ``torch.library.custom_op`` whose autograd saves its inputs
(views of the mixer's ``in_proj`` output cost no new storage) and whose backward, another
custom op, recomputes the conv, the dt processing and every chunk quantity -- what a fused
kernel such as mamba_ssm's ``mamba_split_conv1d_scan_combined`` keeps. Nothing of size
``[L, ...]`` beyond the inputs survives the forward. ``torch.compile`` sees two opaque ops (fake
kernels registered), so the core adds no graph break and no host sync; selective
activation checkpointing sees one op.

Document structure comes as ``cu_docs`` ``[n+1]``: document boundaries on the row-major token
stream of all rows, every row start among them (``row_documents`` builds it from a packed
batch). Initial states (and conv histories) enter documents starting at ``init_at``; final
states are read after the tokens ``final_at`` (stream positions; -1 = none, zeros out).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridpar.models.attention.layout import cached
from hybridpar.models.mamba import ssd_chunked
from hybridpar.models.mamba.conv import conv_backward, conv_forward
from hybridpar.models.mamba.fused import choose_kernel
from hybridpar.models.mamba.fused_op import fused_conv_scan

_OPTIONAL_GRADS = 11  # dx, ddt, dA, dB, dC, dD, ddt_bias, dconv_weight, dconv_bias, dinit_states, dconv_history


def mamba_conv_scan(
    xBC: Tensor, dt: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, dt_bias: Tensor, A_log: Tensor, D: Tensor,
    *, head_dim: int, state_size: int, chunk_size: int, cu_docs: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")), init_at: Tensor | None = None, init_states: Tensor | None = None,
    conv_history: Tensor | None = None, final_at: Tensor | None = None, want_y: bool = True,
):
    """Conv (SiLU) + SSD scan for the heads in the inputs. ``xBC [B, L, H*P + 2*G*N]`` (pre-conv),
    ``dt [B, L, H]`` (raw), ``conv_weight [H*P + 2*G*N, K]``, ``dt_bias / A_log / D [H]``;
    ``init_states [m, H, P, N]`` and ``conv_history [m, K-1, H*P + 2*G*N]`` enter the documents
    starting at ``init_at [m]``. Returns ``y [B, L, H*P]`` or, with ``final_at``, ``(y, states)``
    (``y`` is empty when ``want_y`` is False). On CUDA with ``fla-core`` the same contract runs
    through FLA's fused scan (``fused_op.py``; ``fused.py`` says which kernel runs and why, once)."""
    batch, seqlen, width = xBC.shape
    heads = dt.shape[-1]
    d_inner = heads * head_dim
    groups = (width - d_inner) // (2 * state_size)
    x, B, C = xBC.split([d_inner, groups * state_size, groups * state_size], dim=-1)
    if cu_docs is None:
        cu_docs = row_documents(None, batch, seqlen, xBC.device)
    kernel = choose_kernel(xBC, cu_docs, init_at, final_at)[0]
    if kernel != "pure":  # CUDA + fla-core (fused.py): FLA's scan, or a test's stand-in for it
        return fused_conv_scan(xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, head_dim=head_dim,
                               state_size=state_size, cu_docs=cu_docs, dt_limit=dt_limit, init_at=init_at,
                               init_states=init_states, conv_history=conv_history, final_at=final_at, want_y=want_y,
                               scan=kernel, check_states=torch.compiler.is_compiling())  # eager: choose_kernel did
    y, final = torch.ops.hybridpar.ssd_chunk_scan(
        # A = -exp(A_log) in float32 or wider: FSDP's bf16 policy gathers A_log in bf16 (the decays stay float32)
        x.unflatten(-1, (heads, head_dim)), dt, -torch.exp(A_log.to(_compute_dtype(A_log))),
        B.unflatten(-1, (groups, state_size)),
        C.unflatten(-1, (groups, state_size)), D, dt_bias, conv_weight, conv_bias, cu_docs, init_at, init_states,
        conv_history, final_at, chunk_size, True, float(dt_limit[0]), float(dt_limit[1]), want_y,
    )
    y = y.flatten(-2) if want_y else y
    return y if final_at is None else (y, final)


def row_documents(cu_seqlens: Tensor | None, batch: int, seqlen: int, device) -> Tensor:
    """``cu_docs`` of ``batch`` rows of ``seqlen`` tokens that share the document boundaries
    ``cu_seqlens`` ``[n+1]`` (None: one document per row), on the row-major stream."""
    rows = torch.arange(batch, device=device, dtype=torch.int64) * seqlen
    if cu_seqlens is None:
        starts = rows
    else:
        starts = (cu_seqlens.to(device=device, dtype=torch.int64)[None, :-1] + rows[:, None]).flatten()
    return torch.cat([starts, starts.new_full((1,), batch * seqlen)])


def shared_row_documents(packed, batch: int, seqlen: int, device) -> Tensor:
    """``row_documents`` of ``packed.cu_seqlens_padded`` (None: one document per row), built once per
    batch and shared by every layer (``packed.cache``; unpacked shapes: a small process-wide cache).
    FLA's kernels cache the chunk indices they derive from ``cu_seqlens`` by its identity
    (``fla.utils.tensor_cache``), and building them reads sizes on the host (a device sync): with one
    tensor for every layer they are built once per step, not at every layer and call."""
    if packed is None:
        if torch.compiler.is_compiling():
            return row_documents(None, batch, seqlen, device)
        return _unpacked_row_documents(batch, seqlen, torch.device(device))
    return cached(packed.cache, ("row_documents", batch, seqlen, str(device)),
                  lambda: row_documents(packed.cu_seqlens_padded, batch, seqlen, device))


@functools.lru_cache(maxsize=8)
def _unpacked_row_documents(batch: int, seqlen: int, device: torch.device) -> Tensor:
    return row_documents(None, batch, seqlen, device)


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _clamps(dt_min: float, dt_max: float) -> bool:
    return (dt_min, dt_max) != (0.0, float("inf"))


def _process_dt(dt, dt_bias, softplus, dt_min, dt_max):
    """``(dt used by the scan, the softplus input, the clamp input)``."""
    z = dt if dt_bias is None else dt + dt_bias
    s = F.softplus(z) if softplus else z
    return (s.clamp(dt_min, dt_max) if _clamps(dt_min, dt_max) else s), z, s


def _conv_inputs(x, B, C):
    """``([x, B, C] flattened to [T, c], their widths c)``: the conv's channel blocks."""
    flats = [t.reshape(t.shape[0] * t.shape[1], -1) for t in (x, B, C)]
    return flats, [f.shape[1] for f in flats]


def _run_inputs(x, dt, A, B, C, D, dt_bias, conv_weight, conv_bias, cu_docs, init_at, conv_history, softplus, dt_min, dt_max):
    """The scan's inputs in the compute dtype: conv + SiLU applied, dt processed; also what the
    backward needs to differentiate those two steps."""
    dtype = _compute_dtype(x, dt, A, B, C)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    pre = None
    if conv_weight is not None:
        flats, widths = _conv_inputs(x, B, C)
        weights = cast(conv_weight).split(widths)
        biases = [None] * 3 if conv_bias is None else cast(conv_bias).split(widths)
        histories = [None] * 3 if conv_history is None else cast(conv_history).split(widths, dim=-1)
        pre = [conv_forward(cast(f), w, b, cu_docs, init_at, h) for f, w, b, h in zip(flats, weights, biases, histories)]
        x, B, C = (F.silu(p).view(t.shape) for p, t in zip(pre, (x, B, C)))
    dt_used, z, s = _process_dt(cast(dt), cast(dt_bias), softplus, dt_min, dt_max)
    return (cast(x), dt_used, cast(A), cast(B), cast(C), cast(D)), (pre, z, s, dtype)


@torch.library.custom_op("hybridpar::ssd_chunk_scan", mutates_args=())
def _ssd_chunk_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, dt_bias: Tensor | None,
    conv_weight: Tensor | None, conv_bias: Tensor | None, cu_docs: Tensor, init_at: Tensor | None,
    init_states: Tensor | None, conv_history: Tensor | None, final_at: Tensor | None, chunk_size: int,
    dt_softplus: bool, dt_min: float, dt_max: float, want_y: bool,
) -> tuple[Tensor, Tensor]:
    (xs, dts, As, Bs, Cs, Ds), (_, _, _, dtype) = _run_inputs(
        x, dt, A, B, C, D, dt_bias, conv_weight, conv_bias, cu_docs, init_at, conv_history, dt_softplus, dt_min, dt_max)
    layout = ssd_chunked.make_layout(x.shape[0], x.shape[1], min(chunk_size, x.shape[1]), cu_docs, init_at, final_at)
    init = None if init_states is None else init_states.to(dtype)
    y, final = ssd_chunked.forward(xs, dts, As, Bs, Cs, Ds, layout, init, want_y, final_at is not None)
    y = y.to(x.dtype) if want_y else x.new_empty(0)
    return y, (final if final is not None else x.new_empty(0, dtype=dtype))


@_ssd_chunk_scan.register_fake
def _(x, dt, A, B, C, D, dt_bias, conv_weight, conv_bias, cu_docs, init_at, init_states, conv_history, final_at,
      chunk_size, dt_softplus, dt_min, dt_max, want_y):
    dtype = _compute_dtype(x, dt, A, B, C)
    y = x.new_empty(x.shape) if want_y else x.new_empty(0)
    if final_at is None:
        return y, x.new_empty(0, dtype=dtype)
    return y, x.new_empty(final_at.shape[0], x.shape[2], x.shape[3], B.shape[3], dtype=dtype)


@torch.library.custom_op("hybridpar::ssd_chunk_scan_backward", mutates_args=())
def _ssd_chunk_scan_backward(
    grad_y: Tensor | None, grad_final: Tensor | None, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Tensor | None, dt_bias: Tensor | None, conv_weight: Tensor | None, conv_bias: Tensor | None, cu_docs: Tensor,
    init_at: Tensor | None, init_states: Tensor | None, conv_history: Tensor | None, final_at: Tensor | None,
    chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    (xs, dts, As, Bs, Cs, Ds), (pre, z, s, dtype) = _run_inputs(
        x, dt, A, B, C, D, dt_bias, conv_weight, conv_bias, cu_docs, init_at, conv_history, dt_softplus, dt_min, dt_max)
    layout = ssd_chunked.make_layout(x.shape[0], x.shape[1], min(chunk_size, x.shape[1]), cu_docs, init_at, final_at)
    init = None if init_states is None else init_states.to(dtype)
    gy = None if grad_y is None or grad_y.numel() == 0 else grad_y.to(dtype)
    gf = None if grad_final is None or grad_final.numel() == 0 else grad_final.to(dtype)
    dx, ddt, dA, dB, dC, dD, d_init = ssd_chunked.backward(xs, dts, As, Bs, Cs, Ds, layout, init, gy, gf)
    grads = dict(D=dD, init_states=d_init)
    if _clamps(dt_min, dt_max):
        ddt = ddt * ((s >= dt_min) & (s <= dt_max))
    if dt_softplus:
        ddt = torch.ops.aten.softplus_backward(ddt, z, 1.0, 20.0)
    grads["dt"] = ddt
    grads["dt_bias"] = None if dt_bias is None else ddt.sum((0, 1))
    if conv_weight is not None:
        flats, widths = _conv_inputs(x, B, C)
        weights = conv_weight.to(dtype).split(widths)
        histories = [None] * 3 if conv_history is None else conv_history.to(dtype).split(widths, dim=-1)
        parts = []
        for p, d_post, flat, w, h in zip(pre, (dx, dB, dC), flats, weights, histories):
            sig = torch.sigmoid(p)
            d_pre = d_post.reshape(p.shape) * sig * (1 + p * (1 - sig))  # SiLU'
            parts.append(conv_backward(flat.to(dtype), w, conv_bias is not None, cu_docs, init_at, h, d_pre))
        dx, dB, dC = (part[0].view(t.shape) for part, t in zip(parts, (x, B, C)))
        grads["conv_weight"] = torch.cat([part[1] for part in parts])
        grads["conv_bias"] = None if conv_bias is None else torch.cat([part[2] for part in parts])
        grads["conv_history"] = None if conv_history is None else torch.cat([part[3] for part in parts], dim=-1)
    grads.update(x=dx, A=dA, B=dB, C=dC)
    inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, conv_weight=conv_weight, conv_bias=conv_bias,
                  init_states=init_states, conv_history=conv_history)
    return tuple(_as_grad(grads.get(name), tensor, x) for name, tensor in inputs.items())


def _as_grad(grad: Tensor | None, like: Tensor | None, anchor: Tensor) -> Tensor:
    """The gradient in the input's dtype (zeros if nothing depends on it), or an empty tensor on
    ``anchor``'s device for an absent input (the fake kernel's, so compiled graphs agree)."""
    if like is None:
        return anchor.new_empty(0)
    return torch.zeros_like(like) if grad is None else grad.to(like.dtype)


@_ssd_chunk_scan_backward.register_fake
def _(grad_y, grad_final, x, dt, A, B, C, D, dt_bias, conv_weight, conv_bias, cu_docs, init_at, init_states,
      conv_history, final_at, chunk_size, dt_softplus, dt_min, dt_max):
    like = (x, dt, A, B, C, D, dt_bias, conv_weight, conv_bias, init_states, conv_history)
    return tuple(x.new_empty(0) if t is None else torch.empty_like(t) for t in like)


def _setup_context(ctx, inputs, output):
    *tensors, chunk_size, dt_softplus, dt_min, dt_max, want_y = inputs
    ctx.save_for_backward(*tensors)
    ctx.options = (chunk_size, dt_softplus, dt_min, dt_max)
    ctx.want_y = want_y


def _backward(ctx, grad_y, grad_final):
    saved = ctx.saved_tensors  # the op's tensor arguments, in order
    x, dt, A, B, C, D, dt_bias, conv_weight, conv_bias, cu_docs, init_at, init_states, conv_history, final_at = saved
    grads = torch.ops.hybridpar.ssd_chunk_scan_backward(
        grad_y if ctx.want_y else None, grad_final if final_at is not None else None, *saved, *ctx.options)
    differentiable = (x, dt, A, B, C, D, dt_bias, conv_weight, conv_bias, init_states, conv_history)
    dx, ddt, dA, dB, dC, dD, ddt_bias, dweight, dbias, dinit, dhistory = (
        None if t is None else g for g, t in zip(grads, differentiable))
    return dx, ddt, dA, dB, dC, dD, ddt_bias, dweight, dbias, None, None, dinit, dhistory, None, None, None, None, None, None


_ssd_chunk_scan.register_autograd(_backward, setup_context=_setup_context)
