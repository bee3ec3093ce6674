"""LFM2's gated short convolutions on hybridpar's document-resetting conv (``models/hf/mixers/short_conv.py``).

Tiny float64 LFM2, LFM2-MoE and LFM3 (``lfm_models.py``): the switched forward equals transformers'
own on one document (1e-12, loss and every gradient); a packed row of three documents through
hybridpar's attention and short conv, entered as context parallelism enters it (``apply_hf_cp`` on a
group of one), equals transformers' own model (SDPA) on each document alone (loss and every
parameter gradient, 1e-12), which proves the attention types too; transformers' own conv leaks.
Recognition is by structure (idempotent, parameter names unchanged), the packing rule then takes
the model, and a non-causal variant is refused.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.tensor.hf_models import relative_error
from tests.models.hf.lfm_models import NAMES, VOCAB, build_lfm

TOL = 1e-12
DOCS = [0, 12, 15, 40]  # a 3-token document, shorter than every kernel's reach


def _loss_sum(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")


def _data(length: int):
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, VOCAB, (1, length), generator=gen) for _ in range(2))


def _worst(model, reference, loss, want) -> float:
    grads = {n: p.grad for n, p in reference.named_parameters()}
    assert all((p.grad is None) == (grads[n] is None) for n, p in model.named_parameters())
    return max([relative_error(loss, want)] + [relative_error(p.grad, grads[n]) for n, p in model.named_parameters()
                                               if p.grad is not None])


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", NAMES)
def test_switched_forward_equals_transformers_on_one_document(name):
    from hybridpar.models.hf.mixers.short_conv import install_short_conv

    ids, labels = _data(20)
    ours, reference = build_lfm(name), build_lfm(name)
    names = [n for n, _ in ours.named_parameters()]
    assert install_short_conv(ours) == install_short_conv(ours) == ["model.layers.0.conv", "model.layers.2.conv"]
    assert [n for n, _ in ours.named_parameters()] == names  # transformers' names: checkpoints load unchanged
    loss, want = _loss_sum(ours(input_ids=ids).logits, labels), _loss_sum(reference(input_ids=ids).logits, labels)
    loss.backward()
    want.backward()
    assert _worst(ours, reference, loss, want) < TOL


@pytest.mark.parametrize("name", NAMES)
def test_packed_row_equals_each_document_alone(name):
    """The proof of a model type: hybridpar's attention and short conv on a packed row against
    transformers' own model (SDPA, its conv) run on every document alone."""
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.mixers.short_conv import install_short_conv
    from hybridpar.parallel.context import hf as context_hf
    from hybridpar.parallel.context.attention import AllGatherAttention
    from hybridpar.parallel.context.inputs import shard_inputs

    ids, labels = _data(DOCS[-1])
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    ours, reference, leaky = build_lfm(name), build_lfm(name), build_lfm(name)
    assert context_hf.attention_problem(ours) is not None  # its short convs are transformers' own yet
    install_short_conv(ours)
    assert context_hf.attention_problem(ours) is None and not context_hf.unreached_token_mixers(ours)
    core = AllGatherAttention(None)
    context_hf.apply_hf_cp(ours, core)  # the context-parallel entry, on a group of one
    inputs = context_hf.hf_cp_inputs(shard_inputs(input_ids=ids, packed=packed))
    loss = _loss_sum(ours(**inputs).logits, labels)
    loss.backward()
    want = sum(_loss_sum(reference(input_ids=ids[:, a:b]).logits, labels[:, a:b]) for a, b in zip(DOCS[:-1], DOCS[1:]))
    want.backward()
    assert _worst(ours, reference, loss, want) < TOL
    assert all(getattr(m, context_hf.CORE_ATTRIBUTE, None) is core for _, m in context_hf.hf_attention_modules(ours))
    context_hf.use_hybridpar_attention(leaky)  # hybridpar's attention, transformers' conv: the conv leaks
    with torch.no_grad():
        leaked = _loss_sum(leaky(**inputs).logits, labels)
    assert relative_error(leaked, want.detach()) > 1e-6


def test_packing_rule_takes_the_switched_model_and_refuses_a_non_causal_conv():
    from hybridpar.models.hf.mixers.short_conv import install_short_conv, short_convs
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.train.packing_rule import leak_probe, packing_line, packing_problem

    model = build_lfm("lfm2")
    assert "model.layers.0.conv.conv (Conv1d)" in packing_problem(model)
    install_short_conv(model)
    use_hybridpar_attention(model)
    assert packing_problem(model) is None and len(short_convs(model)) == 2
    assert leak_probe(model, VOCAB) < 1e-12
    line = packing_line(model, None, 0.1, 64)
    assert line.startswith("packing: several documents per row") and "Mamba" not in line
    assert "document-resetting conv on 2 short convolutions" in line
    odd = build_lfm("lfm2")
    odd.model.layers[2].conv.conv.padding = (2,)  # not kernel - 1: the conv would read future tokens
    with pytest.raises(ValueError, match=r"model.layers.2.conv.*padding \(2,\) with kernel 5"):
        install_short_conv(odd)


def test_a_cache_or_a_padding_mask_runs_transformers_forward():
    from hybridpar.models.hf.mixers.short_conv import install_short_conv

    ids, _ = _data(9)
    mask = torch.ones_like(ids)
    mask[:, :2] = 0  # left padding
    ours, reference = build_lfm("lfm2"), build_lfm("lfm2")
    install_short_conv(ours)
    for kwargs in (dict(use_cache=True), dict(attention_mask=mask)):
        with torch.no_grad():
            assert relative_error(ours(input_ids=ids, **kwargs).logits, reference(input_ids=ids, **kwargs).logits) < TOL
