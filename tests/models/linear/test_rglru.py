"""The RG-LRU on the shared selective scan (``models/linear/rglru.py``), float64, against the recurrence
written here token by token: output and every input gradient, across scan chunks and documents, with the
normaliser reset at each document's first token; entering and final states continue a document exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridpar.models.linear.rglru import rglru
from hybridpar.models.linear.selective_scan import document_resets

ROWS, LENGTH, HEADS, WIDTH = 2, 37, 2, 3
CHANNELS = HEADS * WIDTH
CU = torch.tensor([0, 10, 11, 30, 37])  # a one-token document; boundaries off the chunk edges


def _inputs():
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, dtype=torch.float64, generator=gen)).requires_grad_()

    return (rand(ROWS, LENGTH, CHANNELS), rand(HEADS, WIDTH, WIDTH, scale=0.5), rand(HEADS, WIDTH, scale=0.5),
            rand(HEADS, WIDTH, WIDTH, scale=0.5), rand(HEADS, WIDTH, scale=0.5), rand(CHANNELS))


def _recurrence(x, wi, bi, wr, br, param, starts):
    """h_t = a_t h_{t-1} + m_t i_t x_t token by token; ``starts``: first tokens of documents."""
    h, ys = torch.zeros(ROWS, CHANNELS, dtype=torch.float64), []
    for t in range(LENGTH):
        xt = x[:, t].view(ROWS, HEADS, WIDTH)
        i = torch.sigmoid(torch.einsum("rhi,hij->rhj", xt, wi) + bi).reshape(ROWS, CHANNELS)
        r = torch.sigmoid(torch.einsum("rhi,hij->rhj", xt, wr) + br).reshape(ROWS, CHANNELS)
        a = torch.exp(-8.0 * r * F.softplus(param))
        if t in starts:
            h = i * x[:, t]  # the state resets and the normaliser is 1
        else:
            h = a * h + torch.sqrt(1 - a * a) * i * x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)


def test_rglru_equals_the_recurrence_token_by_token_with_every_input_gradient():
    inputs = _inputs()
    reset = document_resets(CU, LENGTH, "cpu")
    got = rglru(*inputs, first=reset, reset=reset, chunk=8)
    want = _recurrence(*inputs, set(CU[:-1].tolist()))
    assert (got - want).abs().max() < 1e-12
    weight = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((got * weight).sum(), inputs)
    for g, w in zip(grads, torch.autograd.grad((want * weight).sum(), inputs)):
        assert (g - w).abs().max() < 1e-12 and w.abs().max() > 1e-3
    # the normaliser reset matters: without it the first tokens differ
    assert (rglru(*inputs, first=torch.zeros_like(reset), reset=reset, chunk=8) - want).abs().max() > 1e-3


def test_a_state_entering_mid_document_continues_it_and_the_normaliser_stays_off():
    x, *params = (t.detach() for t in _inputs())
    x = x[:1]
    starts = document_resets(CU, LENGTH, "cpu")
    whole = rglru(x, *params, first=starts, reset=starts, chunk=8)
    cut = 20  # inside the document [11, 30): the rest's first token is no document's first
    first_part, states = rglru(x[:, :cut], *params, first=starts[:cut], reset=starts[:cut], chunk=8,
                               final_at=torch.tensor([9, cut - 1]))
    reset = starts[cut:].clone()
    reset[0] = True  # a zero state at the cut, the real one entering there
    rest = rglru(x[:, cut:], *params, first=starts[cut:], reset=reset, chunk=8, init_states=states[1:],
                 init_at=torch.tensor([0]))
    assert states.shape == (2, CHANNELS)
    assert (torch.cat([first_part, rest], 1) - whole).abs().max() < 1e-12
