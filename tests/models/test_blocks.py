"""The MLP's squared ReLU stays in the activations' dtype under CUDA's autocast, which runs ``pow``
(what ``square`` dispatches) in float32 and would keep a float32 copy of every ``[T, I]`` activation
for backward (measured on an H200: 15.9 GiB more than planned for ``1b`` at 32K tokens). A gated
MLP's ``act(gate) * up`` keeps ``gate`` and ``up`` only, bitwise as eager otherwise."""

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from hybridpar.models.blocks import ACTIVATIONS, GATED_KINDS, MLP, gated_product
from tests.op_outputs import OpOutputs, kept_for_backward


def test_relu2_is_relu_squared_without_pow():
    x = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    with OpOutputs() as seen:
        out = ACTIVATIONS["relu2"](x)
        out.sum().backward()
    assert not [name for name in seen.ops if "pow" in name], seen.ops
    assert torch.equal(out, torch.relu(x) ** 2)
    assert torch.equal(x.grad, 2 * torch.relu(x))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_relu2_backward_equals_eager_bitwise_in_one_pass_keeping_one_tensor(dtype):
    """``dx = 2 dy relu(x)``: eager autograd's values bit for bit (it sums ``dy * r`` twice, then
    masks), one ``[T, I]`` op in backward where eager ran four, and only ``relu(x)`` kept."""
    generator = torch.Generator().manual_seed(1)
    x, grad = (torch.randn(48, 40, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2))
    results = {}
    for name, fn in (("eager", lambda t: F.relu(t) * F.relu(t)), ("ours", ACTIVATIONS["relu2"])):
        leaf = x.clone().requires_grad_()
        out, kept = _saved_bytes(fn, leaf)
        with OpOutputs() as seen:
            out.backward(grad)
        passes = [op for op, shape in seen.shapes if shape == tuple(x.shape) and "detach" not in op]  # [T, I] ops
        results[name] = (out, leaf.grad, kept, passes)
    assert torch.equal(results["ours"][0], results["eager"][0])
    assert torch.equal(results["ours"][1], results["eager"][1])
    assert results["ours"][2] == x.numel() * x.element_size()
    assert len(results["ours"][3]) == 1 < len(results["eager"][3]), (results["ours"][3], results["eager"][3])


def _saved_bytes(fn, *inputs) -> tuple[Tensor, int]:
    """``fn(*inputs)`` and the bytes autograd keeps for its backward."""
    with kept_for_backward() as kept:
        out = fn(*inputs)
    return out, sum(kept.values())


@pytest.mark.parametrize("kind", GATED_KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_gated_product_equals_eager_bitwise_and_keeps_only_gate_and_up(kind, dtype):
    """``act(gate) * up``: the same values and gradients as eager autograd, bit for bit, and
    backward keeps ``gate`` and ``up`` only (eager also keeps ``act(gate)``)."""
    act = {"silu": F.silu, "gelu": lambda g: F.gelu(g, approximate="tanh"), "gelu_erf": F.gelu}[kind]
    generator = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(48, 40, generator=generator, dtype=torch.float64).to(dtype) for _ in range(3))
    results = {}
    for name, fn in (("eager", lambda g, u: act(g) * u), ("fused", lambda g, u: gated_product(g, u, kind))):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out, kept = _saved_bytes(fn, g, u)
        out.backward(grad)
        results[name] = (out, g.grad, u.grad, kept)
    for got, want in zip(results["fused"][:3], results["eager"][:3]):
        assert torch.equal(got, want)
    assert results["fused"][3] == 2 * gate.numel() * gate.element_size()
    assert results["eager"][3] == 3 * gate.numel() * gate.element_size()


def test_the_gated_mlp_runs_the_gated_product():
    """Kept for backward: the input, gate, up, the product (down_proj's input) and the weights."""
    mlp = MLP(16, 24, activation="silu", gated=True).double()
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    out, kept = _saved_bytes(mlp, x)
    assert torch.equal(out, mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))
    assert kept == 5 * 8 * (16 + 3 * 24) + sum(p.numel() * 8 for p in mlp.parameters())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("activation, gated", [("relu2", False), ("silu", True), ("gelu", True)])
def test_mlp_activation_steps_compiled_equal_eager_bitwise(fresh_compiled_steps, activation, gated, dtype):
    """Where the steps inside run compiled (CUDA; ``aot_eager`` here), the squared ReLU keeps ``x`` and
    recomputes ``relu`` in its one backward pass, and the gated product runs its own two steps: the
    output and every gradient equal the eager MLP's bit for bit."""
    cuda_compile = fresh_compiled_steps
    torch.manual_seed(0)
    mlp = MLP(8, 24, activation=activation, gated=gated).to(dtype)
    x = torch.randn(3, 7, 8, dtype=dtype)
    results = []
    for backend in (None, "aot_eager"):
        with cuda_compile.compile_steps(backend):
            leaf = x.clone().requires_grad_()
            out = mlp(leaf)
            grads = torch.autograd.grad(out.float().square().sum(), [leaf, *mlp.parameters()])
        results.append([out, *grads])
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)
    kind = "relu2" if not gated else f"{activation} gated product"
    assert {name for name, _ in cuda_compile._COMPILED} == {kind, f"{kind} backward"} and not cuda_compile._FAILED
