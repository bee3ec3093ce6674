"""Mamba2's conv + scan through FLA's ``causal_conv1d`` and ``chunk_simple_gla``, as two registered custom ops.

Mamba2's SSD with a scalar decay per head is FLA's simple GLA. Per document and head, with
``x`` the conv output (after SiLU), ``dt`` processed (``softplus(dt + dt_bias)``, clamped) and
``A = -exp(A_log)``::

    h_t = exp(dt_t A) h_{t-1} + (dt_t x_t) B_t^T          y_t = h_t C_t + D x_t

    chunk_simple_gla(q = C, k = B, v = x * dt, g = dt * A, scale = 1,
                     initial_state, output_final_state, cu_seqlens, state_v_first=True)

with ``B``/``C`` repeated from groups to heads (``k``/``q [1, T, H, N]``), ``v [1, T, H, P]``,
``g [1, T, H]`` in float32 (the decays stay fp32; FLA's kernels accumulate states in fp32) and
floored where ``exp(g)`` is 0 in float32 (``recurrence.underflow_log``, -104.3: no value changes),
every row laid end to end on one stream whose documents are ``cu_docs`` (``cu_seqlens``), and
states ``[docs, H, P, N]`` (``state_v_first``: our layout). ``D x`` is added outside. Initial
states enter the documents that start at ``init_at``; final states are read at document ends.
The conv + SiLU is FLA's ``causal_conv1d`` (documents as ``cu_seqlens``, conv histories as its
initial states); with a stand-in scan, the conv registered with it or ours (``conv.py``). Both
accumulate in float32; ``q``, ``k``, ``v`` are in the activations' dtype (bf16 under mixed precision).

Why the floor: FLA's kernels take ``exp`` of differences of float32 within-chunk cumsums of ``g``; after
one saturated step (``dt A`` ~ -7e6) each later step of the chunk is lost in the cumsum's rounding (FLA's
kernels under triton's interpreter: ``y`` 1.5e-2 and ``d A_log`` 2.9 relative off float64; floored, 1e-5).

``hybridpar::fused_conv_scan`` runs that math without autograd and saves only its inputs;
``hybridpar::fused_conv_scan_backward`` recomputes it up to the scan's inputs and differentiates it:
the scan through FLA's own backward kernels alone (``fla_backward.py``: no scan forward runs; a
stand-in registered without a backward, or an fla-core whose internals differ, differentiates the
scan's forward instead), the elementwise steps around it (``v = x dt``, the ``D x`` skip, the repeat
of B/C to heads) written out (``fused_glue.py``: each product computed wide and rounded once, no wide
copies), the conv and the small ``[T, H]`` steps through autograd. A block's saved bytes do not
depend on the kernel.
``torch.compile`` sees two opaque ops with fake kernels: no graph break, and FLA's launchers
(host syncs, autotuning) stay out of the trace.

A custom op's implementation runs below the Autograd dispatch keys, so ops there record no
graph even under ``enable_grad``; ``autograd_on`` lifts that exclusion for the recompute
(``torch._C._ForceDispatchKeyGuard``, the thread's dispatch-key state with autograd put back;
``tests/models/mamba/test_fused.py`` fails if a torch release changes this).

The scan is named: ``"fla"`` is FLA's kernel (imported on first use); tests register stand-ins
(``register_scan``) such as FLA's contract written out in float64 on CPU, with a backward in FLA's
calling convention or without one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridpar.models.mamba.conv import conv_forward
from hybridpar.models.mamba.fla_backward import simple_gla_backward
from hybridpar.models.mamba.fused_glue import add_skip, scan_gradients, scan_values
from hybridpar.models.mamba.recurrence import underflow_log
from hybridpar.models.precision import autocast_off

__all__ = ["fla_scan", "fla_status", "fla_gated_backward_refusal", "gated_backward_refusal", "import_fla",
           "register_scan", "fused_conv_scan", "states_at_boundaries", "autograd_on"]

_SCANS: dict[str, tuple[Callable, Callable | None, Callable | None]] = {}
_FLA: tuple[Callable | None, str] | None = None
_UNSET = object()
_BACKWARD_REFUSAL: object = _UNSET
FIXED_TRITON = (3, 7, 1)


def fla_scan() -> tuple[Callable | None, str]:
    """``(chunk_simple_gla or None, why not)``: FLA's op if ``fla-core`` imports here, resolved once."""
    global _FLA
    if _FLA is None:
        _FLA = _import_fla()
    return _FLA


def fla_status() -> tuple[bool, str]:
    """``(FLA's kernels import here, why or why not)``: plain values, which ``torch.compile`` reads as
    constants from the global ``fla_scan`` filled (``apply_compile`` resolves it before tracing)."""
    op, note = fla_scan()
    return op is not None, note


def _import_fla() -> tuple[Callable | None, str]:
    return import_fla("fla.ops.simple_gla", "chunk_simple_gla", "chunk_simple_gla + causal_conv1d")


def gated_backward_refusal(hopper: bool, triton_version: str, tilelang: bool) -> str | None:
    """Why fla-core refuses the backward of its gated chunk kernels (``chunk_bwd_dqkwg`` with ``g``:
    simple GLA, so Mamba2, and the gated delta rule) on this machine, or None. FLA raises on Hopper
    with triton >= 3.4 and < 3.7.1 (wrong results there, FLA issue #640) unless its TileLang backend
    takes that kernel; seen on an H200 with triton 3.6 (docs/gpu.md). Forward-only use is unaffected."""
    release = tuple(int(part) for part in triton_version.split("+")[0].split(".")[:3] if part.isdigit())
    if hopper and (3, 4) <= release < FIXED_TRITON and not tilelang:
        return (f"fla-core refuses its gated backward on Hopper with triton {triton_version} (FLA #640); "
                "pip install 'triton>=3.7.1' or tilelang for the fused kernels")
    return None


def fla_gated_backward_refusal() -> str | None:
    """``gated_backward_refusal`` for this machine, resolved once (None where FLA does not import)."""
    global _BACKWARD_REFUSAL
    if _BACKWARD_REFUSAL is _UNSET:
        _BACKWARD_REFUSAL = None
        if fla_scan()[0] is not None and torch.cuda.is_available():
            import triton
            from fla.backends import TileLangBackend

            hopper = torch.cuda.get_device_capability()[0] == 9
            _BACKWARD_REFUSAL = gated_backward_refusal(hopper, triton.__version__, TileLangBackend.is_available())
    return _BACKWARD_REFUSAL


def import_fla(module: str, name: str, label: str) -> tuple[Callable | None, str]:
    """``(fla-core's op module.name or None, why not / "fla-core <version> <label>")``."""
    try:
        import importlib

        import fla

        op = getattr(importlib.import_module(module), name)
    except Exception as error:  # ImportError, or triton failing to find a driver
        return None, f"fla-core does not import ({type(error).__name__}: {str(error)[:80]}); pip install 'hybridpar[gpu]'"
    return op, f"fla-core {getattr(fla, '__version__', '?')} {label}"


def register_scan(name: str, scan: Callable, conv: Callable | None = None, backward: Callable | None = None) -> None:
    """Make ``scan`` (``chunk_simple_gla``'s signature) runnable as ``fused_conv_scan(..., scan=name)``,
    with ``conv`` (``causal_conv1d``'s) or, by default, ours; ``backward`` (``fla_backward.simple_gla_backward``'s
    signature) gives the scan's gradients without its forward, or, by default, autograd of the forward."""
    if name == "fla":
        raise ValueError("the scan name 'fla' is FLA's kernel; register a stand-in under another name.")
    _SCANS[name] = (scan, conv, backward)


def _kernels(name: str) -> tuple[Callable, Callable | None]:
    """``(scan, conv)``: FLA's ``chunk_simple_gla`` and ``causal_conv1d`` for ``"fla"``; a registered
    stand-in scan with its conv (None: ours) otherwise."""
    if name == "fla":
        op, why = fla_scan()
        if op is None:
            raise ValueError(f"the fused Mamba scan 'fla' cannot run: {why}.")
        from fla.modules.causal_conv1d import causal_conv1d

        return op, causal_conv1d
    if name not in _SCANS:
        raise ValueError(f"fused Mamba scan {name!r} is not registered; known: {['fla', *_SCANS]}.")
    return _SCANS[name][:2]


def states_at_boundaries(cu_docs: Tensor, init_at: Tensor | None, final_at: Tensor | None) -> str | None:
    """Why FLA cannot take these states (None: it can): it starts and ends states only at documents'
    edges. Reads tensors (a host sync)."""
    if final_at is not None and (final_at.shape[0] != cu_docs.shape[0] - 1 or not torch.equal(
            final_at.long(), cu_docs[1:].long() - 1)):
        return "final states requested inside documents"
    if init_at is not None:
        valid = init_at[init_at >= 0].long()
        if not bool(torch.isin(valid, cu_docs[:-1].long()).all()):
            return "initial states entering inside documents"
    return None


def _per_document(values: Tensor, init_at: Tensor, cu_docs: Tensor, dtype) -> Tensor:
    """``values [m, ...]`` entering the documents that start at ``init_at [m]`` (-1: none) as one
    slot per document ``[n_docs, ...]``, zeros where nothing enters."""
    documents = cu_docs.shape[0] - 1
    at = init_at.long()
    doc = torch.where(at >= 0, torch.searchsorted(cu_docs.long(), at, right=True) - 1, documents)  # -1: dropped
    slots = values.new_zeros(documents + 1, *values.shape[1:], dtype=dtype)
    return slots.index_copy(0, doc, values.to(dtype))[:documents]


def _conv_silu(xBC, conv_weight, conv_bias, conv_history, cu_docs, init_at, fp, fla_conv) -> Tensor:
    """``silu(conv(xBC))`` ``[T, C]`` in xBC's dtype: FLA's ``causal_conv1d`` (with FLA's scan; its
    initial state ``[n_docs, C, K]`` holds the ``K-1`` earlier inputs in its last columns, oldest
    first) or ours (``conv.py``), both accumulating in float32 or wider."""
    total, width = xBC.shape[0] * xBC.shape[1], xBC.shape[2]
    if fla_conv is None:
        cast = lambda t: None if t is None else t.to(fp)  # noqa: E731
        pre = conv_forward(cast(xBC.reshape(total, width)), cast(conv_weight), cast(conv_bias), cu_docs, init_at,
                           cast(conv_history))
        return F.silu(pre).to(xBC.dtype)
    initial = None
    if conv_history is not None:
        initial = _per_document(F.pad(conv_history.transpose(1, 2), (1, 0)), init_at, cu_docs, conv_history.dtype)
    out, _ = fla_conv(xBC.reshape(1, total, width), conv_weight, conv_bias, initial_state=initial, activation="silu",
                      cu_seqlens=cu_docs.long())
    return out.squeeze(0).to(xBC.dtype)  # a view: its backward is one too (``out[0]`` scattered into zeros)


def _glue(xBC, dt, conv_weight, conv_bias, dt_bias, A_log, init_states, conv_history, cu_docs, init_at, dt_min,
          dt_max, fla_conv):
    """What feeds the scan besides its q, k, v: ``(post [T, C] = silu(conv(xBC)) in xBC's dtype, dt_used
    [T, H] and g [1, T, H] log decays in fp32 or wider, initial states [n_docs, H, P, N] or None)``,
    recorded by autograd where it is on (the backward differentiates these through autograd)."""
    total, heads = xBC.shape[0] * xBC.shape[1], dt.shape[-1]
    fp = torch.promote_types(xBC.dtype, torch.float32)  # decays, dt and the D skip: fp32 or wider
    cast = lambda t: None if t is None else t.to(fp)  # noqa: E731
    post = _conv_silu(xBC, conv_weight, conv_bias, conv_history, cu_docs, init_at, fp, fla_conv)  # q, k, v dtype
    dt_used = F.softplus(cast(dt.reshape(total, heads)) + cast(dt_bias))  # [T, H]
    if (dt_min, dt_max) != (0.0, float("inf")):
        dt_used = dt_used.clamp(dt_min, dt_max)
    g = (dt_used * -torch.exp(cast(A_log))).clamp_min(underflow_log(fp))[None]  # [1, T, H]; see the module docstring
    initial = None if init_states is None else _per_document(init_states, init_at, cu_docs, fp)  # [n_docs, H, P, N]
    return post, dt_used, g, initial


def _widths(post: Tensor, heads: int, head_dim: int, state_size: int) -> list[int]:
    """Widths of x, B and C in the conv output's channels."""
    d_inner = heads * head_dim
    groups = (post.shape[-1] - d_inner) // (2 * state_size)
    return [d_inner, groups * state_size, groups * state_size]


def _split(post: Tensor, heads: int, head_dim: int, state_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(x [1, T, H, P], q [1, T, H, N], k [1, T, H, N])``: x a view of ``post``, q = C and k = B repeated
    from groups to heads (copies: the scan takes one head count)."""
    total = post.shape[0]
    x, B, C = post.split(_widths(post, heads, head_dim, state_size), dim=-1)
    groups = B.shape[-1] // state_size
    repeat = lambda t: (t.view(1, total, groups, 1, state_size).expand(-1, -1, -1, heads // groups, -1)  # noqa: E731
                        .reshape(1, total, heads, state_size))
    return x.view(1, total, heads, head_dim), repeat(C), repeat(B)


def _run_scan(scan, q, k, v, g, initial, want_final: bool, cu_docs):
    """``(o [1, T, H, P] in v's dtype, final states [n_docs, H, P, N] or None)``."""
    return scan(q, k, v, g, scale=1.0, initial_state=initial, output_final_state=want_final,
                cu_seqlens=cu_docs.long(), state_v_first=True)


def _scan_grads(name: str, q, k, v, g, initial, want_final: bool, dy, d_final, cu_docs):
    """``(dq, dk [1, T, H, N], dv [1, T, H, P], dg [1, T, H], d initial [n_docs, H, P, N] or None)`` of the
    scan seeded with ``dy [1, T, H, P]`` and ``d_final [n_docs, H, P, N]`` (None: none reaches it). Where
    the scan has a backward of its own (``fla_backward.py``) only that runs, given autograd's seeds (zeros
    for an output without a gradient, none for final states not asked for); else autograd of its forward."""
    direct = simple_gla_backward() if name == "fla" else _SCANS[name][2]
    if dy is None and d_final is None:
        return (*(torch.zeros_like(t) for t in (q, k, v, g)), None)
    if direct is not None:
        do, dht = (dy if dy is not None else torch.zeros_like(v)), d_final
        if dht is None and want_final:  # [n_docs, H, P, N]
            dht = g.new_zeros(cu_docs.shape[0] - 1, v.shape[2], v.shape[3], q.shape[3])
        with torch.no_grad():
            return direct(q, k, v, g, do, dht, scale=1.0, initial_state=initial, cu_seqlens=cu_docs.long(),
                          state_v_first=True)
    scan_in = [t.requires_grad_() for t in (q, k, v, g, initial) if t is not None]
    o, final = _run_scan(_kernels(name)[0], *scan_in[:4], initial if initial is None else scan_in[4], want_final,
                         cu_docs)
    final = None if final is None else final.to(g.dtype)  # the forward's dtype (fp32 or wider), as d_final
    seeds = [(out, grad) for out, grad in ((o, dy), (final, d_final)) if grad is not None]
    d_scan = torch.autograd.grad([out for out, _ in seeds], scan_in, [grad for _, grad in seeds], allow_unused=True)
    return (*(torch.zeros_like(t) if d is None else d for d, t in zip(d_scan[:4], scan_in)),
            d_scan[4] if initial is not None else None)


@contextlib.contextmanager
def autograd_on():
    """Autograd records inside a custom op's implementation (see the module docstring)."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor, keys.ADInplaceOrView):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def _check_states(cu_docs, init_at, final_at):
    problem = states_at_boundaries(cu_docs, init_at, final_at)
    if problem:
        raise ValueError(f"the fused Mamba scan cannot take these states: {problem}; run this call with "
                         "use_mamba_kernel('pure').")


@torch.library.custom_op("hybridpar::fused_conv_scan", mutates_args=())
def _fused_op(
    xBC: Tensor, dt: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, dt_bias: Tensor, A_log: Tensor, D: Tensor,
    init_states: Tensor | None, conv_history: Tensor | None, cu_docs: Tensor, init_at: Tensor | None,
    final_at: Tensor | None, head_dim: int, state_size: int, dt_min: float, dt_max: float, want_y: bool,
    check_states: bool, scan: str,
) -> tuple[Tensor, Tensor]:
    if check_states:  # a host sync: skipped where choose_kernel has checked these states (eager)
        _check_states(cu_docs, init_at, final_at)
    with torch.no_grad(), autocast_off():
        scan_kernel, fla_conv = _kernels(scan)
        post, dt_used, g, initial = _glue(xBC, dt, conv_weight, conv_bias, dt_bias, A_log, init_states, conv_history,
                                          cu_docs, init_at, dt_min, dt_max, fla_conv)
        x, q, k = _split(post, dt.shape[-1], head_dim, state_size)
        o, final = _run_scan(scan_kernel, q, k, scan_values(x, dt_used), g, initial, final_at is not None, cu_docs)
        y = add_skip(o, x, D).reshape(xBC.shape[0], xBC.shape[1], -1) if want_y else xBC.new_empty(0)
    fp = torch.promote_types(xBC.dtype, torch.float32)
    return y, (final.to(fp) if final is not None else xBC.new_empty(0, dtype=fp))


@_fused_op.register_fake
def _(xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, init_states, conv_history, cu_docs, init_at, final_at,
      head_dim, state_size, dt_min, dt_max, want_y, check_states, scan):
    fp = torch.promote_types(xBC.dtype, torch.float32)
    heads = dt.shape[-1]
    y = xBC.new_empty(*xBC.shape[:2], heads * head_dim) if want_y else xBC.new_empty(0)
    if final_at is None:
        return y, xBC.new_empty(0, dtype=fp)
    return y, xBC.new_empty(final_at.shape[0], heads, head_dim, state_size, dtype=fp)


_DIFFERENTIABLE = 9  # xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, init_states, conv_history
_D = 6  # D's place among them


@torch.library.custom_op("hybridpar::fused_conv_scan_backward", mutates_args=())
def _fused_backward_op(
    grad_y: Tensor | None, grad_final: Tensor | None, xBC: Tensor, dt: Tensor, conv_weight: Tensor,
    conv_bias: Tensor | None, dt_bias: Tensor, A_log: Tensor, D: Tensor, init_states: Tensor | None,
    conv_history: Tensor | None, cu_docs: Tensor, init_at: Tensor | None, final_at: Tensor | None, head_dim: int,
    state_size: int, dt_min: float, dt_max: float, scan: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of ``fused_conv_scan``: the scan's through its kernel's own backward (``_scan_grads``),
    the elementwise steps around it written out (``fused_glue.py``), the conv's and the small ``[T, H]``
    steps' through autograd. Recomputes the forward up to the scan's inputs; nothing of the forward was kept."""
    inputs = (xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, init_states, conv_history)
    heads = dt.shape[-1]
    with autograd_on(), autocast_off():
        scanned = inputs[:_D] + inputs[_D + 1:]  # every input but D, whose gradient is written out
        leaves = [None if t is None else t.detach().requires_grad_() for t in scanned]
        post, dt_used, g, initial = _glue(*leaves, cu_docs, init_at, dt_min, dt_max, _kernels(scan)[1])
        x, q, k = _split(post.detach(), heads, head_dim, state_size)
        want_final = final_at is not None
        dy = grad_y.reshape(x.shape) if grad_y is not None and grad_y.numel() else None
        d_final = grad_final if want_final and grad_final is not None and grad_final.numel() else None
        dq, dk, dv, dg, d_initial = _scan_grads(scan, q, k, scan_values(x, dt_used.detach()), g.detach(),
                                                None if initial is None else initial.detach(), want_final, dy,
                                                d_final, cu_docs)
        widths = _widths(post, heads, head_dim, state_size)
        with torch.no_grad():  # [T, C]: x's, B's and C's gradients in their columns; d dt [T, H]; dD [H]
            d_post, d_dt, grad_D_ = scan_gradients(dv, dy, x, dt_used.detach(), D.detach(), dq, dk, widths,
                                                   widths[1] // state_size)
        roots = [(post, d_post), (dt_used, d_dt), (g, dg)]
        if initial is not None and d_initial is not None:
            roots.append((initial, d_initial))
        wanted = [leaf for leaf in leaves if leaf is not None]
        found = iter(torch.autograd.grad([t for t, _ in roots], wanted, [d for _, d in roots], allow_unused=True))
    grads = [None if leaf is None else next(found) for leaf in leaves]
    grads.insert(_D, grad_D_)
    return tuple(xBC.new_empty(0) if t is None else (torch.zeros_like(t) if grad is None else grad)
                 for grad, t in zip(grads, inputs))


@_fused_backward_op.register_fake
def _(grad_y, grad_final, xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, init_states, conv_history, cu_docs,
      init_at, final_at, head_dim, state_size, dt_min, dt_max, scan):
    like = (xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, init_states, conv_history)
    return tuple(xBC.new_empty(0) if t is None else torch.empty_like(t) for t in like)


def _setup_context(ctx, inputs, output):
    *tensors, head_dim, state_size, dt_min, dt_max, want_y, _, scan = inputs
    ctx.save_for_backward(*tensors)
    ctx.options = (head_dim, state_size, dt_min, dt_max, scan)
    ctx.want_y = want_y


def _backward(ctx, grad_y, grad_final):
    saved = ctx.saved_tensors  # the op's tensor arguments, in order
    final_at = saved[-1]
    grads = torch.ops.hybridpar.fused_conv_scan_backward(
        grad_y if ctx.want_y else None, grad_final if final_at is not None else None, *saved, *ctx.options)
    grads = [None if t is None else g for g, t in zip(grads, saved[:_DIFFERENTIABLE])]
    return (*grads, *[None] * 10)  # cu_docs, init_at, final_at and the 7 options


_fused_op.register_autograd(_backward, setup_context=_setup_context)


def fused_conv_scan(xBC: Tensor, dt: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, dt_bias: Tensor,
                    A_log: Tensor, D: Tensor, *, head_dim: int, state_size: int, cu_docs: Tensor,
                    dt_limit=(0.0, float("inf")), init_at: Tensor | None = None, init_states: Tensor | None = None,
                    conv_history: Tensor | None = None, final_at: Tensor | None = None, want_y: bool = True,
                    scan: str = "fla", check_states: bool = True):
    """``mamba_conv_scan``'s contract through the named scan (default: FLA's ``chunk_simple_gla``).
    ``check_states=False``: the caller has checked that states sit on document boundaries."""
    y, final = torch.ops.hybridpar.fused_conv_scan(
        xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, init_states, conv_history, cu_docs, init_at, final_at,
        head_dim, state_size, float(dt_limit[0]), float(dt_limit[1]), want_y, check_states, scan)
    return y if final_at is None else (y, final)
