"""hybridpar's selective scan inside transformers' Mamba1 mixers (Mamba, FalconMamba, Jamba's Mamba
layers), recognised by structure, never by class name.

A transformers module is a *Mamba1 mixer* when it has ``in_proj`` (width ``2 * d_inner``:
``[x | z]``), a depthwise ``conv1d`` over ``d_inner`` channels, ``x_proj`` (``d_inner -> rank + 2n``:
``[dt | B | C]``), ``dt_proj`` (``rank -> d_inner``), a 2-D ``A_log [d_inner, n]``, ``D [d_inner]`` and
``out_proj``. ``install_mamba1_core(model)`` gives each such mixer a training forward::

    [x | z] = in_proj(u)
    y = mixer.core(mixer, x, packed)           conv (documents reset) -> act -> x_proj -> [dt | B | C]
                                                 -> dt/B/C norms (Jamba's RMSNorms, FalconMamba's
                                                 weightless RMS) -> dt_proj -> softplus -> scan + D x
    out = out_proj(y * silu(z))

``mixer.core`` (default ``local_selective_core``) is the seam context-parallel strategies replace.
The per-architecture twists are read from the module: its ``act`` (``hidden_act``), its
``dt_layernorm`` / ``b_layernorm`` / ``c_layernorm`` when present, its biases and time-step rank.
Decoder layers of these models do not pass ``packed_seq_params`` to their mixer: the install
registers one pre-hook on the model that leaves the batch's ``PackedSeqParams`` in a slot shared by
every mixer (as ``parallel/context/hf.apply_hf_cp`` does for attention), read when the mixer gets
none. With a cache (generation) or a padding ``attention_mask`` the module's own forward runs.

Single-device code (no process group).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hybridpar.models.hf.mamba_mixers import switch_mixers
from hybridpar.models.linear.selective_scan import reset_conv, selective_scan
from hybridpar.models.mamba.core import row_documents

__all__ = ["MAMBA1_MARK", "is_mamba1_mixer", "mamba1_mixer_problem", "install_mamba1_core", "mamba1_mixers",
           "local_selective_core", "selective_inputs", "mamba1_training_forward"]

MAMBA1_MARK = "hybridpar_mamba1_core"  # set on a Mamba1 mixer whose forward runs hybridpar's selective scan
_SLOT = "_hybridpar_packed_slot"


def _local(t: Tensor | None) -> Tensor | None:
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def is_mamba1_mixer(module: nn.Module) -> bool:
    """Whether ``module`` has the structure of a Mamba1 mixer (module docstring)."""
    if type(module).__module__.startswith("hybridpar"):
        return False
    parts = [getattr(module, a, None) for a in ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj")]
    a_log, d = (dict(module.named_parameters(recurse=False)).get(a) for a in ("A_log", "D"))
    if not (isinstance(parts[1], nn.Conv1d) and all(isinstance(p, nn.Linear) for p in parts[:1] + parts[2:])):
        return False
    if a_log is None or d is None or a_log.dim() != 2:
        return False
    in_proj, conv, x_proj, dt_proj, out_proj = parts
    inner, state = a_log.shape
    return (conv.in_channels == conv.out_channels == conv.groups == inner and in_proj.out_features == 2 * inner
            and x_proj.in_features == inner and x_proj.out_features == dt_proj.in_features + 2 * state
            and dt_proj.out_features == inner and out_proj.in_features == inner and d.shape == (inner,))


def mamba1_mixer_problem(name: str, module: nn.Module) -> str | None:
    """Why the selective scan cannot run Mamba1 mixer ``module`` exactly (None: it can)."""
    conv, where = module.conv1d, f"Mamba1 mixer {name!r} ({type(module).__name__})"
    k = conv.kernel_size[0]
    if conv.stride != (1,) or conv.dilation != (1,) or conv.padding != (k - 1,) or conv.padding_mode != "zeros":
        return f"{where} has a conv that is not causal (stride 1, dilation 1, zero padding kernel - 1 = {k - 1})"
    if not callable(getattr(module, "act", None)):
        return f"{where} has no `act` (the activation after its conv)"
    if hasattr(module.config, "_is_quantized"):
        return f"{where} is quantized; hybridpar's selective scan runs unquantized dt_proj weights"
    return None


def selective_inputs(module: nn.Module, conv_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dt [.., d] after softplus, B, C [.., n])`` from the activated conv output ``[.., d]``: x_proj,
    the module's dt/B/C norms if any, dt_proj with its bias, softplus (per token, no mixing)."""
    state = module.A_log.shape[-1]
    rank = module.x_proj.out_features - 2 * state
    time_step, B, C = module.x_proj(conv_out).split([rank, state, state], dim=-1)
    for norm, value in (("dt_layernorm", time_step), ("b_layernorm", B), ("c_layernorm", C)):
        if getattr(module, norm, None) is not None:
            if norm == "dt_layernorm":
                time_step = module.dt_layernorm(value)
            elif norm == "b_layernorm":
                B = module.b_layernorm(value)
            else:
                C = module.c_layernorm(value)
    dt = F.softplus(module.dt_proj(time_step))
    return dt, B, C


def local_selective_core(module: nn.Module, x: Tensor, packed=None) -> Tensor:
    """The single-process core: ``x [B, L, d]`` (in_proj's x half) ``-> y [B, L, d]`` (scan + D x, before
    the gate) over this process's tokens in sequence order; packed documents reset conv and scan."""
    batch, seq_len, width = x.shape
    cu_seqlens = None if packed is None else packed.cu_seqlens_padded
    cu_docs = row_documents(cu_seqlens, batch, seq_len, x.device)
    weight, bias = _local(module.conv1d.weight).squeeze(1), _local(module.conv1d.bias)
    flat = x.reshape(batch * seq_len, width)
    conv_out = module.act(reset_conv(flat.to(weight.dtype), weight, bias, cu_docs).to(x.dtype))
    dt, B, C = selective_inputs(module, conv_out)
    A = -torch.exp(_local(module.A_log).to(dt.dtype))
    y = selective_scan(conv_out.to(dt.dtype), dt, A, B.to(dt.dtype), C.to(dt.dtype), _local(module.D).to(dt.dtype),
                       cu_docs)
    return y.view(batch, seq_len, width)


def mamba1_training_forward(module: nn.Module, hidden_states: Tensor, cache=None, attention_mask: Tensor | None = None,
                            packed_seq_params=None, **kwargs) -> Tensor:
    """The mixer's forward through ``module.core`` (module docstring); ``hidden_states [B, L, D]``."""
    padded = attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all())
    if cache is not None or padded or kwargs.get("cache_params") is not None:
        return module._hybridpar_transformers_forward(hidden_states, cache=cache, attention_mask=attention_mask,
                                                      **kwargs)
    if packed_seq_params is None:
        packed_seq_params = getattr(module, _SLOT, {}).get("packed_seq_params")
    x, gate = module.in_proj(hidden_states).chunk(2, dim=-1)  # [B, L, d] each
    y = module.core(module, x, packed_seq_params)  # [B, L, d]
    return module.out_proj((y * F.silu(gate.to(y.dtype))).to(hidden_states.dtype))


def install_mamba1_core(model: nn.Module) -> list[str]:
    """Give every Mamba1 mixer of ``model`` the training forward through ``module.core`` and route the
    batch's ``packed_seq_params`` to it (idempotent); returns their names. Raises ``ValueError`` for a
    variant the scan cannot run exactly."""
    names = switch_mixers(model, is_mamba1_mixer, mamba1_mixer_problem, MAMBA1_MARK, mamba1_training_forward,
                          local_selective_core, "a Mamba1 mixer of Mamba, FalconMamba or Jamba's layout")
    if names and not hasattr(model, _SLOT):
        slot: dict = {}
        setattr(model, _SLOT, slot)
        for _, module in mamba1_mixers(model):
            setattr(module, _SLOT, slot)

        def keep_packed(_, args: tuple, kwargs: dict) -> None:
            slot["packed_seq_params"] = kwargs.get("packed_seq_params")

        model.register_forward_pre_hook(keep_packed, with_kwargs=True)
    return names


def mamba1_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the Mamba1 mixers ``install_mamba1_core`` switched."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, MAMBA1_MARK, False)]
