"""hybridpar's gated DeltaNet core inside transformers' gated DeltaNet layers (Qwen3-Next, Qwen3.5,
OLMo-Hybrid), recognised by structure, never by class name.

A transformers module is a *gated DeltaNet* when it has ``num_k_heads``, ``num_v_heads``,
``head_k_dim``, ``head_v_dim``, a depthwise ``conv1d`` over ``q | k | v`` (``2*Hk*dk + Hv*dv``
channels), 1-D ``A_log`` and ``dt_bias`` over ``Hv``, a gated RMSNorm over ``dv`` (``norm`` or
``o_norm``), an output projection (``out_proj`` or ``o_proj``) and one of three projection layouts:

- ``in_proj_qkvz`` + ``in_proj_ba`` (Qwen3-Next: grouped per key head; the module's own
  ``fix_query_key_value_ordering`` unpacks them);
- ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (Qwen3.5);
- ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj`` (the gate), ``a_proj``, ``b_proj`` (OLMo-Hybrid;
  ``allow_neg_eigval`` doubles beta).

``install_gdn_core(model)`` gives each a training forward::

    u [B, L, D] -> projections -> mixed_qkv [B, L, 2*Hk*dk + Hv*dv], z [B, L, Hv*dv], a, b [B, L, Hv]
    mixed_qkv, a, b -> layer.core(layer, mixed_qkv, a, b, packed) -> o [B, L, Hv*dv]  (documents reset)
    o, z -> norm per head (norm before the SiLU gate) -> out_proj

``layer.core`` (default ``local_gdn_core``: ``models/linear/gdn_core.py`` on this process's tokens)
is the seam a context-parallel strategy replaces (``parallel/context/recurrent/gdn.py``). The batch's
``PackedSeqParams`` arrive as ``packed_seq_params`` through the decoder layer's ``**kwargs``.
Parameter names do not change. With a cache (generation) or a padding ``attention_mask`` the
module's own transformers forward runs.

Single-device code (no process group).
"""

from __future__ import annotations


import torch
from torch import Tensor, nn

from hybridpar.models.hf.mixers.fallback import takes_transformers_forward
from hybridpar.models.hf.mixers.mamba2 import switch_mixers
from hybridpar.models.linear.gdn_core import gated_delta_core
from hybridpar.models.mamba.core import shared_row_documents

__all__ = ["MARK", "is_gated_deltanet", "gdn_problem", "install_gdn_core", "gdn_layers", "local_gdn_core",
           "gdn_training_forward"]

MARK = "hybridpar_gdn_core"  # set on a gated DeltaNet whose forward runs hybridpar's core
CHUNK_SIZE = 64  # transformers' torch_chunk_gated_delta_rule default; a layer's ``hybridpar_chunk_size`` overrides it
_NEEDED = ("conv1d", "A_log", "dt_bias", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
_LAYOUTS = {"qkvz_ba": ("in_proj_qkvz", "in_proj_ba"), "qkv_z_b_a": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
            "q_k_v_g_a_b": ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj")}


def _layout(module: nn.Module) -> str | None:
    # nn.Linear, or one stored per component by tensor parallelism (parallel/tensor/hf_plans/dense.py: in_features kept)
    return next((name for name, parts in _LAYOUTS.items()
                 if all(isinstance(getattr(module, p, None), nn.Module) and hasattr(getattr(module, p), "in_features")
                        for p in parts)), None)


def _norm(module: nn.Module):
    return getattr(module, "norm", None) if hasattr(module, "norm") else getattr(module, "o_norm", None)


def _out(module: nn.Module):
    return getattr(module, "out_proj", None) if hasattr(module, "out_proj") else getattr(module, "o_proj", None)


def is_gated_deltanet(module: nn.Module) -> bool:
    """Whether ``module`` has the structure of a transformers gated DeltaNet (module docstring)."""
    if type(module).__module__.startswith("hybridpar") or not all(hasattr(module, a) for a in _NEEDED):
        return False
    conv, hk, hv = module.conv1d, module.num_k_heads, module.num_v_heads
    channels = 2 * hk * module.head_k_dim + hv * module.head_v_dim
    return (isinstance(conv, nn.Conv1d) and conv.in_channels == conv.out_channels == conv.groups == channels
            and all(isinstance(p, Tensor) and p.dim() == 1 and p.numel() == hv for p in (module.A_log, module.dt_bias))
            and _layout(module) is not None and isinstance(_out(module), nn.Linear) and _norm(module) is not None)


def gdn_problem(name: str, module: nn.Module) -> str | None:
    """Why hybridpar's core cannot run gated DeltaNet ``module`` exactly (None: it can)."""
    where = f"gated DeltaNet {name!r} ({type(module).__name__})"
    activation = getattr(module, "activation", "silu")
    if activation not in ("silu", "swish"):
        return f"{where} uses activation {activation!r} after its conv; hybridpar's core applies SiLU only"
    if module.num_v_heads % module.num_k_heads:
        return f"{where} has {module.num_v_heads} value heads, not a multiple of its {module.num_k_heads} key heads"
    conv = module.conv1d
    if conv.padding != (conv.kernel_size[0] - 1,) or conv.stride != (1,) or conv.dilation != (1,):
        return f"{where} has a conv that is not causal with stride 1 (padding {conv.padding}, stride {conv.stride})"
    layout, key, value, heads = _layout(module), 2 * module.num_k_heads * module.head_k_dim, \
        module.num_v_heads * module.head_v_dim, module.num_v_heads
    widths = {"qkvz_ba": (key + 2 * value, 2 * heads), "qkv_z_b_a": (key + value, value, heads, heads),
              "q_k_v_g_a_b": (key // 2, key // 2, value, value, heads, heads)}[layout]
    got = tuple(getattr(module, part).out_features for part in _LAYOUTS[layout])
    if got != widths or _out(module).in_features != value:
        return (f"{where} has projections {dict(zip(_LAYOUTS[layout], got))} and an output projection of "
                f"{_out(module).in_features} inputs; hybridpar's core expects widths {widths} and {value}")
    if layout == "qkvz_ba" and not callable(getattr(module, "fix_query_key_value_ordering", None)):
        return f"{where} has in_proj_qkvz/in_proj_ba but no fix_query_key_value_ordering to unpack them"
    norm = _norm(module)
    weight = getattr(norm, "weight", None)
    # "swish" is SiLU: FLA's FusedRMSNormGated (which some transformers releases use where fla imports) names it so
    if weight is None or tuple(weight.shape) != (module.head_v_dim,) or \
            getattr(norm, "activation", "silu") not in ("silu", "swish"):
        return f"{where} has a norm {type(norm).__name__} that is not a SiLU-gated RMSNorm over one head ({module.head_v_dim})"
    return None


def local_gdn_core(layer: nn.Module, mixed_qkv: Tensor, a: Tensor, b: Tensor, packed=None) -> Tensor:
    """The single-process core on this process's tokens in sequence order; packed documents reset
    the conv and the state. ``mixed_qkv [B, L, 2*Hk*dk + Hv*dv]``, ``a, b [B, L, Hv]`` -> ``[B, L, Hv*dv]``."""
    batch, seqlen, _ = mixed_qkv.shape
    return gated_delta_core(
        mixed_qkv, a, b, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, layer.A_log, layer.dt_bias,
        head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim, chunk_size=getattr(layer, "hybridpar_chunk_size", CHUNK_SIZE),
        cu_docs=shared_row_documents(packed, batch, seqlen, mixed_qkv.device), beta_scale=beta_scale(layer),
    )


def beta_scale(layer: nn.Module) -> float:
    """2 where OLMo-Hybrid's ``allow_neg_eigval`` lets beta reach 2, else 1."""
    return 2.0 if getattr(layer, "allow_neg_eigval", False) else 1.0


def _project(layer: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(mixed_qkv [B, L, 2*Hk*dk + Hv*dv], z [B, L, Hv*dv], a, b [B, L, Hv])`` of ``hidden [B, L, D]``."""
    layout = _layout(layer)
    if layout == "qkvz_ba":
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(hidden), layer.in_proj_ba(hidden))
        mixed = torch.cat([x.flatten(2) for x in (q, k, v)], dim=-1)
        return mixed, z.flatten(2), a, b
    if layout == "qkv_z_b_a":
        return layer.in_proj_qkv(hidden), layer.in_proj_z(hidden), layer.in_proj_a(hidden), layer.in_proj_b(hidden)
    mixed = torch.cat([layer.q_proj(hidden), layer.k_proj(hidden), layer.v_proj(hidden)], dim=-1)
    return mixed, layer.g_proj(hidden), layer.a_proj(hidden), layer.b_proj(hidden)


def gdn_training_forward(layer: nn.Module, hidden_states: Tensor, cache=None, attention_mask: Tensor | None = None,
                         packed_seq_params=None, **kwargs) -> Tensor:
    """The layer's forward through ``layer.core`` (module docstring); ``hidden_states [B, L, D]``."""
    sharded = "heads" if hasattr(layer.A_log, "to_local") else None  # a DTensor: tensor parallel
    if takes_transformers_forward(layer, cache, attention_mask, packed_seq_params, kwargs, sharded):
        return layer._hybridpar_transformers_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    batch, seqlen, _ = hidden_states.shape
    mixed_qkv, z, a, b = _project(layer, hidden_states)
    o = layer.core(layer, mixed_qkv, a, b, packed_seq_params)  # [B, L, Hv*dv]
    dv = layer.head_v_dim
    o = _norm(layer)(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(batch, seqlen, -1)
    return _out(layer)(o)


def install_gdn_core(model: nn.Module) -> list[str]:
    """Give every gated DeltaNet of ``model`` the training forward through ``layer.core`` (idempotent);
    returns their names. Raises ``ValueError`` for a variant the core cannot run exactly."""
    return switch_mixers(model, is_gated_deltanet, gdn_problem, MARK, gdn_training_forward, local_gdn_core,
                         "a supported gated DeltaNet")


def gdn_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the gated DeltaNets ``install_gdn_core`` switched to hybridpar's core."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, MARK, False)]
