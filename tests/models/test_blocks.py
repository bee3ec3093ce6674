"""The MLP's squared ReLU stays in the activations' dtype under CUDA's autocast, which runs ``pow``
(what ``square`` dispatches) in float32 and would keep a float32 copy of every ``[T, I]`` activation
for backward (measured on an H200: 15.9 GiB more than planned for ``1b`` at 32K tokens)."""

import torch

from hybridpar.models.blocks import ACTIVATIONS
from tests.op_outputs import OpOutputs


def test_relu2_is_relu_squared_without_pow():
    x = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    with OpOutputs() as seen:
        out = ACTIVATIONS["relu2"](x)
        out.sum().backward()
    assert not [name for name in seen.ops if "pow" in name], seen.ops
    assert torch.equal(out, torch.relu(x) ** 2)
    assert torch.equal(x.grad, 2 * torch.relu(x))
