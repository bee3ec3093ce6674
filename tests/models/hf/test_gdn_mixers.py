"""hybridpar's gated DeltaNet core inside transformers' gated DeltaNet layers (``models/hf/mixers/gdn.py``).

Tiny float64 Qwen3-Next, Qwen3.5, Qwen3.5-MoE and OLMo-Hybrid models (``gdn_models.py``, chunks of 8
tokens): with the core installed and hybridpar's attention, a row packing three documents (one
shorter than a chunk, two crossing chunks) gives the loss and every parameter gradient of
transformers' own model (its torch gated delta rule, SDPA) run on the three documents one per row
(1e-9); our forward and gradients equal transformers' on unpacked rows (1e-10); the model is refused
for packing until the core is installed, and leaks without it; parameter names do not change; a
variant the core cannot run is refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hf.mixers.gdn import gdn_layers, install_gdn_core
from hybridpar.parallel.context.hf import attention_problem, unreached_token_mixers, use_hybridpar_attention
from tests.models.hf.gdn_models import GDN_MODELS, LAYERS, VOCAB, build_gdn
from tests.models.hf.packed_rows import assert_same, boundaries, packed_vs_alone, random_rows, relative

DOCS = (5, 14, 11)  # 5 < one chunk of 8; 14 and 11 cross chunk boundaries of the packed row


@pytest.mark.parametrize("name", GDN_MODELS)
def test_packed_row_equals_one_document_per_row(name):
    model = build_gdn(name)
    assert attention_problem(model) is not None and len(unreached_token_mixers(model)) == 2 * LAYERS  # A_log, conv1d
    names_before = [n for n, _ in model.named_parameters()]
    assert len(install_gdn_core(model)) == LAYERS and len(install_gdn_core(model)) == LAYERS  # idempotent
    assert [n for n, _ in model.named_parameters()] == names_before and len(gdn_layers(model)) == LAYERS
    assert attention_problem(model) is None and unreached_token_mixers(model) == []
    use_hybridpar_attention(model)
    reference = build_gdn(name)  # transformers' own model: its torch gated delta rule and SDPA, one document per row
    assert reference.config._attn_implementation == "sdpa"
    assert_same(*packed_vs_alone(model, reference, *random_rows(DOCS, VOCAB), boundaries(DOCS)), model, 1e-9)


@pytest.mark.parametrize("name", GDN_MODELS)
def test_core_equals_transformers_forward_on_unpacked_rows(name):
    reference, model = build_gdn(name, seed=2), build_gdn(name, seed=2)
    install_gdn_core(model)
    ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(4))
    want, got = reference(input_ids=ids).logits, model(input_ids=ids).logits
    assert relative(got, want) < 1e-10
    want.square().mean().backward()
    got.square().mean().backward()
    grads = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        assert relative(p.grad, grads[n].grad) < 1e-10, n


def test_transformers_forward_leaks_between_packed_documents():
    """Without the core the packed row is not each document alone (so the test above can fail)."""
    model = build_gdn("qwen3_next")
    use_hybridpar_attention(model)  # attention separates the documents; the gated DeltaNets do not
    (packed_loss, _), (alone_loss, _) = packed_vs_alone(model, model, *random_rows(DOCS, VOCAB), boundaries(DOCS))
    assert relative(packed_loss, alone_loss) > 1e-6


def test_unsupported_variant_is_refused():
    model = build_gdn("qwen3_next")
    model.model.layers[0].linear_attn.activation = "gelu"
    with pytest.raises(ValueError, match="activation 'gelu'.*SiLU only") as error:
        install_gdn_core(model)
    assert "\n" not in str(error.value)


def test_projection_of_another_width_is_refused():
    model = build_gdn("qwen3_5")
    layer = model.model.layers[2].linear_attn
    layer.in_proj_z = torch.nn.Linear(32, 16, bias=False, dtype=torch.float64)  # not Hv * dv = 32
    with pytest.raises(ValueError, match=r"'model.layers.2.linear_attn'.*expects widths \(64, 32, 4, 4\)") as error:
        install_gdn_core(model)
    assert "\n" not in str(error.value)


def test_several_documents_with_a_cache_are_refused():
    """With a cache transformers' own forward runs, which would not reset: refused, not silently leaked."""
    model = build_gdn("qwen3_next")
    install_gdn_core(model)
    use_hybridpar_attention(model)
    ids, _ = random_rows(DOCS, VOCAB)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(boundaries(DOCS), dtype=torch.int32))
    with pytest.raises(ValueError, match="several documents together with a cache") as error:
        model(input_ids=ids, position_ids=packed.position_ids[None], packed_seq_params=packed, use_cache=True)
    assert "\n" not in str(error.value)
