"""hybridpar's document-resetting selective scan inside transformers' Mamba1 mixers (Jamba,
FalconMamba, Mamba), recognised by structure, never by class name.

A transformers module is a *Mamba1 mixer* when it has ``in_proj`` (``[x | gate]``, ``2 Cd`` wide),
a depthwise causal ``conv1d`` over ``Cd`` channels, ``x_proj`` (``[dt | B | C]``, ``R + 2N``),
``dt_proj`` (``R -> Cd``), a 2-D ``A_log [Cd, N]`` and ``D [Cd]``. ``install_mamba1_core(model)``
gives each one a training forward that is transformers' own, step for step, with the two token
mixers reset at document boundaries::

    [x | gate] = in_proj(u)                                   [R, T, Cd] each
    x = act(conv1d(x))            the causal conv reads only its own document's tokens
    [dt | B | C] = x_proj(x);  dt, B, C = their norms (Jamba: RMSNorms; FalconMamba: weightless)
    dt = softplus(dt_proj(dt));  A = -exp(A_log)
    y = selective_scan(x, dt, A, B, C) + D x                  models/linear/selective_scan.py
    out = out_proj(y * silu(gate))

Documents come from the batch's ``PackedSeqParams``: the decoder layers of these models do not
hand their keyword arguments to the mixer, so the model's forward leaves them in one slot every
mixer reads (as ``parallel/context/hf.apply_hf_cp`` does for attention). With a cache (generation)
or a padding ``attention_mask`` the module's own forward runs. ``mixer.core`` (default
``local_selective_core``: conv, activation, projections, scan, ``+ D x``) is the seam a context-parallel
strategy replaces (``parallel/context/recurrent/mamba_state.StatePassingMamba1``); tensor parallelism shards
them by channel (``parallel/tensor/hf_plans/mamba1.py``; ``mamba1_tp_problem``: ``d_inner`` must divide by tp).

Single-device code (no process group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.models.hf.mixers.mamba2 import switch_mixers
from hybridpar.models.linear.selective_scan import document_resets, selective_scan
from hybridpar.models.mamba.conv import conv_backward, conv_forward
from hybridpar.models.mamba.core import row_documents

__all__ = ["MAMBA1_MARK", "is_mamba1_mixer", "mamba1_problem", "install_mamba1_core", "mamba1_mixers",
           "mamba1_tp_problem", "mamba1_channel_problem", "mamba1_training_forward", "local_selective_core", "selective_inputs",
           "document_conv"]

MAMBA1_MARK = "hybridpar_mamba1"  # set on a Mamba1 mixer whose forward resets at document boundaries
_SLOT = "_hybridpar_packed_slot"
_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def _local(t: Tensor | None) -> Tensor | None:
    """The rank-local tensor of a (DTensor) parameter, differentiable."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def is_mamba1_mixer(module: nn.Module) -> bool:
    """Whether ``module`` has the structure of a Mamba1 mixer (module docstring)."""
    if type(module).__module__.startswith("hybridpar"):
        return False
    parts = [getattr(module, a, None) for a in ("in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D")]
    in_proj, conv, x_proj, dt_proj, a_log, d = parts
    if not (all(isinstance(p, nn.Linear) for p in (in_proj, x_proj, dt_proj)) and isinstance(conv, nn.Conv1d)
            and isinstance(a_log, Tensor) and a_log.dim() == 2 and isinstance(d, Tensor)):
        return False
    channels, state = a_log.shape
    return (in_proj.out_features == 2 * channels and conv.in_channels == conv.out_channels == conv.groups == channels
            and x_proj.in_features == channels and x_proj.out_features == dt_proj.in_features + 2 * state
            and dt_proj.out_features == channels and d.shape == (channels,))


def mamba1_problem(name: str, module: nn.Module) -> str | None:
    """Why the training forward cannot run Mamba1 mixer ``module`` exactly (None: it can)."""
    conv, where = module.conv1d, f"Mamba1 mixer {name!r} ({type(module).__name__})"
    k = conv.kernel_size[0]
    if conv.stride != (1,) or conv.dilation != (1,) or conv.padding != (k - 1,) or conv.padding_mode != "zeros":
        return (f"{where} has conv stride {conv.stride}, dilation {conv.dilation}, padding {conv.padding}; the "
                f"document-resetting conv takes a causal conv (stride 1, dilation 1, zero padding {k - 1})")
    if not callable(getattr(module, "act", None)):
        return f"{where} has no activation module 'act' after its conv"
    return None


class _ResetConv(torch.autograd.Function):
    """The Mamba2 conv of ``models/mamba/conv.py`` on a token stream ``[T, Cd]`` (documents ``cu_docs``,
    ``history [m, K-1, Cd]`` entering the documents at ``init_at``); saves its inputs only."""

    @staticmethod
    def forward(ctx, x, weight, bias, cu_docs, init_at, history):
        ctx.save_for_backward(x, weight, cu_docs, init_at, history)
        ctx.has_bias = bias is not None
        return conv_forward(x, weight, bias, cu_docs, init_at, history)

    @staticmethod
    def backward(ctx, grad):
        x, weight, cu_docs, init_at, history = ctx.saved_tensors
        dx, dweight, dbias, dhistory = conv_backward(x, weight, ctx.has_bias, cu_docs, init_at, history,
                                                     grad.contiguous())
        return dx, dweight, dbias, None, None, dhistory


def document_conv(stream: Tensor, conv: nn.Conv1d, cu_docs: Tensor, init_at: Tensor | None = None,
                  history: Tensor | None = None) -> Tensor:
    """``stream [T, Cd]`` through the depthwise causal ``conv``, each token reading its own document only
    (or the ``history`` entering it): ``out_t = bias + sum_lag w[:, K-1-lag] x_{t-lag}``."""
    weight, bias = _local(conv.weight)[:, 0], _local(conv.bias)  # [Cd, K], [Cd]
    return _ResetConv.apply(stream.to(weight.dtype), weight, bias, cu_docs, init_at, history).to(stream.dtype)


def selective_inputs(mixer: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dt after softplus [.., Cd], B, C [.., N])`` of the activated conv output ``x [.., Cd]``: per token."""
    state = mixer.A_log.shape[1]
    dt, B, C = torch.split(mixer.x_proj(x), [mixer.dt_proj.in_features, state, state], dim=-1)
    dt, B, C = (getattr(mixer, norm)(t) if hasattr(mixer, norm) else t for norm, t in zip(_NORMS, (dt, B, C)))
    return F.softplus(mixer.dt_proj(dt)), B, C  # dt_proj called as a module, so a LoRA adapter on it applies


def local_selective_core(mixer: nn.Module, x: Tensor, packed=None) -> Tensor:
    """The single-process core, ``mixer.core``'s default: in_proj's ``x [R, T, Cd] -> y [R, T, Cd]``
    (conv, act, x_proj, norms, dt_proj, scan, ``+ D x``; before the gate), documents reset."""
    rows, length, channels = x.shape
    cu_seqlens = None if packed is None else packed.cu_seqlens_padded
    stream = document_conv(x.reshape(rows * length, channels), mixer.conv1d,
                           row_documents(cu_seqlens, rows, length, x.device))
    x = mixer.act(stream.view(rows, length, channels))
    dt, B, C = selective_inputs(mixer, x)
    reset = document_resets(cu_seqlens, length, x.device)
    A_log = _local(mixer.A_log)  # bf16 under FSDP's policy: A = -exp(A_log) in float32 or wider all the same
    return selective_scan(x, dt, -torch.exp(A_log.to(torch.promote_types(A_log.dtype, torch.float32))), B, C,
                          reset) + x * _local(mixer.D)


def mamba1_training_forward(mixer: nn.Module, hidden_states: Tensor, cache=None, attention_mask: Tensor | None = None,
                            **kwargs) -> Tensor:
    """The switched forward (module docstring); ``hidden_states [R, T, D] -> [R, T, D]``."""
    if cache is not None or attention_mask is not None:
        if getattr(mixer, "_hybridpar_channel_sharded", False):
            raise ValueError(f"{type(mixer).__name__} is sharded by channel (tensor parallel), where only hybridpar's "
                             "core runs: pass no cache and no attention_mask (describe padding and documents with "
                             "packed_seq_params), or generate with the unsharded model.")
        return mixer._hybridpar_transformers_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    packed = kwargs.get("packed_seq_params") or mixer.__dict__.get(_SLOT, {}).get("packed_seq_params")
    x, gate = mixer.in_proj(hidden_states).chunk(2, dim=-1)  # [R, T, Cd] each
    y = mixer.core(mixer, x, packed)  # [R, T, Cd]
    return mixer.out_proj((y * F.silu(gate)).to(hidden_states.dtype))


def install_mamba1_core(model: nn.Module) -> list[str]:
    """Give every Mamba1 mixer of ``model`` the training forward (idempotent); returns their names.
    Raises ``ValueError`` for a variant it cannot run exactly."""
    names = switch_mixers(model, is_mamba1_mixer, mamba1_problem, MAMBA1_MARK, mamba1_training_forward,
                          local_selective_core,
                          "one document per row (transformers' own forward)")
    if names and not getattr(model, "_hybridpar_mamba1_slot", False):
        slot: dict = {}
        for _, mixer in mamba1_mixers(model):
            mixer.__dict__[_SLOT] = slot

        def keep_packed(_, args: tuple, kwargs: dict) -> None:
            slot["packed_seq_params"] = kwargs.get("packed_seq_params")

        model.register_forward_pre_hook(keep_packed, with_kwargs=True)
        model._hybridpar_mamba1_slot = True
    return names


def mamba1_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the mixers ``install_mamba1_core`` switched."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, MAMBA1_MARK, False)]


def mamba1_channel_problem(name: str, mixer: nn.Module, tp: int) -> str | None:
    """Why Mamba1 mixer ``mixer`` cannot be sharded by channel over ``tp`` ranks (None: it can)."""
    channels = mixer.A_log.shape[0]
    if channels % tp == 0:
        return None
    valid = [t for t in range(1, channels + 1) if channels % t == 0][:12]
    return (f"Mamba1 mixer {name!r} ({type(mixer).__name__}) has d_inner={channels} channels, not divisible by tp={tp}: "
            f"tensor parallelism splits its channels over the TP ranks; use a tp dividing {channels} (one of {valid})")


def mamba1_tp_problem(model: nn.Module, tp: int) -> str | None:
    """Why ``model``'s switched Mamba1 mixers cannot run at this ``tp`` (None: they can, by channel:
    ``parallel/tensor/hf_plans/mamba1.py``; any ``cp``, by state passing:
    ``parallel/context/recurrent/mamba_state.StatePassingMamba1``)."""
    for name, mixer in mamba1_mixers(model) if tp > 1 else ():
        problem = mamba1_channel_problem(name, mixer, tp)
        if problem:
            return problem
    return None
