"""hybridpar's KDA core inside transformers' Kimi Delta Attention layers (Kimi Linear), recognised
by structure, never by class name.

A transformers module is a *Kimi Delta Attention* when it has ``num_heads``, ``head_dim``,
``q_proj``, ``k_proj``, ``v_proj`` and ``b_proj`` (linear), a depthwise ``conv1d`` over ``q | k | v``
(``3*H*d`` channels), a ``forget_gate`` with ``f_a_proj``, ``f_b_proj`` (to ``H*d``), ``A_log`` (``H``
values) and ``dt_bias [H*d]``, the output gate ``g_a_proj``, ``g_b_proj``, a sigmoid-gated RMSNorm
``o_norm`` over one head and ``o_proj``. ``install_kda_core(model)`` gives each a training forward::

    u [B, L, D] -> q_proj | k_proj | v_proj -> mixed_qkv [B, L, 3*H*d];  f = f_b_proj(f_a_proj(u)) [B, L, H*d];
                   b = b_proj(u) [B, L, H]
    mixed_qkv, f, b -> layer.core(layer, mixed_qkv, f, b, packed) -> o [B, L, H*d]   (documents reset)
    o, g_b_proj(g_a_proj(u)) -> o_norm per head (sigmoid gate) -> o_proj

``layer.core`` (default ``local_kda_core``: ``models/linear/kda_core.py`` on this process's tokens)
is the seam a context-parallel strategy replaces (``parallel/context/recurrent/kda.py``). The
batch's ``PackedSeqParams`` arrive as ``packed_seq_params`` through the decoder layer's ``**kwargs``.
Parameter names do not change. With a cache (generation) or a padding ``attention_mask`` the
module's own transformers forward runs. Single-device code (no process group).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hybridpar.models.hf.mixers.fallback import takes_transformers_forward
from hybridpar.models.hf.mixers.mamba2 import switch_mixers
from hybridpar.models.linear.kda_core import kimi_delta_core
from hybridpar.models.mamba.core import shared_row_documents

__all__ = ["KDA_MARK", "is_kimi_delta", "kda_problem", "install_kda_core", "kda_layers", "local_kda_core",
           "kda_training_forward"]

KDA_MARK = "hybridpar_kda_core"  # set on a Kimi Delta Attention whose forward runs hybridpar's core
CHUNK_SIZE = 64  # transformers' chunk_kimi_delta_attention default; a layer's ``hybridpar_chunk_size`` overrides it
_LINEARS = ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj")
_GATE = ("f_a_proj", "f_b_proj")


def _linear(module, name: str) -> bool:  # nn.Linear, or one stored per component by tensor parallelism
    part = getattr(module, name, None)
    return isinstance(part, nn.Module) and hasattr(part, "in_features") and hasattr(part, "out_features")


def is_kimi_delta(module: nn.Module) -> bool:
    """Whether ``module`` has the structure of a transformers Kimi Delta Attention (module docstring)."""
    if type(module).__module__.startswith("hybridpar") or not all(
            hasattr(module, a) for a in ("num_heads", "head_dim", "conv1d", "forget_gate", "o_norm")):
        return False
    gate, conv = module.forget_gate, module.conv1d
    channels = 3 * module.num_heads * module.head_dim
    return (all(_linear(module, p) for p in _LINEARS) and all(_linear(gate, p) for p in _GATE)
            and isinstance(getattr(gate, "A_log", None), Tensor) and isinstance(getattr(gate, "dt_bias", None), Tensor)
            and isinstance(conv, nn.Conv1d) and conv.in_channels == conv.out_channels == conv.groups == channels)


def kda_problem(name: str, module: nn.Module) -> str | None:
    """Why hybridpar's core cannot run Kimi Delta Attention ``module`` exactly (None: it can)."""
    where = f"Kimi Delta Attention {name!r} ({type(module).__name__})"
    heads, d = module.num_heads, module.head_dim
    activation = getattr(module, "activation", "silu")
    if activation not in ("silu", "swish"):
        return f"{where} uses activation {activation!r} after its conv; hybridpar's core applies SiLU only"
    conv = module.conv1d
    if conv.padding != (conv.kernel_size[0] - 1,) or conv.stride != (1,) or conv.dilation != (1,):
        return f"{where} has a conv that is not causal with stride 1 (padding {conv.padding}, stride {conv.stride})"
    gate = module.forget_gate
    widths = {"q_proj": heads * d, "k_proj": heads * d, "v_proj": heads * d, "b_proj": heads,
              "f_b_proj": heads * d, "g_b_proj": heads * d}
    got = {p: getattr(gate if p == "f_b_proj" else module, p).out_features for p in widths}
    if got != widths or module.o_proj.in_features != heads * d or gate.A_log.numel() != heads \
            or tuple(gate.dt_bias.shape) != (heads * d,):
        return (f"{where} has projections {got}, A_log of {gate.A_log.numel()} values and dt_bias "
                f"{tuple(gate.dt_bias.shape)}; hybridpar's core expects widths {widths}, {heads} and ({heads * d},)")
    weight = getattr(module.o_norm, "weight", None)
    if weight is None or tuple(weight.shape) != (d,) or getattr(module.o_norm, "activation", "sigmoid") != "sigmoid":
        return f"{where} has a norm {type(module.o_norm).__name__} that is not a sigmoid-gated RMSNorm over one head ({d})"
    return None


def local_kda_core(layer: nn.Module, mixed_qkv: Tensor, f: Tensor, b: Tensor, packed=None) -> Tensor:
    """The single-process core on this process's tokens in sequence order; packed documents reset
    the conv and the state. ``mixed_qkv [B, L, 3*H*d]``, ``f [B, L, H*d]``, ``b [B, L, H]`` -> ``[B, L, H*d]``."""
    batch, seqlen, _ = mixed_qkv.shape
    gate = layer.forget_gate
    return kimi_delta_core(
        mixed_qkv, f, b, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, gate.A_log, gate.dt_bias,
        head_dim=layer.head_dim, chunk_size=getattr(layer, "hybridpar_chunk_size", CHUNK_SIZE),
        cu_docs=shared_row_documents(packed, batch, seqlen, mixed_qkv.device),
    )


def kda_training_forward(layer: nn.Module, hidden_states: Tensor, cache=None, attention_mask: Tensor | None = None,
                         packed_seq_params=None, **kwargs) -> Tensor:
    """The layer's forward through ``layer.core`` (module docstring); ``hidden_states [B, L, D]``."""
    if takes_transformers_forward(layer, cache, attention_mask, packed_seq_params, kwargs):  # (no TP of KDA)
        return layer._hybridpar_transformers_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    batch, seqlen, _ = hidden_states.shape
    gate = layer.forget_gate
    mixed_qkv = torch.cat([layer.q_proj(hidden_states), layer.k_proj(hidden_states), layer.v_proj(hidden_states)], dim=-1)
    f = gate.f_b_proj(gate.f_a_proj(hidden_states))
    o = layer.core(layer, mixed_qkv, f, layer.b_proj(hidden_states), packed_seq_params)  # [B, L, H*d]
    d = layer.head_dim
    z = layer.g_b_proj(layer.g_a_proj(hidden_states))
    o = layer.o_norm(o.reshape(batch, seqlen, -1, d), z.reshape(batch, seqlen, -1, d)).reshape(batch, seqlen, -1)
    return layer.o_proj(o)


def install_kda_core(model: nn.Module) -> list[str]:
    """Give every Kimi Delta Attention of ``model`` the training forward through ``layer.core``
    (idempotent); returns their names. Raises ``ValueError`` for a variant the core cannot run exactly."""
    return switch_mixers(model, is_kimi_delta, kda_problem, KDA_MARK, kda_training_forward, local_kda_core,
                         "a supported Kimi Delta Attention")


def kda_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the Kimi Delta Attentions ``install_kda_core`` switched to hybridpar's core."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, KDA_MARK, False)]

