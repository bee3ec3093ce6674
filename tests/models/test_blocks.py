"""The MLP's squared ReLU stays in the activations' dtype under CUDA's autocast, which runs ``pow``
(what ``square`` dispatches) in float32 and would keep a float32 copy of every ``[T, I]`` activation
for backward (measured on an H200: 15.9 GiB more than planned for ``1b`` at 32K tokens)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpar.models.blocks import ACTIVATIONS


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_relu2_is_relu_squared_without_pow():
    x = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    with OpNames() as seen:
        out = ACTIVATIONS["relu2"](x)
        out.sum().backward()
    assert not [name for name in seen.names if "pow" in name], seen.names
    assert torch.equal(out, torch.relu(x) ** 2)
    assert torch.equal(x.grad, 2 * torch.relu(x))
