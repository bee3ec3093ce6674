"""hybridpar's KDA core inside transformers' Kimi Delta Attention layers (``models/hf/mixers/kda.py``).

A tiny float64 Kimi Linear (``kda_models.py``: KDA, MLA with MoE, KDA with MoE; chunks of 8 tokens):
with the core installed and hybridpar's attention on its MLA layer, a row packing three documents
(one shorter than a chunk, two crossing chunks) gives the loss and every parameter gradient of
transformers' own model (its torch KDA, SDPA) run on the three documents one per row (1e-9); our
forward and gradients equal transformers' on unpacked rows (1e-10); the model is refused for packing
until the core is installed, and its own KDA leaks without it; parameter names do not change; a
variant the core cannot run is refused in one line (tensor parallelism: tests/distributed/context/test_hf_kda.py);
generation (a cache) runs transformers' forward unchanged, and several packed documents with a cache are refused.
"""

from __future__ import annotations

import pytest
import torch

from hybridpar.models.hf.mixers.kda import install_kda_core, kda_layers
from hybridpar.parallel.context.hf import (attention_problem, hf_attention_modules, unreached_token_mixers,
                                           use_hybridpar_attention)
from tests.models.hf.kda_models import LAYERS, VOCAB, build_kda
from tests.models.hf.packed_rows import assert_same, boundaries, packed_vs_alone, random_rows, relative
from tests.models.hf.test_gdn_mixers import DOCS


def test_packed_row_equals_one_document_per_row():
    model = build_kda()
    assert attention_problem(model) is not None and len(unreached_token_mixers(model)) == 2 * LAYERS  # conv1d, gate
    names_before = [n for n, _ in model.named_parameters()]
    assert len(install_kda_core(model)) == LAYERS and len(install_kda_core(model)) == LAYERS  # idempotent
    assert [n for n, _ in model.named_parameters()] == names_before and len(kda_layers(model)) == LAYERS
    assert attention_problem(model) is None and unreached_token_mixers(model) == []
    assert [n for n, _ in hf_attention_modules(model)] == ["model.layers.1.self_attn"]  # the MLA layer only
    use_hybridpar_attention(model)
    reference = build_kda()  # transformers' own model: its torch KDA and SDPA, one document per row
    assert reference.config._attn_implementation == "sdpa"
    assert_same(*packed_vs_alone(model, reference, *random_rows(DOCS, VOCAB), boundaries(DOCS)), model, 1e-9)


def test_core_equals_transformers_forward_on_unpacked_rows():
    reference, model = build_kda(seed=2), build_kda(seed=2)
    install_kda_core(model)
    ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(4))
    want, got = reference(input_ids=ids).logits, model(input_ids=ids).logits
    assert relative(got, want) < 1e-10
    want.square().mean().backward()
    got.square().mean().backward()
    grads = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        assert relative(p.grad, grads[n].grad) < 1e-10, n


def test_transformers_kda_leaks_between_packed_documents():
    """Without the core the packed row is not each document alone (so the test above can fail)."""
    model = build_kda()
    use_hybridpar_attention(model)  # the MLA layer separates the documents; transformers' KDA does not
    (packed_loss, _), (alone_loss, _) = packed_vs_alone(model, model, *random_rows(DOCS, VOCAB), boundaries(DOCS))
    assert relative(packed_loss, alone_loss) > 1e-6


def test_unsupported_variant_is_refused():
    model = build_kda()
    model.model.layers[2].self_attn.activation = "gelu"
    with pytest.raises(ValueError, match="'model.layers.2.self_attn'.*activation 'gelu'.*SiLU only") as error:
        install_kda_core(model)
    assert "\n" not in str(error.value)


def test_packing_rule_takes_the_switched_model():
    from hybridpar.train.packing_rule import leak_probe, packing_line, packing_problem

    model = build_kda()
    assert "model.layers.0.self_attn.conv1d (Conv1d)" in packing_problem(model)
    install_kda_core(model)
    use_hybridpar_attention(model)
    assert packing_problem(model) is None and leak_probe(model, VOCAB) < 1e-12
    line = packing_line(model, None, 0.1, 64)
    assert line.startswith("packing: several documents per row") and "Mamba" not in line
    assert "attention core on 1 attention modules" in line and "KDA core on 2 Kimi Delta Attention layers" in line


def test_generation_keeps_transformers_forward():
    """With a cache the switched layers run transformers' own forward: generation is unchanged."""
    reference, model = build_kda(seed=5).eval(), build_kda(seed=5).eval()
    install_kda_core(model)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(6))
    kwargs = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))


def test_several_documents_with_a_cache_are_refused():
    """With a cache transformers' own forward runs, which would not reset: refused, not silently leaked."""
    from hybridpar.data.thd import PackedSeqParams

    model = build_kda()
    install_kda_core(model)
    use_hybridpar_attention(model)
    ids, _ = random_rows(DOCS, VOCAB)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(boundaries(DOCS), dtype=torch.int32))
    with pytest.raises(ValueError, match="several documents together with a cache") as error:
        model(input_ids=ids, position_ids=packed.position_ids[None], packed_seq_params=packed, use_cache=True)
    assert "\n" not in str(error.value)
