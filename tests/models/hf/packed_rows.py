"""What the tests of transformers' switched token mixers share: a packed row against its documents one per row.

``packed_vs_alone(model, reference, ids, labels, cu)`` runs the trainer's loss (``pack_loss_sum``) on the row
packing the documents of ``cu`` through ``model`` and on each document as its own row through ``reference``
(transformers' own model, or ``model`` itself), and returns both losses and gradients; ``assert_same``
holds them to a tolerance, the loss and every parameter's gradient.
"""

from __future__ import annotations

import torch

from hybridpar.data.thd import PackedSeqParams
from hybridpar.parallel.context.inputs import shard_inputs
from hybridpar.train.trainer import pack_loss_sum

__all__ = ["assert_same", "boundaries", "loss_and_grads", "packed_vs_alone", "random_rows", "relative"]


def relative(got, want) -> float:
    """``max |got - want| / max(max |want|, 1)``."""
    return float((got - want).detach().abs().max() / want.detach().abs().max().clamp_min(1.0))


def boundaries(docs) -> list[int]:
    """``cu_seqlens`` of documents of lengths ``docs``: ``[0, d0, d0 + d1, ...]``."""
    return [0, *torch.tensor(docs).cumsum(0).tolist()]


def random_rows(docs, vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and labels ``[1, sum(docs)]`` (every fifth label ignored)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, sum(docs)), generator=gen)
    labels = torch.randint(0, vocab, (1, sum(docs)), generator=gen)
    labels[:, ::5] = -100
    return ids, labels


def loss_and_grads(model, pieces) -> tuple[torch.Tensor, dict]:
    """The trainer's summed loss over ``pieces`` of ``(ids, labels, cu)`` and every parameter's gradient."""
    model.zero_grad()
    total = 0
    for ids, labels, cu in pieces:
        packed = PackedSeqParams.from_cu_seqlens(torch.tensor(cu, dtype=torch.int32))
        loss, _ = pack_loss_sum(model, shard_inputs(input_ids=ids, labels=labels, packed=packed))
        loss.backward()
        total = total + loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_vs_alone(model, reference, ids, labels, cu):
    """``(packed, alone)``: each a ``(loss, gradients)`` of ``loss_and_grads``, the packed row through ``model``
    and its documents one per row through ``reference``."""
    alone = [(ids[:, a:b], labels[:, a:b], [0, b - a]) for a, b in zip(cu[:-1], cu[1:])]
    return loss_and_grads(model, [(ids, labels, cu)]), loss_and_grads(reference, alone)


def assert_same(got, want, model, tol: float) -> None:
    """``got`` and ``want`` (``(loss, gradients)``) agree within ``tol``, and every parameter of ``model`` has a gradient."""
    (loss, grads), (want_loss, want_grads) = got, want
    assert relative(loss, want_loss) < tol
    assert set(grads) == set(want_grads) == {n for n, _ in model.named_parameters()}
    worst = max((relative(g, want_grads[n]), n) for n, g in grads.items())
    assert worst[0] < tol, worst
