"""Models that scale or soft-cap their logits train on the chunked LM-head loss, exactly.

For tiny float64 Gemma 2, Gemma 3 (text), Cohere, Granite, Granite 4.0-H (GraniteMoeHybrid), Falcon-H1 and
RecurrentGemma, each with a transform that bends its logits (a small cap, a scale far from 1): the load-time
probe confirms ``logit_transform``'s ``(scale, cap)``, and the trainer's loss (``hf_loss_sum``) equals the
model's own cross entropy on its returned logits, and every parameter gradient, to 1e-12, while ``lm_head``
sees no position (``[1, 0, D]``: no ``[B, S, V]`` logits). A config field the forward does not follow is caught
by the probe and sends the loss through the logits. The tp=2 case is ``tests/distributed/tensor/test_hf_head_loss.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.hf.hybrid_models import build_hybrid
from tests.models.hf.rglru_models import build_recurrent_gemma
from tests.models.hf.tiny import perturbed_float64

VOCAB = 97
TOL = 1e-12
_ATTENTION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, use_cache=False)


def _eager(model):
    model.set_attn_implementation("eager")
    return model


def _falcon_h1(multiplier: float, forward_too: bool = True):
    model = build_hybrid("falcon_h1")
    model.config.lm_head_multiplier = multiplier
    if forward_too:  # the forward multiplies by the copy FalconH1Model took at init
        model.model.lm_head_multiplier = multiplier
    return model


def _granite_hybrid():
    model = build_hybrid("granite")
    model.config.logits_scaling = 3.0
    return model


def _recurrent_gemma():
    model = build_recurrent_gemma()
    model.config.logits_soft_cap = 1.5
    return model


def _build(name: str):
    import transformers as hf

    return {
        "gemma2": lambda: _eager(perturbed_float64(lambda: hf.Gemma2ForCausalLM(hf.Gemma2Config(
            final_logit_softcapping=1.5, **_ATTENTION)))),
        "gemma3": lambda: _eager(perturbed_float64(lambda: hf.Gemma3ForCausalLM(hf.Gemma3TextConfig(
            final_logit_softcapping=2.0, **_ATTENTION)))),
        "cohere": lambda: perturbed_float64(lambda: hf.CohereForCausalLM(hf.CohereConfig(logit_scale=3.0, **_ATTENTION))),
        "granite": lambda: perturbed_float64(lambda: hf.GraniteForCausalLM(hf.GraniteConfig(logits_scaling=0.25,
                                                                                            **_ATTENTION))),
        "granitemoehybrid": _granite_hybrid,
        "falcon_h1": lambda: _falcon_h1(0.4),
        "recurrent_gemma": _recurrent_gemma,
    }[name]()


TRANSFORMS = {  # model -> (scale, cap) its config fields map to
    "gemma2": (1.0, 1.5), "gemma3": (1.0, 2.0), "cohere": (3.0, None), "granite": (4.0, None),
    "granitemoehybrid": (1 / 3.0, None), "falcon_h1": (0.4, None), "recurrent_gemma": (1.0, 1.5),
}


def _loss_and_grads(model, loss_fn) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _head_inputs(model, run) -> list:
    """The shapes ``lm_head`` saw while ``run()`` ran."""
    shapes = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    try:
        run()
    finally:
        handle.remove()
    return shapes


def _check_equal(model, ids, labels, chunked: bool) -> None:
    from hybridpar.train.hf_model import hf_loss_sum

    def own():  # the model's own logits [1, S, V], its own transform
        logits = model(input_ids=ids, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits[0], labels[0], reduction="sum", ignore_index=-100)

    want, want_grads = _loss_and_grads(model, own)
    got = {}
    shapes = _head_inputs(model, lambda: got.update(zip(("loss", "grads"), _loss_and_grads(
        model, lambda: hf_loss_sum(model, ids, labels, {})[0]))))
    assert shapes == ([(1, 0, model.config.hidden_size)] if chunked else [tuple(ids.shape) + (model.config.hidden_size,)])
    assert abs(float(got["loss"] - want)) < TOL * float(want)
    assert sorted(got["grads"]) == sorted(want_grads) and len(want_grads) == len(list(model.parameters()))
    for name, grad in want_grads.items():
        assert (got["grads"][name] - grad).abs().max() <= TOL * max(grad.abs().max(), 1e-30), name


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_the_trainers_chunked_loss_equals_the_models_own_cross_entropy(name):
    from hybridpar.models.hf.logit_transform import logit_transform, probe_logits_after_head
    from hybridpar.train.hf_model import loss_path_line

    model = _build(name)
    assert logit_transform(model) == pytest.approx(TRANSFORMS[name])
    assert probe_logits_after_head(model) is None  # the returned logits are the mapping of lm_head's output
    assert loss_path_line(model).startswith("loss: chunked LM head + cross entropy on the logits ")
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    labels = torch.roll(ids, -1, 1)
    labels[0, 4] = labels[0, -1] = -100
    _check_equal(model, ids, labels, chunked=True)
    with torch.no_grad():  # the transform matters: the plain head's loss is 1e7 tolerances away
        hidden = {}
        handle = model.get_output_embeddings().register_forward_hook(lambda m, a, out: hidden.__setitem__("z", out))
        logits = model(input_ids=ids, use_cache=False).logits
        handle.remove()
        plain = torch.nn.functional.cross_entropy(hidden["z"][0], labels[0], reduction="sum", ignore_index=-100)
        capped = torch.nn.functional.cross_entropy(logits[0], labels[0], reduction="sum", ignore_index=-100)
    assert abs(float(plain - capped)) > 1e-5 * float(capped)


def test_a_field_the_forward_does_not_follow_keeps_the_logits_path():
    """Falcon-H1 multiplies by ``model.model.lm_head_multiplier``, a copy taken at init: a config changed after
    it claims a transform the forward does not apply. The probe catches it; the loss takes the logits (still
    exact), and the trainer's line says why. A forward that leaves the head's output as it is (the field applied
    to the head's input, as MiniCPM3's ``logits_scaling``, or not at all) is the identity on that output: the
    chunked loss, which reads the head's input, is exact with no transform."""
    from hybridpar.models.hf.logit_transform import logit_transform, probe_logits_after_head
    from hybridpar.train.hf_model import loss_path_line

    model = _falcon_h1(0.4, forward_too=False)
    model.model.lm_head_multiplier = 0.7
    found = probe_logits_after_head(model)
    assert "otherwise than 0.4 z (lm_head_multiplier=0.4) says" in found
    assert loss_path_line(model).startswith("loss: through the [tokens, vocabulary] logits, because FalconH1ForCausalLM")
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(6))
    _check_equal(model, ids, torch.roll(ids, -1, 1), chunked=False)

    model = _falcon_h1(0.4, forward_too=False)  # the forward multiplies by 1.0
    assert probe_logits_after_head(model) is None and logit_transform(model) == (1.0, None)
    assert loss_path_line(model).startswith("loss: chunked LM head + cross entropy (no [tokens, vocabulary] logits")
    _check_equal(model, ids, torch.roll(ids, -1, 1), chunked=True)


def test_the_mapping_of_config_fields_and_what_it_refuses():
    from types import SimpleNamespace

    from hybridpar.models.hf.logit_transform import describe_transform, logit_transform

    def model(**fields):
        return SimpleNamespace(config=SimpleNamespace(**fields))

    assert logit_transform(model()) == (1.0, None)
    assert logit_transform(model(logits_scaling=1.0, final_logit_softcapping=None)) == (1.0, None)
    assert logit_transform(model(logit_scale=0.5, final_logit_softcapping=30.0)) == (0.5, 30.0)  # scale, then cap
    assert describe_transform(0.5, 30.0) == "30 tanh(0.5 z / 30)" and describe_transform(0.25, None) == "0.25 z"
    for fields, message in [(dict(output_multiplier_scale=2.0), "does not map"),
                            (dict(logits_scaling=0.0), "finite scale > 0"), (dict(logit_scale=-1.0), "finite scale > 0"),
                            (dict(final_logit_softcapping=30.0, logits_soft_cap=30.0), "(or one cap)"),
                            (dict(lm_head_multiplier="2"), "lm_head_multiplier='2'")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            logit_transform(model(**fields))
