"""Mamba1 mixers (Jamba, FalconMamba, Mamba) on hybridpar's document-resetting selective scan
(``models/hf/mixers/mamba1.py``), float64, against transformers' own forward: one document, and a
packed row against each of its documents alone (loss and every parameter gradient)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.float64 import keep_float64
from hybridpar.models.linear.selective_scan import document_resets, selective_scan
from hybridpar.models.hf.mixers.mamba1 import install_mamba1_core, mamba1_tp_problem, mamba1_mixers
from hybridpar.parallel.context.hf import attention_problem, use_hybridpar_attention

VOCAB = 97
_C = dict(hidden_size=32, vocab_size=VOCAB, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _config(hf, name: str):
    if name == "jamba":  # attention every other layer, MoE on layer 1, Mamba1 with dt/B/C RMSNorms
        return hf.JambaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                              attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                              num_experts=4, num_experts_per_tok=2, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
                              mamba_dt_rank=6, **_C)
    if name == "falcon_mamba":  # weightless RMS on dt, B, C
        return hf.FalconMambaConfig(num_hidden_layers=2, state_size=4, conv_kernel=3, expand=2, time_step_rank=6,
                                    use_conv_bias=True, **_C)
    return hf.MambaConfig(num_hidden_layers=2, state_size=4, conv_kernel=4, expand=2, time_step_rank=6, use_bias=True,
                          **_C)


def _model(name: str):
    import transformers as hf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf.AutoModelForCausalLM.from_config(_config(hf, name)).to(torch.float64)
    if type(model)._can_set_experts_implementation():
        model.set_experts_implementation("eager")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return keep_float64(model.train())


def _loss_and_grads(model, ids, labels, cu):
    model.zero_grad()
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(cu, dtype=torch.int32))
    logits = model(input_ids=ids, position_ids=packed.position_ids.view(1, -1), packed_seq_params=packed).logits
    loss = torch.nn.functional.cross_entropy(logits[0], labels[0], reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative(got, want):
    return float((got - want).abs().max() / want.abs().max().clamp_min(1.0))


@pytest.mark.parametrize("name", ["jamba", "falcon_mamba", "mamba"])
def test_switched_mixers_equal_transformers_on_one_document(name):
    reference, ours = _model(name), _model(name)
    assert len(install_mamba1_core(ours)) == {"jamba": 1, "falcon_mamba": 2, "mamba": 2}[name]
    ids = torch.randint(3, VOCAB, (1, 19), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    want, want_grads = _loss_and_grads(reference, ids, labels, [0, 19])
    got, grads = _loss_and_grads(ours, ids, labels, [0, 19])
    assert _relative(got, want) < 1e-12
    assert sorted(grads) == sorted(want_grads) == sorted(n for n, _ in ours.named_parameters())
    assert max(_relative(grads[n], g) for n, g in want_grads.items()) < 1e-12


def test_a_packed_jamba_row_equals_each_document_alone_and_transformers_leaks():
    model = _model("jamba")
    install_mamba1_core(model)
    assert attention_problem(model) is None
    use_hybridpar_attention(model)
    cu = [0, 11, 12, 30]
    ids = torch.randint(3, VOCAB, (1, cu[-1]), generator=torch.Generator().manual_seed(2))
    labels = torch.roll(ids, -1, 1)
    packed, packed_grads = _loss_and_grads(model, ids, labels, cu)
    alone, alone_grads = torch.zeros(()), {}
    for a, b in zip(cu[:-1], cu[1:]):
        loss, grads = _loss_and_grads(model, ids[:, a:b], labels[:, a:b], [0, b - a])
        alone = alone + loss
        for n, g in grads.items():
            alone_grads[n] = alone_grads.get(n, 0) + g
    assert _relative(packed, alone) < 1e-12
    assert max(_relative(packed_grads[n], g) for n, g in alone_grads.items()) < 1e-12
    leaky = _model("jamba")  # transformers' own mixers run across the documents: refused, and they do leak
    assert "Mamba1" in attention_problem(leaky)
    assert _relative(_loss_and_grads(leaky, ids, labels, cu)[0], alone) > 1e-3
    assert mamba1_tp_problem(model, 1) is None and mamba1_tp_problem(model, 2) is None  # channels over tp, any cp
    assert "d_inner=64 channels, not divisible by tp=3" in mamba1_tp_problem(model, 3)
    assert mamba1_mixers(model)


def test_the_chunked_scan_equals_the_recurrence_token_by_token_across_chunks_and_documents():
    gen = torch.Generator().manual_seed(0)
    rows, length, channels, state = 2, 37, 6, 4
    x, B, C = (torch.randn(rows, length, n, dtype=torch.float64, generator=gen).requires_grad_()
               for n in (channels, state, state))
    dt = torch.rand(rows, length, channels, dtype=torch.float64, generator=gen).requires_grad_()
    A = (-2 * torch.rand(channels, state, dtype=torch.float64, generator=gen)).requires_grad_()
    reset = document_resets(torch.tensor([0, 10, 11, 30, 37]), length, "cpu")  # boundaries off the chunk edges

    def recurrence():
        h, ys = torch.zeros(rows, channels, state, dtype=torch.float64), []
        for t in range(length):
            h = torch.exp(dt[:, t, :, None] * A) * h * (not reset[t]) + (dt[:, t] * x[:, t])[..., None] * B[:, t, None]
            ys.append(torch.einsum("rcn,rn->rc", h, C[:, t]))
        return torch.stack(ys, 1)

    weight = torch.randn(rows, length, channels, dtype=torch.float64, generator=gen)
    inputs = (x, dt, A, B, C)
    got = selective_scan(x, dt, A, B, C, reset, chunk=8)
    want = recurrence()
    assert (got - want).abs().max() < 1e-12
    for g, w in zip(torch.autograd.grad((got * weight).sum(), inputs), torch.autograd.grad((want * weight).sum(), inputs)):
        assert (g - w).abs().max() < 1e-12
    # states at a token continue its document exactly when they enter the rest (context parallelism's use)
    one = [t[:1].detach() for t in (x, dt, B, C)]
    whole = selective_scan(one[0], one[1], A.detach(), one[2], one[3], reset, chunk=8)
    cut = 20  # inside the document [11, 30)
    first, states = selective_scan(*(t[:, :cut] for t in one[:2]), A.detach(), *(t[:, :cut] for t in one[2:]),
                                   reset[:cut], chunk=8, final_at=torch.tensor([9, cut - 1]))
    rest_reset = reset[cut:].clone()
    rest_reset[0] = True
    rest = selective_scan(*(t[:, cut:] for t in one[:2]), A.detach(), *(t[:, cut:] for t in one[2:]), rest_reset,
                          chunk=8, init_states=states[1:], init_at=torch.tensor([0]))
    assert (torch.cat([first, rest], 1) - whole).abs().max() < 1e-12
