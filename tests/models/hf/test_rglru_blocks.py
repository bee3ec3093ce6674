"""RecurrentGemma's RG-LRU blocks on hybridpar's document-resetting conv and scan (``models/hf/mixers/rglru.py``),
float64, against transformers' own forward: one document, and a packed row (its local sliding-window MQA
on hybridpar's attention) against each of its documents alone, loss and every parameter gradient; transformers'
own forward leaks across the documents (its conv). The generation memory estimate counts its window-bounded K/V
cache and the RG-LRU blocks' recurrent and conv states."""

from __future__ import annotations

import pytest
import torch

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.mixers.rglru import install_rglru_core, rglru_blocks, rglru_tp_problem
from hybridpar.parallel.context.hf import attention_problem, unreached_token_mixers, use_hybridpar_attention
from tests.models.hf.rglru_models import VOCAB, WINDOW, build_recurrent_gemma


def _loss_and_grads(model, ids, cu, labels=None):
    """Summed loss (labels: ``ids`` rolled within the row unless given) and every parameter gradient."""
    model.zero_grad()
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(cu, dtype=torch.int32))
    logits = model(input_ids=ids, position_ids=packed.position_ids.view(1, -1), packed_seq_params=packed,
                   use_cache=False).logits
    labels = torch.roll(ids, -1, 1) if labels is None else labels
    loss = torch.nn.functional.cross_entropy(logits[0], labels[0], reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative(got, want):
    return float((got - want).abs().max() / want.abs().max().clamp_min(1.0))


def test_switched_blocks_equal_transformers_on_one_document():
    reference, ours = build_recurrent_gemma(), build_recurrent_gemma()
    assert install_rglru_core(ours) == ["model.layers.0.temporal_block", "model.layers.1.temporal_block"]
    ids = torch.randint(3, VOCAB, (1, 19), generator=torch.Generator().manual_seed(1))
    want, want_grads = _loss_and_grads(reference, ids, [0, 19])
    got, grads = _loss_and_grads(ours, ids, [0, 19])
    assert _relative(got, want) < 1e-12
    assert sorted(grads) == sorted(want_grads) == sorted(n for n, _ in ours.named_parameters())
    assert max(_relative(grads[n], g) for n, g in want_grads.items()) < 1e-12


def test_a_packed_row_equals_each_document_alone_and_transformers_leaks():
    model = build_recurrent_gemma()
    leaky = build_recurrent_gemma()
    assert "temporal_block.conv_1d" in attention_problem(leaky)  # not switched: refused
    install_rglru_core(model)
    assert unreached_token_mixers(model) == [] and attention_problem(model) is None
    use_hybridpar_attention(model)  # the local MQA layer: document-causal, window WINDOW, partial RoPE
    cu = [0, 11, 12, 30]  # a one-token document; the last is longer than the window
    assert cu[-1] - cu[-2] > 2 * WINDOW
    ids = torch.randint(3, VOCAB, (1, cu[-1]), generator=torch.Generator().manual_seed(2))
    labels = torch.cat([torch.roll(ids[:, a:b], -1, 1) for a, b in zip(cu[:-1], cu[1:])], 1)
    packed, packed_grads = _loss_and_grads(model, ids, cu, labels)
    alone, alone_grads = torch.zeros((), dtype=torch.float64), {}
    reference = build_recurrent_gemma()  # transformers' own forward (sdpa) on each document alone
    for a, b in zip(cu[:-1], cu[1:]):
        loss, grads = _loss_and_grads(reference, ids[:, a:b], [0, b - a])
        alone = alone + loss
        for n, g in grads.items():
            alone_grads[n] = alone_grads.get(n, 0) + g
    assert _relative(packed, alone) < 1e-12
    assert sorted(packed_grads) == sorted(alone_grads)
    assert max(_relative(packed_grads[n], g) for n, g in alone_grads.items()) < 1e-12
    leaked, _ = _loss_and_grads(leaky, ids, cu, labels)  # its RG-LRU resets at position 0, its conv does not
    assert _relative(leaked, alone) > 1e-6  # far above float64 rounding (the exact run: < 1e-12)
    assert rglru_tp_problem(model, 1) is None and len(rglru_blocks(model)) == 2


def test_the_trainers_loss_keeps_the_soft_capped_logits():
    """RecurrentGemma soft-caps its logits (``logits_soft_cap``): the trainer's loss takes the cap (the chunked
    loss on ``c tanh(z / c)``, ``tests/models/hf/test_logit_transforms.py``) and equals the model's own cross entropy."""
    from hybridpar.train.hf_model import hf_loss_sum

    model = build_recurrent_gemma()
    install_rglru_core(model)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    labels = torch.roll(ids, -1, 1)
    got, _ = hf_loss_sum(model, ids, labels, {})  # before the fix: the head seam, no soft cap (8e-4 off here)
    logits = model(input_ids=ids, use_cache=False).logits
    assert logits.abs().max() < model.config.logits_soft_cap
    want = torch.nn.functional.cross_entropy(logits[0], labels[0], reduction="sum")
    assert abs(float(got.detach() - want.detach())) < 1e-12 * float(want.detach())


def test_a_logit_transform_under_an_unlisted_name_is_found_by_the_probe(monkeypatch):
    """A soft cap under a config field ``LOGIT_TRANSFORMS`` does not name (here: the list without
    RecurrentGemma's ``logits_soft_cap``) is still found: the probe sees the returned logits differ from
    lm_head's output, and the trainer's loss goes through the logits. A plain head probes clean."""
    from hybridpar.models.hf import causal_lm
    from hybridpar.train.hf_model import hf_loss_sum

    from hybridpar.models.hf import logit_transform

    monkeypatch.setattr(logit_transform, "LOGIT_TRANSFORMS",
                        {k: v for k, v in logit_transform.LOGIT_TRANSFORMS.items() if k != "logits_soft_cap"})
    model = build_recurrent_gemma()
    install_rglru_core(model)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    labels = torch.roll(ids, -1, 1)
    unprobed, _ = hf_loss_sum(model, ids, labels, {})  # the head seam: no soft cap
    assert "changes lm_head's output" in causal_lm.probe_logits_after_head(model)
    got, _ = hf_loss_sum(model, ids, labels, {})
    want = torch.nn.functional.cross_entropy(model(input_ids=ids, use_cache=False).logits[0], labels[0], reduction="sum")
    assert abs(float(got.detach() - want.detach())) < 1e-12 * float(want.detach())
    assert abs(float(unprobed.detach() - want.detach())) > 1e-6 * float(want.detach())  # what the probe prevents
    from transformers import LlamaConfig, LlamaForCausalLM

    plain = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert causal_lm.probe_logits_after_head(plain) is None


def test_several_documents_with_a_cache_are_refused():
    model = build_recurrent_gemma()
    install_rglru_core(model)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 5, 12], dtype=torch.int32))
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, position_ids=packed.position_ids.view(1, -1), packed_seq_params=packed, use_cache=True)


def test_generation_memory_counts_the_window_bounded_cache_and_the_recurrent_states():
    """``transformers_generation_bytes`` of RecurrentGemma: its local MQA layer keeps at most ``WINDOW`` tokens of K
    and V, each RG-LRU block a float32 state ``[B, Cd]`` and a conv state ``[B, Cd, K-1]`` (before: neither was
    counted, the attention skipped as "Recurrent"); past the window only the token ids and a Python object per
    step grow."""
    import transformers as hf

    from hybridpar.models.generation import transformers_generation_bytes

    config = build_recurrent_gemma().config
    with torch.device("meta"):
        model = hf.RecurrentGemmaForCausalLM(config)  # float32: 4 bytes
    batch, prompt, head_dim, width, kernel = 2, 10, config.head_dim, config.lru_width, config.conv1d_width
    cache = batch * WINDOW * 2 * head_dim * 4 + 2 * batch * width * (4 + (kernel - 1) * 4)  # 1 MQA layer, 2 blocks
    widest = max(m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head)

    def rest(new):  # prefill, the last logits, the token ids and a Python object per step
        return 2 * batch * prompt * widest * 4 + batch * VOCAB * 8 + 2 * batch * (prompt + new) * 8 + 512 * new

    for new in (1, 10**3, 10**6):
        assert transformers_generation_bytes(model, batch, prompt, new) == cache + rest(new)
