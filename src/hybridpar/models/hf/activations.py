"""transformers' activations in hybridpar's leaner forms: the squared ReLU as a product, and the
gated MLP's ``act(gate) * up`` as one op that keeps one ``[T, I]`` less for backward.

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
"""

from __future__ import annotations

import functools
import types

from torch import Tensor, nn
from torch.nn import functional as F

from hybridpar.models.blocks import gated_product, relu2

__all__ = ["ProductReLUSquared", "gated_kind", "use_lean_gated_mlps", "use_product_relu2"]

LEAN_MARK = "hybridpar_lean_gated_mlp"  # set on a gated MLP whose forward runs gated_product


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
