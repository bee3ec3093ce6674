"""``keep_float64``: transformers' float32 casts stay float64 in a float64 model (``models/hf/float64.py``)."""

from __future__ import annotations

import torch

from hybridpar.models.hf.float64 import KeepFloat64, keep_float64


def test_float32_casts_of_float64_tensors_stay_float64():
    x = torch.randn(3, 5, dtype=torch.float64)
    with KeepFloat64():
        assert x.to(torch.float32).dtype == torch.float64 and x.float().dtype == torch.float64
        assert x.to("cpu", torch.float32).dtype == torch.float64 and x.to(dtype=torch.float32).dtype == torch.float64
        assert x.type(torch.float32).dtype == torch.float64
        assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float64
        assert x.to(torch.float16).dtype == torch.float16  # other casts unchanged
        assert torch.randn(2, dtype=torch.float32).to(torch.float32).dtype == torch.float32
    assert x.float().dtype == torch.float32  # only inside the mode


def test_a_float64_transformers_norm_computes_in_float64():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(64).to(torch.float64)
    with torch.no_grad():
        norm.weight.add_(torch.randn(64, dtype=torch.float64))
    x = torch.randn(4, 64, dtype=torch.float64)
    want = norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    assert (norm(x) - want).abs().max() > 1e-12  # transformers: float32 inside
    keep_float64(norm)
    assert (norm(x) - want).abs().max() < 1e-14
