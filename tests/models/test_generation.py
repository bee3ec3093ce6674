"""Cached generation for HybridLM: the cache reproduces the full forward, token by token.

A float64 model with every block kind (Mamba2 with grouped B/C and a dt limit, attention
with partial RoPE and GQA, MLP): 32 greedy tokens from the cache equal those of re-running
the full forward on the growing sequence, and every step's logits match it to 1e-10.
Exported Mamba2 and NemotronH checkpoints generate the same greedy tokens as transformers'
own ``generate`` on the same checkpoint.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from hybridpar.models.generation import decode_step, generate, prefill, sample_next
from hybridpar.models.hf.checkpoint import load_hf, save_hf
from hybridpar.models.hybrid import HybridConfig, HybridLM

NEW_TOKENS = 32


def every_kind_model(**overrides) -> HybridLM:
    torch.manual_seed(0)
    config = HybridConfig.from_preset(
        "tiny", pattern="M*-M*-", dtype=torch.float64, chunk_size=4, rotary_fraction=0.5,
        time_step_limit=(0.01, 2.0), **overrides,
    )
    model = HybridLM(config)
    with torch.no_grad():  # distinct norms and biases; sharper logits so greedy choices are clear
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
        model.lm_head.weight.mul_(20.0)
    return model


def test_cached_greedy_equals_full_forward_on_the_growing_sequence():
    model = every_kind_model()
    prompt = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))  # 7: not a chunk multiple
    logits, cache = prefill(model, prompt)
    torch.testing.assert_close(logits, model(prompt), rtol=1e-10, atol=1e-10)
    sequence = prompt
    for _ in range(NEW_TOKENS):
        full = model(sequence)[:, -1]
        torch.testing.assert_close(logits[:, -1], full, rtol=1e-10, atol=1e-10)
        next_ids = full.argmax(-1)
        assert torch.equal(logits[:, -1].argmax(-1), next_ids)
        sequence = torch.cat([sequence, next_ids[:, None]], dim=1)
        logits = decode_step(model, next_ids[:, None], cache)
    assert cache.length == prompt.shape[1] + NEW_TOKENS
    generated = model.generate(prompt, NEW_TOKENS)
    assert torch.equal(generated, sequence)
    assert len(set(generated[0, 7:].tolist())) > 3  # not a degenerate constant sequence


def test_eos_stops_rows_and_sampling_is_seeded():
    model = every_kind_model()
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    greedy = model.generate(prompt, 12)[:, 5:]
    eos = int(greedy[0, 2])  # row 0 emits it by its third new token
    stopped = model.generate(prompt, 12, eos_token_id=[eos])[:, 5:]
    ends = [int((row == eos).nonzero()[0, 0]) + 1 if (row == eos).any() else None for row in greedy]
    assert stopped.shape[1] == (max(ends) if None not in ends else 12)
    for row, end in enumerate(ends):  # each row: greedy up to its first eos, then eos only
        end = end or 12
        assert torch.equal(stopped[row, :end], greedy[row, :end]) and (stopped[row, end:] == eos).all()
    a = model.generate(prompt, 10, temperature=0.8, top_p=0.9, seed=7)
    b = model.generate(prompt, 10, temperature=0.8, top_p=0.9, seed=7)
    assert torch.equal(a, b) and a.shape == (2, 15)
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generator = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, top_p=0.7, generator=generator)) for _ in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    draws = {int(sample_next(logits, 1.0, top_p=0.01, generator=generator)) for _ in range(50)}
    assert draws == {0}


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=-1), "max_new_tokens=-1"),
    (dict(max_new_tokens=4, temperature=-0.5), "temperature=-0.5"),
    (dict(max_new_tokens=4, top_p=0.0), "top_p=0.0"),
])
def test_bad_arguments_are_value_errors(kwargs, message):
    model = every_kind_model()
    with pytest.raises(ValueError, match=message):
        model.generate(torch.zeros(1, 3, dtype=torch.long), **kwargs)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        generate(model, torch.full((1, 3), 300), 2)
    with pytest.raises(ValueError, match=r"expected integer \[B, S\]"):
        generate(model, torch.zeros(3, dtype=torch.long), 2)


# transformers 5.23's Mamba2 and NemotronH decode steps (``selective_state_update``) drop the dt
# clamp their full forward applies (time_step_limit / time_step_min), so their cached generation
# differs from their own forward wherever the clamp binds. These checkpoints keep dt inside the
# limits; where a clamp binds, ours follows the full forward (test above).
HF_SHAPES = {
    "Mamba2ForCausalLM": dict(pattern="MMM"),
    "NemotronHForCausalLM": dict(pattern="M*-M-", rotary_fraction=0.0, time_step_limit=(1e-6, float("inf"))),
}


@pytest.mark.parametrize("architecture", sorted(HF_SHAPES))
def test_greedy_equals_transformers_generate_on_the_exported_checkpoint(architecture, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = HybridConfig.from_preset("tiny", dtype=torch.float64, chunk_size=4, **HF_SHAPES[architecture])
    model = HybridLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
        model.lm_head.weight.mul_(20.0)
    save_hf(model, tmp_path, architecture=architecture)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, local_files_only=True).eval()
    prompt = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    expected = theirs.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = load_hf(tmp_path).generate(prompt, NEW_TOKENS)
    assert expected.shape == (2, 7 + NEW_TOKENS)
    assert torch.equal(ours, expected)
