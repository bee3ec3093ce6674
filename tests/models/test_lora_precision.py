"""LoRA on a bfloat16 base: float32 adapters (peft's ``autocast_adapter_dtype``), bf16 compute.

The frozen base stays bf16 (2 bytes per parameter); what trains keeps float32 weights and AdamW
state; the adapters' matmuls run in bf16 under autocast, so a float32 adapter computes exactly
what a bf16 copy of it computes (same logits, its gradient the bf16 copy's, widened), and no
float32 copy of a ``[tokens, in]`` input is saved for backward.
"""

from __future__ import annotations

import copy

import torch

from hybridpar.config import TrainConfig
from hybridpar.models.hybrid import HybridConfig, HybridLM
from hybridpar.models.lora import add_lora, adapter_dtype, is_lora_parameter
from hybridpar.train.optim import build_optimizer

TOKENS = 64


def _model(dtype: torch.dtype) -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny", dtype=dtype))
    add_lora(model, r=4, seed=1)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):  # B = 0 would hide the update
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def _loss(model: HybridLM, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids)[0]


def test_adapters_are_float32_on_a_bf16_base_and_keep_a_wider_base_dtype():
    assert adapter_dtype(torch.bfloat16) == adapter_dtype(torch.float16) == torch.float32
    assert adapter_dtype(torch.float64) == torch.float64 and adapter_dtype(torch.float32) == torch.float32
    model = _model(torch.bfloat16)
    dtypes = {(is_lora_parameter(n), p.dtype, p.requires_grad) for n, p in model.named_parameters()}
    assert dtypes == {(True, torch.float32, True), (False, torch.bfloat16, False)}
    ids = torch.randint(0, model.config.vocab_size, (1, TOKENS))
    _loss(model, ids).backward()
    optimizer = build_optimizer(model, TrainConfig())
    optimizer.step()
    states = [s for state in optimizer.state.values() for s in state.values() if torch.is_tensor(s) and s.dim()]
    assert states and {s.dtype for s in states} == {torch.float32}  # AdamW moments of the float32 masters
    assert {(n, p.dtype) for n, p in _model(torch.float64).named_parameters()} == \
        {(n, torch.float64) for n, _ in _model(torch.float64).named_parameters()}


def test_float32_adapters_compute_exactly_what_their_bf16_copies_compute():
    ours = _model(torch.bfloat16)
    twin = copy.deepcopy(ours)
    with torch.no_grad():
        for name, param in twin.named_parameters():
            if is_lora_parameter(name):
                param.data = param.data.to(torch.bfloat16)
    ids = torch.randint(0, ours.config.vocab_size, (1, TOKENS))
    loss, twin_loss = _loss(ours, ids), _loss(twin, ids)
    assert loss.dtype == twin_loss.dtype and torch.equal(loss, twin_loss)
    loss.backward()
    twin_loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    twin_grads = {n: p.grad for n, p in twin.named_parameters() if p.grad is not None}
    assert grads and set(grads) == set(twin_grads)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, name
        assert torch.equal(grad, twin_grads[name].float()), name


def test_no_float32_copy_of_an_adapter_input_is_saved():
    """peft casts the input up to the adapter's float32 (a ``[tokens, in]`` copy per adapter, kept for
    backward); here the matmuls run in bf16 and save the base layer's own bf16 input."""
    model = _model(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, TOKENS))
    widths = {m.lora_A.in_features for m in model.modules() if hasattr(m, "lora_A")}
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float32 and t.dim() >= 2 and t.shape[-2] == TOKENS and t.shape[-1] in widths:
            saved.append(tuple(t.shape))  # [..., tokens, in] in float32: an adapter input cast up
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(model, ids)
    assert not saved, f"float32 copies of adapter inputs saved for backward: {saved[:4]}"
