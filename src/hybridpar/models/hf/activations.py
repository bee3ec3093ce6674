"""transformers' squared ReLU (Nemotron-H's MLPs and MoE experts) as hybridpar's product form.

``ReLUSquaredActivation`` computes ``torch.square(relu(x))``; ``square`` dispatches ``pow``, which
CUDA's autocast runs in float32, so every MLP would keep a float32 ``[T, I]`` copy for backward
under bf16 mixed precision (``models.blocks.relu2`` says what it cost on an H200). The swap keeps
the module tree's names and holds no parameters, so checkpoints and exports are unchanged; in
float32 and float64 the values are identical.
"""

from __future__ import annotations

from torch import Tensor, nn

from hybridpar.models.blocks import relu2

__all__ = ["ProductReLUSquared", "use_product_relu2"]


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
