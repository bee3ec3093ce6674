"""HybridLM: presets, validation, and exact document isolation on packed rows."""

import pytest
import torch

import hybridpar
from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hybrid import PRESETS, HybridConfig, HybridLM


def tiny_model(**overrides) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(HybridConfig.from_preset("tiny", dtype=torch.float64, **overrides))


def test_exports_and_logits_shape():
    assert hybridpar.HybridLM is HybridLM and hybridpar.HybridConfig is HybridConfig
    model = tiny_model()
    logits = model(torch.randint(0, 256, (2, 21)))
    assert logits.shape == (2, 21, 256) and logits.dtype == torch.float64


def test_inputs_embeds_path_equals_ids_path():
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 10))
    torch.testing.assert_close(model(inputs_embeds=model.backbone.embeddings(ids)), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("lengths", [[16, 5, 32, 11], [7, 1, 30, 26]])  # 16-token chunks: edges and insides
def test_packed_batch_equals_documents_one_by_one(lengths):
    model = tiny_model(pattern="M*-M*-")
    ids = torch.randint(0, 256, (1, sum(lengths)))
    cu = torch.tensor([0] + lengths).cumsum(0)
    packed_logits = model(ids, packed=PackedSeqParams.from_cu_seqlens(cu))
    upstream = torch.randn_like(packed_logits)
    packed_grads = torch.autograd.grad((packed_logits * upstream).sum(), list(model.parameters()))

    alone_logits = torch.cat([model(ids[:, s:e]) for s, e in zip(cu[:-1], cu[1:])], dim=1)
    alone_grads = torch.autograd.grad((alone_logits * upstream).sum(), list(model.parameters()))
    torch.testing.assert_close(packed_logits, alone_logits, rtol=1e-10, atol=1e-10)
    for (name, _), packed_grad, alone_grad in zip(model.named_parameters(), packed_grads, alone_grads):
        torch.testing.assert_close(packed_grad, alone_grad, rtol=1e-10, atol=1e-10, msg=name)


def test_presets_build_valid_configs():
    for name in PRESETS:
        config = HybridConfig.from_preset(name)
        assert set(config.pattern) <= set("M*-")
    assert HybridConfig.from_preset("nemotronh-8b").mamba_intermediate_size == 8192


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(pattern="M*x"), "unknown characters"),
        (dict(pattern=""), "must be a non-empty string"),
        (dict(mamba_num_heads=6, mamba_n_groups=4), "divisible by mamba_n_groups"),
        (dict(num_attention_heads=6, num_key_value_heads=4), "divisible by num_key_value_heads"),
        (dict(hidden_size=0), "positive integer"),
        (dict(not_a_field=1), "unknown HybridConfig fields"),
    ],
)
def test_bad_configs_raise_value_error_with_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        HybridConfig.from_preset("tiny", **overrides)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="choose one of"):
        HybridConfig.from_preset("huge")
