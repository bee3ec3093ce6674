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
from hybridpar.parallel.context.inputs import shard_inputs
from hybridpar.train.trainer import pack_loss_sum
from tests.models.hf.gdn_models import GDN_MODELS, LAYERS, VOCAB, build_gdn

DOCS = (5, 14, 11)  # 5 < one chunk of 8; 14 and 11 cross chunk boundaries of the packed row


def _rows():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, sum(DOCS)), generator=gen)
    labels = torch.randint(0, VOCAB, (1, sum(DOCS)), generator=gen)
    labels[:, ::5] = -100
    return ids, labels


def _loss_and_grads(model, pieces):
    model.zero_grad()
    total = 0
    for ids, labels, cu in pieces:
        packed = PackedSeqParams.from_cu_seqlens(torch.tensor(cu, dtype=torch.int32))
        loss, _ = pack_loss_sum(model, shard_inputs(input_ids=ids, labels=labels, packed=packed))
        loss.backward()
        total = total + loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative(got, want):
    return float((got - want).detach().abs().max() / want.detach().abs().max().clamp_min(1.0))


@pytest.mark.parametrize("name", GDN_MODELS)
def test_packed_row_equals_one_document_per_row(name):
    model = build_gdn(name)
    assert attention_problem(model) is not None and len(unreached_token_mixers(model)) == 2 * LAYERS  # A_log, conv1d
    names_before = [n for n, _ in model.named_parameters()]
    assert len(install_gdn_core(model)) == LAYERS and len(install_gdn_core(model)) == LAYERS  # idempotent
    assert [n for n, _ in model.named_parameters()] == names_before and len(gdn_layers(model)) == LAYERS
    assert attention_problem(model) is None and unreached_token_mixers(model) == []
    use_hybridpar_attention(model)
    ids, labels = _rows()
    cu = [0, *torch.tensor(DOCS).cumsum(0).tolist()]
    packed_loss, packed_grads = _loss_and_grads(model, [(ids, labels, cu)])
    reference = build_gdn(name)  # transformers' own model: its torch gated delta rule and SDPA, one document per row
    alone_loss, alone_grads = _loss_and_grads(
        reference, [(ids[:, a:b], labels[:, a:b], [0, b - a]) for a, b in zip(cu[:-1], cu[1:])])
    assert reference.config._attn_implementation == "sdpa"
    assert _relative(packed_loss, alone_loss) < 1e-9
    assert set(packed_grads) == {n for n, _ in model.named_parameters()}
    for n, grad in packed_grads.items():
        assert _relative(grad, alone_grads[n]) < 1e-9, n


@pytest.mark.parametrize("name", GDN_MODELS)
def test_core_equals_transformers_forward_on_unpacked_rows(name):
    reference, model = build_gdn(name, seed=2), build_gdn(name, seed=2)
    install_gdn_core(model)
    ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(4))
    want, got = reference(input_ids=ids).logits, model(input_ids=ids).logits
    assert _relative(got, want) < 1e-10
    want.square().mean().backward()
    got.square().mean().backward()
    grads = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        assert _relative(p.grad, grads[n].grad) < 1e-10, n


def test_transformers_forward_leaks_between_packed_documents():
    """Without the core the packed row is not each document alone (so the test above can fail)."""
    model = build_gdn("qwen3_next")
    use_hybridpar_attention(model)  # attention separates the documents; the gated DeltaNets do not
    ids, labels = _rows()
    cu = [0, *torch.tensor(DOCS).cumsum(0).tolist()]
    packed_loss, _ = _loss_and_grads(model, [(ids, labels, cu)])
    alone_loss, _ = _loss_and_grads(model, [(ids[:, a:b], labels[:, a:b], [0, b - a]) for a, b in zip(cu[:-1], cu[1:])])
    assert _relative(packed_loss, alone_loss) > 1e-6


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
    ids, _ = _rows()
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32))
    with pytest.raises(ValueError, match="several documents together with a cache") as error:
        model(input_ids=ids, position_ids=packed.position_ids[None], packed_seq_params=packed, use_cache=True)
    assert "\n" not in str(error.value)
