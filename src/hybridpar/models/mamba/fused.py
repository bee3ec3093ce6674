"""Fused Mamba2 scan on CUDA behind ``mamba_conv_scan``'s signature (FLA's ``chunk_simple_gla``).

Mamba2's SSD with a scalar decay per head is FLA's simple GLA. Per document and head, with
``x`` the conv output (after SiLU), ``dt`` processed (``softplus(dt + dt_bias)``, clamped) and
``A = -exp(A_log)``::

    h_t = exp(dt_t A) h_{t-1} + (dt_t x_t) B_t^T          y_t = h_t C_t + D x_t

    chunk_simple_gla(q = C, k = B, v = x * dt, g = dt * A, scale = 1,
                     initial_state, output_final_state, cu_seqlens, state_v_first=True)

with ``B``/``C`` repeated from groups to heads (``k``/``q [1, T, H, N]``), ``v [1, T, H, P]``,
``g [1, T, H]`` in float32 (the decays stay fp32; FLA's kernels accumulate states in fp32),
every row laid end to end on one stream whose documents are ``cu_docs`` (``cu_seqlens``), and
states ``[docs, H, P, N]`` (``state_v_first``: our layout). ``D x`` is added outside. Initial
states enter the documents that start at ``init_at``; final states are read at document ends.

The conv is ours (``conv.py``, document resets and conv histories as in the pure core), run by
autograd. The whole fused core runs under ``torch.utils.checkpoint``: like the pure op it
saves only its inputs and recomputes conv, dt and scan in the backward, so the saved-bytes
budget of a block does not change with the kernel.

Under ``torch.compile`` the fused core runs eagerly (``torch.compiler.disable``: FLA's launchers
sync with the host and autotune), one graph break per call; registering it as a custom op
needs an explicit backward (docs/gpu.md).

``choose_kernel`` says which core runs and why (logged once per kernel and reason): ``fla``
on CUDA for float32/bf16/fp16 when ``fla-core`` imports (``pip install 'hybridpar[gpu]'``),
initial states only at document starts and final states only at document ends; otherwise
the pure-PyTorch op (``core.py``). ``use_mamba_kernel("pure" | "fla" | "auto")`` forces a choice
(benchmarks compare both in one process); ``"fla"`` where it cannot run is a ``ValueError``.
mamba_ssm's ``mamba_chunk_scan_combined`` is not wired: its package imports compiled CUDA
extensions that a machine without a build toolchain and network (our GPU runs) cannot build.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from hybridpar.models.mamba.conv import conv_forward

__all__ = ["MODES", "choose_kernel", "kernel_for", "fla_scan", "fused_conv_scan", "use_mamba_kernel", "mamba_kernel_mode"]

logger = logging.getLogger(__name__)

MODES = ("auto", "pure", "fla")
_mode = "auto"
_LOGGED: set[tuple[str, str]] = set()


def mamba_kernel_mode() -> str:
    return _mode


@contextlib.contextmanager
def use_mamba_kernel(mode: str):
    """Within the block, ``mamba_conv_scan`` runs ``mode``: ``auto`` (the rules above), ``pure`` or ``fla``."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"Mamba kernel mode {mode!r} is unknown; choose one of {list(MODES)}.")
    previous, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = previous


@functools.cache
def fla_scan():
    """``(chunk_simple_gla or None, why not)``: FLA's op if ``fla-core`` imports here."""
    try:
        import fla
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as error:  # ImportError, or triton failing to find a driver
        return None, f"fla-core does not import ({type(error).__name__}: {str(error)[:80]}); pip install 'hybridpar[gpu]'"
    return chunk_simple_gla, f"fla-core {getattr(fla, '__version__', '?')} chunk_simple_gla"


def kernel_for(device_type: str, dtype: torch.dtype, fla_available: bool, fla_note: str = "",
               mode: str = "auto") -> tuple[str, str]:
    """``(kernel, reason)`` from the inputs' device and dtype (no tensor is read)."""
    if mode == "pure":
        return "pure", "use_mamba_kernel('pure')"
    if device_type != "cuda":
        return "pure", f"device {device_type}"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "pure", f"dtype {dtype} has no fused kernel"
    if not fla_available:
        return "pure", fla_note or "fla-core is not installed; pip install 'hybridpar[gpu]'"
    return "fla", fla_note or "fla-core chunk_simple_gla"


def _states_at_boundaries(cu_docs: Tensor, init_at: Tensor | None, final_at: Tensor | None) -> str | None:
    """Why FLA cannot take these states (None: it can). Reads tensors: a host sync, paid only on
    the CUDA paths that pass states (CP ``state`` strategy, generation)."""
    if final_at is not None and (final_at.shape[0] != cu_docs.shape[0] - 1 or not torch.equal(
            final_at.long(), cu_docs[1:].long() - 1)):
        return "final states requested inside documents"
    if init_at is not None:
        valid = init_at[init_at >= 0].long()
        if not bool(torch.isin(valid, cu_docs[:-1].long()).all()):
            return "initial states entering inside documents"
    return None


def choose_kernel(xBC: Tensor, cu_docs: Tensor, init_at: Tensor | None, final_at: Tensor | None) -> tuple[str, str]:
    """``(kernel, reason)`` for these inputs, logged once per kernel and reason."""
    fla_op, note = fla_scan() if xBC.device.type == "cuda" and _mode != "pure" else (None, "")
    kernel, reason = kernel_for(xBC.device.type, xBC.dtype, fla_op is not None, note, _mode)
    if kernel == "fla":
        problem = _states_at_boundaries(cu_docs, init_at, final_at)
        if problem:
            kernel, reason = "pure", problem
    if _mode == "fla" and kernel != "fla":
        raise ValueError(f"use_mamba_kernel('fla') cannot run here: {reason}; use 'auto' to fall back to the "
                         "pure-PyTorch core.")
    if (kernel, reason) not in _LOGGED and not torch.compiler.is_compiling():
        _LOGGED.add((kernel, reason))
        logger.info("mamba kernel: %s (%s; %s on %s)", kernel, reason, xBC.dtype, xBC.device)
    return kernel, reason


def _fused_math(xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, init_states, conv_history, cu_docs, init_at,
                final_at, head_dim, state_size, dt_limit, scan):
    """``(y [B, L, H*P], final states [n_docs, H, P, N] or None)``; see the module docstring."""
    batch, seqlen, width = xBC.shape
    heads = dt.shape[-1]
    d_inner = heads * head_dim
    groups = (width - d_inner) // (2 * state_size)
    total = batch * seqlen
    fp = torch.promote_types(xBC.dtype, torch.float32)  # decays, dt and the D skip: fp32 or wider
    pre = conv_forward(xBC.reshape(total, width), conv_weight, conv_bias, cu_docs, init_at, conv_history)
    post = F.silu(pre).to(xBC.dtype)  # q, k, v in the activations' dtype (bf16 under autocast)
    x, B, C = post.split([d_inner, groups * state_size, groups * state_size], dim=-1)  # [T, .]
    dt_used = F.softplus(dt.reshape(total, heads).to(fp) + dt_bias.to(fp))  # [T, H]
    if tuple(dt_limit) != (0.0, float("inf")):
        dt_used = dt_used.clamp(dt_limit[0], dt_limit[1])
    x = x.view(1, total, heads, head_dim)
    per_head = heads // groups
    k = B.view(1, total, groups, 1, state_size).expand(-1, -1, -1, per_head, -1).reshape(1, total, heads, state_size)
    q = C.view(1, total, groups, 1, state_size).expand(-1, -1, -1, per_head, -1).reshape(1, total, heads, state_size)
    v = (x.to(fp) * dt_used[None, :, :, None]).to(x.dtype)
    g = (dt_used * -torch.exp(A_log.to(fp)))[None]  # [1, T, H] log decays
    documents = cu_docs.shape[0] - 1
    initial = None
    if init_states is not None:
        at = init_at.long()
        doc = torch.where(at >= 0, torch.searchsorted(cu_docs.long(), at, right=True) - 1, documents)  # -1: dropped
        slots = init_states.new_zeros(documents + 1, *init_states.shape[1:], dtype=fp)
        initial = slots.index_copy(0, doc, init_states.to(fp))[:documents]  # [n_docs, H, P, N]
    o, final = scan(q, k, v, g, scale=1.0, initial_state=initial, output_final_state=final_at is not None,
                    cu_seqlens=cu_docs.long(), state_v_first=True)
    y = o.to(fp) + D.to(fp)[:, None] * x.to(fp)  # [1, T, H, P]
    return y.reshape(batch, seqlen, d_inner).to(xBC.dtype), final


def _fused_conv_scan(xBC: Tensor, dt: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, dt_bias: Tensor,
                    A_log: Tensor, D: Tensor, *, head_dim: int, state_size: int, cu_docs: Tensor,
                    dt_limit=(0.0, float("inf")), init_at: Tensor | None = None, init_states: Tensor | None = None,
                    conv_history: Tensor | None = None, final_at: Tensor | None = None, want_y: bool = True,
                    scan=None):
    """``mamba_conv_scan``'s contract through ``scan`` (default: FLA's ``chunk_simple_gla``),
    checkpointed: only the inputs are saved for backward."""
    scan = scan if scan is not None else fla_scan()[0]
    y, final = checkpoint(_fused_math, xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, init_states, conv_history,
                          cu_docs, init_at, final_at, head_dim, state_size, tuple(dt_limit), scan, use_reentrant=False)
    y = y if want_y else y.new_empty(0)
    return y if final_at is None else (y, final)


@functools.cache
def _eager_only():
    """``_fused_conv_scan`` with torch.compile kept out (FLA's Python launchers sync and autotune: one
    graph break per call). Built on first use: ``torch.compiler.disable`` imports torch._dynamo, which
    ``hybridpar plan`` and every CPU run never need."""
    return torch.compiler.disable(_fused_conv_scan)


def fused_conv_scan(*args, **kwargs):
    """``mamba_conv_scan``'s contract through FLA's ``chunk_simple_gla`` (see ``_fused_conv_scan``), eager."""
    return _eager_only()(*args, **kwargs)

