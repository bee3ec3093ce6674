"""``SplitInProj`` (the Mamba2 ``in_proj`` stored per component) computes the fused projection
without a fused copy of its weight: nothing autograd saves is a new weight-sized tensor."""

from __future__ import annotations

import torch

from hybridpar.models.mamba.mixer import Mamba2Mixer
from hybridpar.parallel.tensor.hybrid import SplitInProj, split_mamba_mixers


def test_split_in_proj_equals_the_fused_linear_and_saves_no_weight_copy():
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.mixer = Mamba2Mixer(32, num_heads=4, head_dim=8, n_groups=2, state_size=8, chunk_size=8, use_bias=True).double()
    fused = torch.nn.Linear(32, holder.mixer.in_proj.out_features, bias=True).double()
    fused.load_state_dict(holder.mixer.in_proj.state_dict())
    split_mamba_mixers(holder)
    split = holder.mixer.in_proj
    assert isinstance(split, SplitInProj)
    x = torch.randn(2, 16, 32, dtype=torch.float64, requires_grad=True)
    params = {p.untyped_storage()._cdata for p in split.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage()._cdata not in params:
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = split(x)
    torch.testing.assert_close(out, fused(x), rtol=0, atol=1e-13)
    assert saved and all(shape[-1] == 32 and shape[0] != fused.out_features for shape in saved), saved
    out.square().sum().backward()
    fused_out = fused(x.detach())
    fused_out.square().sum().backward()
    weight_grad = torch.cat([getattr(split, f"weight_{n}").grad for n in split.component_sizes])
    torch.testing.assert_close(weight_grad, fused.weight.grad, rtol=0, atol=1e-12)


def test_under_bf16_autocast_one_matmul_runs_and_keeps_the_bytes_the_component_casts_kept():
    """Autocast casts each float32 component to bf16 and keeps the casts: ``SplitInProj`` then
    concatenates those casts and runs one matmul. The values and every gradient equal the
    per-component matmuls (the same dot products), and the bytes kept for backward are the same."""
    from tests.op_outputs import OpOutputs, kept_for_backward

    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.mixer = Mamba2Mixer(32, num_heads=4, head_dim=8, n_groups=2, state_size=8, chunk_size=8, use_bias=True)
    split_mamba_mixers(holder)
    split = holder.mixer.in_proj
    x = torch.randn(2, 16, 32).bfloat16()
    runs = {}
    for name, autocast in (("one matmul", True), ("per component", False)):
        split.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), kept_for_backward() as kept, \
                OpOutputs() as seen:
            out = split(leaf) if autocast else torch.cat(
                [torch.nn.functional.linear(leaf, getattr(split, f"weight_{n}").bfloat16(),
                                            getattr(split, f"bias_{n}").bfloat16()) for n in split.component_sizes], -1)
        out.float().square().sum().backward()
        runs[name] = (out, leaf.grad, [p.grad.clone() for p in split.parameters()], sum(kept.values()),
                      sum("addmm" in op or "mm" in op for op in seen.ops))
    one, per = runs["one matmul"], runs["per component"]
    assert one[4] == 1 and per[4] == len(split.component_sizes)
    torch.testing.assert_close(one[0], per[0], rtol=0, atol=0)
    torch.testing.assert_close(one[1], per[1], rtol=1e-2, atol=1e-2)  # bf16 sums of products in another order
    for got, want in zip(one[2], per[2]):
        torch.testing.assert_close(got, want.float(), rtol=1e-2, atol=1e-2)
    assert one[3] == per[3]


def test_the_one_matmul_casts_exactly_what_autocast_would():
    """``autocast_narrowing`` follows autocast's rule: float32 (and float16) weights are cast to its dtype,
    float64 and weights already in it are not, and nothing is cast without autocast."""
    from hybridpar.models.precision import autocast_narrowing

    with torch.autocast("cpu", dtype=torch.bfloat16):
        for dtype in (torch.float32, torch.float16, torch.float64, torch.bfloat16):
            a, b = torch.ones(2, 3, dtype=dtype), torch.ones(3, 2, dtype=dtype)
            autocast_dtype = (a @ b).dtype
            assert autocast_narrowing("cpu", dtype) == (autocast_dtype if autocast_dtype != dtype else None), dtype
    assert autocast_narrowing("cpu", torch.float32) is None
