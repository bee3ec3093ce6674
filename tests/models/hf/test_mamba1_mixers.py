"""Mamba1 mixers (Mamba, FalconMamba, Jamba) on hybridpar's selective scan (``models/hf/mamba1_mixers.py``).

Tiny float64 models (``mamba1_models.py``): the switched forward equals transformers' own (slow
path) on one document; a packed row of three documents (one shorter than the conv kernel) equals
transformers' own model on each document alone, loss and every parameter gradient (1e-12), with
Jamba's attention on hybridpar's core (entered as context parallelism enters it, a group of one)
and its experts; transformers' own mixer leaks. The scan alone: chunked equals one chunk, final
and initial states continue a document exactly.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.tensor.hf_models import relative_error
from tests.models.hf.mamba1_models import NAMES, VOCAB, build_mamba1

TOL = 1e-12
DOCS = [0, 11, 13, 30]  # a 2-token document, shorter than every conv kernel


def _loss_sum(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")


def _data(length: int):
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, VOCAB, (1, length), generator=gen) for _ in range(2))


def _worst(model, reference, loss, want) -> float:
    grads = {n: p.grad for n, p in reference.named_parameters()}
    assert all((p.grad is None) == (grads[n] is None) for n, p in model.named_parameters())
    assert sum(p.grad is not None for p in model.parameters()) > 10
    return max([relative_error(loss, want)] + [relative_error(p.grad, grads[n]) for n, p in model.named_parameters()
                                               if p.grad is not None])


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _packed_inputs(model, ids, packed):
    from hybridpar.parallel.context import hf as context_hf
    from hybridpar.parallel.context.attention import AllGatherAttention
    from hybridpar.parallel.context.inputs import shard_inputs

    if context_hf.hf_attention_modules(model):
        context_hf.apply_hf_cp(model, AllGatherAttention(None))  # the context-parallel entry, on a group of one
        return context_hf.hf_cp_inputs(shard_inputs(input_ids=ids, packed=packed))
    return dict(input_ids=ids, packed_seq_params=packed)


@pytest.mark.parametrize("name", NAMES)
def test_packed_row_equals_each_document_alone(name):
    """The proof of a model type: hybridpar's selective scan (and attention) on a packed row against
    transformers' own model run on every document alone."""
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.hf.mamba1_mixers import install_mamba1_core
    from hybridpar.parallel.context import hf as context_hf

    ids, labels = _data(DOCS[-1])
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS, dtype=torch.int32))
    ours, reference, leaky = build_mamba1(name), build_mamba1(name), build_mamba1(name)
    assert context_hf.attention_problem(ours) is not None  # its Mamba1 mixers are transformers' own yet
    names = [n for n, _ in ours.named_parameters()]
    switched = install_mamba1_core(ours)
    assert switched == install_mamba1_core(ours) and len(switched) == (3 if name == "jamba" else 2)
    assert [n for n, _ in ours.named_parameters()] == names  # transformers' names: checkpoints load unchanged
    assert context_hf.attention_problem(ours) is None and not context_hf.unreached_token_mixers(ours)
    loss = _loss_sum(ours(**_packed_inputs(ours, ids, packed)).logits, labels)
    loss.backward()
    want = sum(_loss_sum(reference(input_ids=ids[:, a:b]).logits, labels[:, a:b]) for a, b in zip(DOCS[:-1], DOCS[1:]))
    want.backward()
    assert _worst(ours, reference, loss, want) < TOL
    with torch.no_grad():  # transformers' own mixer on the packed row: the documents leak
        leaked = _loss_sum(leaky(input_ids=ids).logits, labels)
    assert relative_error(leaked, want.detach()) > 1e-6


@pytest.mark.parametrize("name", ["falcon_mamba"])
def test_switched_forward_equals_transformers_on_one_document_and_a_cache_runs_its_own(name):
    from hybridpar.models.hf.mamba1_mixers import install_mamba1_core

    ids, labels = _data(20)
    ours, reference = build_mamba1(name), build_mamba1(name)
    install_mamba1_core(ours)
    loss, want = _loss_sum(ours(input_ids=ids).logits, labels), _loss_sum(reference(input_ids=ids).logits, labels)
    loss.backward()
    want.backward()
    assert _worst(ours, reference, loss, want) < TOL
    mask = torch.ones_like(ids)
    mask[:, :2] = 0
    with torch.no_grad():
        for kwargs in (dict(use_cache=True), dict(attention_mask=mask)):
            assert relative_error(ours(input_ids=ids, **kwargs).logits, reference(input_ids=ids, **kwargs).logits) < TOL


def test_scan_chunks_and_states_continue_a_document_exactly():
    from hybridpar.models.linear.selective_scan import selective_scan

    gen = torch.Generator().manual_seed(3)
    t, d, n = 23, 5, 3
    x, B, C = (torch.randn(t, k, generator=gen, dtype=torch.float64) for k in (d, n, n))
    dt = torch.rand(t, d, generator=gen, dtype=torch.float64)
    A, D = -torch.rand(d, n, generator=gen, dtype=torch.float64), torch.randn(d, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 9, 23])
    whole, finals = selective_scan(x, dt, A, B, C, D, cu, return_final_states=True, chunk_size=64)
    assert relative_error(selective_scan(x, dt, A, B, C, D, cu, chunk_size=4), whole) < TOL
    first, h = selective_scan(x[:15], dt[:15], A, B[:15], C[:15], D, torch.tensor([0, 9, 15]),
                              return_final_states=True, chunk_size=4)
    rest, last = selective_scan(x[15:], dt[15:], A, B[15:], C[15:], D, torch.tensor([0, 8]), h[1:],
                                torch.tensor([0]), return_final_states=True, chunk_size=4)
    assert relative_error(torch.cat([first, rest]), whole) < TOL and relative_error(last[0], finals[1]) < TOL
    assert relative_error(whole[9:], selective_scan(x[9:], dt[9:], A, B[9:], C[9:], D, torch.tensor([0, 14]))) < TOL
