"""transformers' activations and norms in hybridpar's leaner forms: the squared ReLU as a product,
the gated MLP's ``act(gate) * up`` as one op that keeps one ``[T, I]`` less for backward, and the
RMSNorm over the hidden state keeping one float32 ``[T, D]`` less.

Squared ReLU (Nemotron-H's MLPs and MoE experts):

``ReLUSquaredActivation`` computes ``torch.square(relu(x))``; ``square`` dispatches ``pow``, which
CUDA's autocast runs in float32, so every MLP would keep a float32 ``[T, I]`` copy for backward
under bf16 mixed precision (``models.blocks.relu2`` says what it cost on an H200). The swap keeps
the module tree's names and holds no parameters, so checkpoints and exports are unchanged; in
float32 and float64 the values are identical.

Gated MLPs: a module whose class's ``forward`` is, bytecode for bytecode, ``LlamaMLP.forward``
(``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; over a hundred transformers classes share it:
Llama, Mistral, Qwen2/3, Gemma, Granite, Bamba, ...) and whose ``act_fn`` is SiLU or GELU gets that
forward through ``models.blocks.gated_product`` (bitwise the same values and gradients). Any other
forward or activation keeps transformers' own.

RMSNorms: a module whose class's ``forward`` is, bytecode for bytecode, ``LlamaRMSNorm.forward``
(``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` with ``x`` in float32; Llama, Mistral, Qwen2/3,
Bamba, Granite, GraniteMoeHybrid, Zamba2, Falcon-H1, ...) over the model's hidden size gets
``models.blocks.rms_norm``: the same forward values bit for bit, and for backward its input and
``rstd`` only, where autograd keeps the float32 product ``x * rstd`` as well (on CUDA, torch's fused
kernel). Per-head norms (Qwen3's q/k) and DTensor inputs or weights (sequence parallelism) keep
transformers' forward, as does every other norm (NemotronH's, Gemma's ``1 + weight``, OLMo2's).
The gated grouped norms of the Mamba2 hybrids whose ``forward`` is ``BambaRMSNormGated.forward``
(``rmsnorm_group(x * silu(z)) * w``: Bamba, NemotronH, GraniteMoeHybrid, Zamba2) run
``models.blocks.gated_rms_norm`` the same way: transformers' keeps three float32 ``[T, d_inner]``
(``silu(z)``, the product, the normalized product) where ours keeps ``x``, ``z`` and ``rstd``; on
CUDA, FLA's fused gated norm. Falcon-H1's (its weight inside, ``norm_before_gate``) keeps its own.
"""

from __future__ import annotations

import functools
import types

from torch import Tensor, nn
from torch.nn import functional as F

from hybridpar.models.blocks import gated_product, gated_rms_norm, relu2, rms_norm
from hybridpar.models.norm_kernels import plain_tensors

__all__ = ["ProductReLUSquared", "gated_kind", "lean_gated_norms", "lean_rms_norms", "use_lean_gated_mlps",
           "use_lean_rms_norms", "use_product_relu2"]

LEAN_MARK = "hybridpar_lean_gated_mlp"  # set on a gated MLP whose forward runs gated_product
LEAN_NORM_MARK = "hybridpar_lean_rms_norm"  # True: the forward runs blocks.rms_norm; "gated": gated_rms_norm


class ProductReLUSquared(nn.Module):
    """``relu(x) * relu(x)``: stays in the activations' dtype under autocast."""

    def forward(self, x: Tensor) -> Tensor:
        return relu2(x)


def use_product_relu2(model: nn.Module) -> int:
    """Replace every ``transformers.activations.ReLUSquaredActivation`` child of ``model``'s modules;
    returns how many."""
    from transformers.activations import ReLUSquaredActivation

    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is ReLUSquaredActivation:
                setattr(parent, name, ProductReLUSquared())
                swapped += 1
    return swapped


def gated_kind(act_fn: nn.Module) -> str | None:
    """``models.blocks.gated_product``'s name for ``act_fn`` (SiLU, tanh or erf GELU), else None."""
    from transformers.activations import GELUActivation, GELUTanh, SiLUActivation

    if type(act_fn) in (nn.SiLU, SiLUActivation):
        return "silu"
    if type(act_fn) is nn.GELU:
        return {"tanh": "gelu", "none": "gelu_erf"}.get(act_fn.approximate)
    act = getattr(act_fn, "act", None)  # transformers' GELUs hold the function they call
    if type(act_fn) is GELUActivation and act is F.gelu:
        return "gelu_erf"
    if (type(act_fn) is GELUTanh and isinstance(act, functools.partial) and act.func is F.gelu and not act.args
            and act.keywords == {"approximate": "tanh"}):
        return "gelu"
    return None


def _lean_forward(mlp: nn.Module, x: Tensor) -> Tensor:
    """``LlamaMLP.forward`` through ``gated_product``."""
    return mlp.down_proj(gated_product(mlp.gate_proj(x), mlp.up_proj(x), mlp.hybridpar_gated_kind))


def use_lean_gated_mlps(model: nn.Module) -> int:
    """Give every Llama-form gated MLP of ``model`` (module docstring) the lean forward (idempotent);
    returns how many modules run it."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    reference = LlamaMLP.forward.__code__
    lean = 0
    for module in model.modules():
        if not getattr(module, LEAN_MARK, False):
            code = getattr(type(module).__dict__.get("forward"), "__code__", None)
            if code is None or (code.co_code, code.co_names) != (reference.co_code, reference.co_names):
                continue
            kind = gated_kind(getattr(module, "act_fn", None))
            if kind is None:
                continue
            module.hybridpar_gated_kind = kind
            module.forward = types.MethodType(_lean_forward, module)
            setattr(module, LEAN_MARK, True)
        lean += 1
    return lean


def _same_forward(module: nn.Module, reference) -> bool:
    code = getattr(type(module).__dict__.get("forward"), "__code__", None)
    return code is not None and (code.co_code, code.co_names) == (reference.co_code, reference.co_names)


def lean_rms_norms(model: nn.Module) -> list[nn.Module]:
    """``model``'s RMSNorms that ``use_lean_rms_norms`` gives ``blocks.rms_norm``: Llama's forward,
    a weight over ``config.hidden_size`` (the planner reads this on the meta model)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    width = getattr(text, "hidden_size", None)
    reference = LlamaRMSNorm.forward.__code__
    return [m for m in model.modules() if getattr(m, LEAN_NORM_MARK, False) is True or (
        width is not None and _same_forward(m, reference) and hasattr(m, "variance_epsilon")
        and getattr(getattr(m, "weight", None), "shape", None) == (width,))]


def lean_gated_norms(model: nn.Module) -> list[nn.Module]:
    """``model``'s gated grouped norms of Bamba's form that ``use_lean_rms_norms`` gives ``blocks.gated_rms_norm``."""
    from transformers.models.bamba.modeling_bamba import BambaRMSNormGated

    reference = BambaRMSNormGated.forward.__code__
    return [m for m in model.modules() if getattr(m, LEAN_NORM_MARK, False) == "gated" or (
        _same_forward(m, reference) and isinstance(getattr(m, "group_size", None), int)
        and hasattr(m, "variance_epsilon"))]


def _lean_norm_forward(norm: nn.Module, hidden_states: Tensor) -> Tensor:
    """``LlamaRMSNorm.forward`` through ``blocks.rms_norm`` on plain tensors; transformers' own on
    DTensors (a sequence-parallel norm)."""
    if plain_tensors(hidden_states, norm.weight):
        return rms_norm(hidden_states, norm.weight, norm.variance_epsilon)
    return type(norm).forward(norm, hidden_states)


def _lean_gated_forward(norm: nn.Module, hidden_states: Tensor, gate: Tensor | None = None) -> Tensor:
    """``BambaRMSNormGated.forward`` through ``blocks.gated_rms_norm`` on plain tensors."""
    if plain_tensors(hidden_states, gate, norm.weight):
        return gated_rms_norm(hidden_states, gate, norm.weight, norm.group_size, norm.variance_epsilon)
    return type(norm).forward(norm, hidden_states, gate)


def use_lean_rms_norms(model: nn.Module) -> int:
    """Give every norm ``lean_rms_norms`` and ``lean_gated_norms`` find the lean forward (idempotent);
    returns how many."""
    plain, gated = lean_rms_norms(model), lean_gated_norms(model)
    for norms, forward, mark in ((plain, _lean_norm_forward, True), (gated, _lean_gated_forward, "gated")):
        for norm in norms:
            norm.forward = types.MethodType(forward, norm)
            setattr(norm, LEAN_NORM_MARK, mark)
    return len(plain) + len(gated)
