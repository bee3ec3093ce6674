"""hybridpar's Mamba core inside transformers' Mamba2-family mixers (``models/hf/mixers/mamba2.py``).

Tiny float64 models of every hybrid (``hybrid_models.py``): with the core installed and
hybridpar's attention, a row packing two documents gives the loss and every parameter gradient
of the two documents run one per row (1e-9); the same model without the core leaks (the test
can fail); our forward equals transformers' own torch forward on unpacked rows (1e-6: transformers
computes ``A = -exp(A_log)`` and its gated norm in float32); parameter names do not change.
"""

from __future__ import annotations

import pytest
import torch

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.mixers.mamba2 import bridged_mixers, install_mamba_core
from hybridpar.parallel.context.hf import attention_problem, use_hybridpar_attention
from tests.models.hf.hybrid_models import HYBRIDS, MIXERS, VOCAB, build_hybrid
from tests.models.hf.packed_rows import assert_same, boundaries, loss_and_grads, packed_vs_alone, random_rows, relative

DOCS = (10, 14)


@pytest.mark.parametrize("name", HYBRIDS)
def test_packed_rows_equal_one_document_per_row(name):
    model = build_hybrid(name)
    names = install_mamba_core(model)
    assert len(names) == MIXERS[name] and len(bridged_mixers(model)) == MIXERS[name]
    assert attention_problem(model) is None
    use_hybridpar_attention(model)
    assert_same(*packed_vs_alone(model, model, *random_rows(DOCS, VOCAB), boundaries(DOCS)), model, 1e-9)


@pytest.mark.parametrize("name", ["granite_moe", "zamba2"])
def test_without_our_core_transformers_leaks_across_packed_documents(name):
    model = build_hybrid(name).eval()
    ids, _ = random_rows(DOCS, VOCAB)
    positions = torch.cat([torch.arange(d) for d in DOCS])[None]
    packed = model(input_ids=ids, position_ids=positions).logits
    alone = torch.cat([model(input_ids=ids[:, :DOCS[0]]).logits, model(input_ids=ids[:, DOCS[0]:]).logits], 1)
    assert relative(packed, alone) > 1e-6  # the state of document 1 reaches document 2


@pytest.mark.parametrize("name", HYBRIDS)
def test_our_mixers_equal_transformers_torch_forward_and_keep_names(name):
    reference, model = build_hybrid(name), build_hybrid(name)
    keys = sorted(model.state_dict())
    install_mamba_core(model)
    assert sorted(model.state_dict()) == keys
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    want = reference(input_ids=ids).logits
    calls = []
    for _, mixer in bridged_mixers(model):
        core = mixer.core
        mixer.core = lambda *args, _core=core: calls.append(1) or _core(*args)
    got = model(input_ids=ids).logits
    assert len(calls) == MIXERS[name]  # every mixer ran our core
    assert relative(got, want) < 1e-6


def test_attention_of_every_hybrid_runs_through_our_core(monkeypatch):
    import hybridpar.parallel.context.hf as hf_cp

    seen, core = [], hf_cp.attention_core
    monkeypatch.setattr(hf_cp, "attention_core", lambda *a, **k: seen.append(1) or core(*a, **k))
    for name in HYBRIDS:
        model = build_hybrid(name)
        install_mamba_core(model)
        use_hybridpar_attention(model)
        seen.clear()
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
        assert seen, name


def test_an_unsupported_mixer_variant_is_refused():
    model = build_hybrid("bamba")
    next(m for _, m in model.named_modules() if type(m).__name__ == "BambaMixer").activation = "gelu"
    with pytest.raises(ValueError, match="activation 'gelu'"):
        install_mamba_core(model)


def test_mamba_heads_that_do_not_split_over_cp_are_refused_before_collectives():
    from hybridpar.parallel.context.attention import STRATEGIES as ATTENTION
    from hybridpar.parallel.context.hf import validate_hf_cp
    from hybridpar.parallel.context.recurrent.mamba import HiddenParallelMamba

    model = build_hybrid("bamba")  # 8 Mamba heads, 2 groups
    install_mamba_core(model)
    core = HiddenParallelMamba(None)
    core.cp_size = 3  # the rule as a 3-rank group would apply it (no group needed: no communication)
    with pytest.raises(ValueError, match=r"Mamba2 mixer 'model.layers.0.mamba' at cp=3, tp=1: .*not divisible by cp=3"):
        validate_hf_cp(model, ATTENTION["allgather"](None), 1, core)


@pytest.mark.parametrize("name", HYBRIDS)
def test_the_fused_path_inside_transformers_mixers_equals_the_pure_core(name):
    """Each hybrid's mixers with the fused Mamba path (FLA's contract standing in for the kernel, as
    on a GPU with fla-core) against the pure core: a packed row's loss and every gradient (1e-9);
    every mixer ran through the stand-in (its dt limits, groups and conv bias as the mixer has them)."""
    from hybridpar.models.mamba.fused import use_stand_in
    from hybridpar.models.mamba.fused_op import register_scan
    from tests.models.mamba.test_fused import simple_gla_contract

    calls = []
    register_scan("counted-hf", lambda *args, **kwargs: calls.append(1) or simple_gla_contract(*args, **kwargs))
    model = build_hybrid(name)
    install_mamba_core(model)
    use_hybridpar_attention(model)
    piece = [(*random_rows(DOCS, VOCAB), boundaries(DOCS))]
    pure = loss_and_grads(model, piece)
    with use_stand_in("counted-hf"):
        fused = loss_and_grads(model, piece)
    assert len(calls) == 2 * MIXERS[name]  # each mixer's forward and its backward's recompute
    assert_same(fused, pure, model, 1e-9)


def test_several_packed_documents_with_a_cache_are_refused_not_leaked():
    """With a cache, transformers' own forward runs (generation), and there packed documents see each other:
    a switched mixer refuses several documents with a cache in one line (``mixers/fallback.py``)."""
    model = build_hybrid("bamba")
    install_mamba_core(model)
    mixer = bridged_mixers(model)[0][1]
    hidden = torch.zeros(1, 12, model.config.hidden_size, dtype=torch.float64)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 5, 12], dtype=torch.int32))
    with pytest.raises(ValueError, match="several documents together with a cache"):
        mixer(hidden, cache_params=object(), packed_seq_params=packed)
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, :2] = 0  # left padding: transformers' forward, one document is fine
    assert mixer(hidden, attention_mask=mask).shape == hidden.shape
