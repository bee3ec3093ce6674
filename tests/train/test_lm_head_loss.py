"""``lm_head_loss`` on one process: exact against ``F.cross_entropy(hidden @ weight.T)``, never
a ``[T, V]`` tensor, one node for ``torch.compile``, and ``ValueError`` for bad input.

The vocabulary-parallel cases (tp 1, 2, 4 on gloo) are in
``tests/distributed/tensor/test_vocab_parallel_loss.py``; the reference and the allocation tracker
used by both live here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpar.models.lm_head_loss import block_shape, chunked_lm_head_loss
from hybridpar.train.loss import IGNORE_INDEX, lm_head_loss

TOL = 1e-10
TOKENS, HIDDEN, VOCAB = 37, 8, 61


def make_case(tokens: int = TOKENS, vocab: int = VOCAB, hidden: int = HIDDEN, seed: int = 0,
              dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden [tokens, D]``, ``weight [V, D]``, ``labels [tokens]`` with ignored tokens: token 3,
    and tokens 10..19 (so a chunk of 5 or 10 tokens has no valid label)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=gen, dtype=dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[3] = IGNORE_INDEX
    labels[10:20] = IGNORE_INDEX
    return h, w, labels


def transformed(logits: torch.Tensor, scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """Gemma's soft cap ``c tanh(s z / c)`` or a scale ``s z``, written as the models write them."""
    logits = logits * scale
    return torch.tanh(logits / softcap) * softcap if softcap is not None else logits


def reference(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, scale: float = 1.0,
              softcap: float | None = None) -> tuple[torch.Tensor, ...]:
    """``(loss_sum, grad_hidden, grad_weight)`` of the materialized (transformed) logits."""
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = F.cross_entropy(transformed(h @ w.T, scale, softcap), labels, reduction="sum", ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def largest_allocation_bytes(fn) -> int:
    """Run ``fn`` (forward and backward) under the profiler's memory tracking; the most bytes
    any single op allocated itself (its outputs and temporaries, children excluded).

    Every tensor created anywhere, inside custom ops and in the backward too, is allocated by
    some op; views and in-place ops allocate nothing.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.self_cpu_memory_usage for e in prof.events()]
    assert any(size > 0 for size in sizes), "the profiler recorded no allocation: the tracker is broken"
    return max(sizes)


@pytest.mark.parametrize("chunk_size", [5, 7, 16, 4096])
def test_equals_cross_entropy_in_float64(chunk_size):
    # 37 tokens, 61 rows: neither divisible by 5, 7, 10 or 16; chunks of 5 and 10 hold only -100 labels
    h, w, labels = make_case()
    want_loss, want_dh, want_dw = reference(h, w, labels)
    h.requires_grad_(), w.requires_grad_()
    loss, count = lm_head_loss(h, w, labels, chunk_size=chunk_size)
    loss.backward()
    assert count.item() == int((labels != IGNORE_INDEX).sum())
    assert (loss - want_loss).abs().item() < TOL * max(1.0, want_loss.abs().item())
    assert (h.grad - want_dh).abs().max().item() < TOL
    assert (w.grad - want_dw).abs().max().item() < TOL


def test_blocks_keep_their_elements_with_fewer_tokens():
    """Fewer tokens than ``TOKEN_BLOCKS * C``: more vocabulary rows per block, the same elements at most
    (``chunk_size=16`` above runs 37 tokens by 27 rows: blocks of 27, 27 and 7 rows)."""
    c = 4096
    assert block_shape(131072, 65536, c) == (4 * c, c)
    assert block_shape(8192, 65536, c) == (8192, 2 * c)  # 8 vocabulary blocks, not 16
    assert block_shape(8192, 5000, c) == (8192, 5000)  # never more rows than there are
    assert block_shape(37, 61, 16) == (37, 27)
    for tokens in (1, 100, 4 * c - 1, 4 * c, 10**6):
        token_block, row_block = block_shape(tokens, 10**6, c)
        assert token_block * row_block <= 4 * c * c and row_block >= c


TRANSFORMS = [(1 / 3, None), (2.5, None), (1.0, 2.0), (0.7, 5.0)]  # Granite, Cohere, Gemma, both


@pytest.mark.parametrize("scale, softcap", TRANSFORMS)
def test_scaled_and_soft_capped_logits_equal_their_cross_entropy_in_float64(scale, softcap):
    """The loss, ``grad_hidden``, ``grad_weight`` and the argmax of ``z' = c tanh(s z / c)`` (or ``s z``)
    equal those of the transformed logits in full (1e-12), blocks of 7 tokens and rows; the cap of 2 bends
    logits of size ~3 (tanh far from linear), so a missing ``1 - tanh^2`` would show."""
    h, w, labels = make_case()
    want_loss, want_dh, want_dw = reference(h, w, labels, scale, softcap)
    h.requires_grad_(), w.requires_grad_()
    out = chunked_lm_head_loss(h, w, labels, chunk_size=7, return_predictions=True, scale=scale, softcap=softcap)
    out.loss_sum.backward()
    assert (out.loss_sum - want_loss).abs().item() < 1e-12 * want_loss.item()
    assert (h.grad - want_dh).abs().max().item() < 1e-12 and (w.grad - want_dw).abs().max().item() < 1e-12
    assert torch.equal(out.predictions, (h @ w.T).argmax(dim=-1))
    plain = reference(h, w, labels)[0]
    assert abs(plain.item() - want_loss.item()) > 1e-3 * want_loss.item()  # the transform matters here
    bf16 = (h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_())  # as today: float32 inside
    loss, _ = lm_head_loss(*bf16, labels, chunk_size=7, scale=scale, softcap=softcap)
    loss.backward()
    exact_on_rounded = reference(bf16[0].detach().double(), bf16[1].detach().double(), labels, scale, softcap)
    assert loss.dtype == torch.float32 and abs(loss.item() - exact_on_rounded[0].item()) < 1e-5 * loss.item()
    assert (bf16[0].grad.double() - exact_on_rounded[1]).abs().max() < 2e-2 * exact_on_rounded[1].abs().max()


def test_batched_shape_all_ignored_and_empty():
    h, w, labels = make_case(tokens=24)
    h3, labels3 = h.view(2, 12, HIDDEN), labels.view(2, 12)
    loss, count = lm_head_loss(h3, w, labels3, chunk_size=5)
    assert abs(loss.item() - reference(h, w, labels)[0].item()) < TOL * loss.abs().item()
    loss, count = lm_head_loss(h, w, torch.full_like(labels, IGNORE_INDEX), chunk_size=5)
    assert loss.item() == 0.0 and count.item() == 0
    loss, count = lm_head_loss(h[:0], w, labels[:0])
    assert loss.item() == 0.0 and count.item() == 0


def test_bfloat16_inputs_compute_in_float32():
    h, w, labels = make_case(dtype=torch.float32)
    want = reference(h.double(), w.double(), labels)[0]
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    loss, _ = lm_head_loss(hb, wb, labels, chunk_size=7)
    loss.backward()
    assert loss.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    # bf16 rounding of the inputs only; the accumulation is float32
    exact_on_rounded = reference(hb.detach().double(), wb.detach().double(), labels)[0]
    assert abs(loss.item() - exact_on_rounded.item()) < 1e-4 * exact_on_rounded.item()
    assert abs(loss.item() - want.item()) < 2e-2 * want.item()


def test_bf16_logit_blocks_are_read_in_float32_without_a_copy_and_give_the_same_bits():
    """Under mixed precision a block of bf16 logits is read in float32 by the subtraction itself
    (no ``[Ct, Cv]`` float32 copy), the softmax gradient is scaled and rounded to bf16 in one pass
    for both matmuls, and every statistic and gradient is bitwise what the copies gave."""
    from hybridpar.models.lm_head_loss import local_gradients, local_statistics
    from tests.op_outputs import OpOutputs

    h, w, labels = make_case(dtype=torch.float32)
    h16, w16 = h.bfloat16(), w.bfloat16()
    with OpOutputs() as seen:
        row_max, sum_exp, target, argmax = local_statistics(h, w, labels, 4096, matmul_dtype=torch.bfloat16)
    lse = row_max + sum_exp.log()
    grad_loss = torch.tensor(0.5)
    with OpOutputs() as seen_backward:
        grad_h, grad_w = local_gradients(grad_loss, h, w, labels, lse, 4096, matmul_dtype=torch.bfloat16)
    for ops in (seen, seen_backward):  # no [T, V] copy: backward rounds dz to bf16 inside its last product
        assert not [op for op, shape in ops.shapes if shape == (TOKENS, VOCAB) and "copy" in op], ops.shapes
    logits = (h16 @ w16.T).float()  # the copy the blocks used to make; one block of every token and id
    valid = labels != IGNORE_INDEX
    m, arg = logits.max(dim=1)
    assert torch.equal(row_max, m) and torch.equal(argmax, arg)
    assert torch.equal(sum_exp, (logits - m[:, None]).exp().sum(dim=1))
    assert torch.equal(target, torch.where(valid, logits.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0))
    dz = (logits - lse[:, None]).exp()
    dz.scatter_add_(1, labels.clamp(min=0)[:, None], -valid.float()[:, None])
    dz.mul_((grad_loss * valid)[:, None])
    assert torch.equal(grad_h, dz.bfloat16() @ w16)
    assert torch.equal(grad_w, (dz.T.bfloat16() @ h16).float())


def test_predictions_are_the_argmax_with_ties_to_the_lower_id():
    h, w, labels = make_case()
    h, w = h.abs().round() + 1, w.round()  # integers: every logit exact, whatever the summation order
    w[3] = w[8] = w[40] = 10.0  # equal, largest logits in three vocabulary blocks of 5
    out = chunked_lm_head_loss(h, w, labels, chunk_size=5, return_predictions=True)
    want = (h @ w.T).argmax(dim=-1)
    assert torch.equal(want, torch.full_like(want, 3))
    assert torch.equal(out.predictions, want)
    h2, w2, labels2 = make_case(seed=1)
    out = chunked_lm_head_loss(h2.view(1, -1, HIDDEN), w2, labels2.view(1, -1), chunk_size=7, return_predictions=True)
    assert torch.equal(out.predictions, (h2 @ w2.T).argmax(dim=-1).view(1, -1))


def test_no_tensor_of_tokens_by_vocabulary_is_ever_allocated():
    tokens, vocab = 64, 96
    h, w, labels = make_case(tokens=tokens, vocab=vocab, dtype=torch.float32)
    h.requires_grad_(), w.requires_grad_()
    full = tokens * vocab * h.element_size()

    def new():
        lm_head_loss(h, w, labels, chunk_size=16)[0].backward()

    def old():
        F.cross_entropy(h @ w.T, labels, reduction="sum", ignore_index=IGNORE_INDEX).backward()

    assert largest_allocation_bytes(old) >= full  # the tracker sees the logits of the old path
    largest = largest_allocation_bytes(new)
    assert largest < full, f"an allocation of {largest} bytes, the [T, V] logits are {full}"
    assert largest <= max(16 * 16, tokens * HIDDEN, vocab * HIDDEN) * 8  # a block, or hidden/weight-sized


def test_one_graph_without_breaks_under_torch_compile():
    import torch._dynamo

    h, w, labels = make_case()

    def fn(hidden, weight, targets):
        return lm_head_loss(hidden, weight, targets, chunk_size=7)

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(h, w, labels)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _ = compiled(hc, wc, labels)
    loss.backward()
    want_loss, want_dh, want_dw = reference(h, w, labels)
    assert (loss - want_loss).abs().item() < TOL * want_loss.item()
    assert (hc.grad - want_dh).abs().max().item() < TOL and (wc.grad - want_dw).abs().max().item() < TOL
    capped = torch.compile(lambda *a: lm_head_loss(*a, chunk_size=7, scale=0.5, softcap=3.0), backend="aot_eager",
                           fullgraph=True)  # the fake kernels take the transform too
    assert (capped(h, w, labels)[0] - reference(h, w, labels, 0.5, 3.0)[0]).abs().item() < TOL * want_loss.item()
    torch._dynamo.reset()


BAD_INPUTS = {
    "chunk_size 0": (lambda h, w, y: lm_head_loss(h, w, y, chunk_size=0), ["chunk_size=0", "chunk_size >= 1"]),
    "chunk_size -3": (lambda h, w, y: lm_head_loss(h, w, y, chunk_size=-3), ["chunk_size=-3"]),
    "label = V": (lambda h, w, y: lm_head_loss(h, w, torch.where(y == 7, VOCAB, y)),
                  [f"label {VOCAB}", f"[0, {VOCAB})", "-100"]),
    "label -1": (lambda h, w, y: lm_head_loss(h, w, torch.where(y == 7, -1, y)), ["label -1", "vocab_size"]),
    "hidden size": (lambda h, w, y: lm_head_loss(h[:, :5], w, y), ["hidden (37, 5)", "D=8"]),
    "token count": (lambda h, w, y: lm_head_loss(h, w, y[:-1]), ["labels (36,)", "hidden (37, 8)"]),
    "float labels": (lambda h, w, y: lm_head_loss(h, w, y.double()), ["torch.float64", "integer"]),
    "weight rank": (lambda h, w, y: lm_head_loss(h, w.reshape(-1), y), ["[V, D]"]),
    "scale 0": (lambda h, w, y: lm_head_loss(h, w, y, scale=0.0), ["scale=0.0", "finite number > 0"]),
    "softcap -1": (lambda h, w, y: lm_head_loss(h, w, y, softcap=-1.0), ["softcap=-1.0", "softcap=None"]),
    "scale inf": (lambda h, w, y: lm_head_loss(h, w, y, scale=float("inf")), ["scale=inf"]),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_raises_value_error_with_the_fix(name):
    h, w, labels = make_case()
    labels[labels == 7] = 7
    labels[0] = 7  # at least one 7 to replace
    call, fragments = BAD_INPUTS[name]
    with pytest.raises(ValueError) as error:
        call(h, w, labels)
    for fragment in fragments:
        assert fragment in str(error.value), f"{fragment!r} not in {error.value}"


@pytest.mark.parametrize("field, value", [("input_ids", 61), ("input_ids", 2**40), ("labels", 61)])
def test_the_trainer_refuses_an_id_outside_the_vocabulary_before_the_pack_leaves_the_cpu(field, value):
    """``pack_tensors`` checks on the CPU, before the move: on CUDA the embedding would assert (or, split over
    the vocabulary, read a zero row) and a check there would sync every step. ``meta`` stands in for it."""
    from hybridpar.data.packing import pack_documents
    from hybridpar.train.trainer import pack_tensors

    docs = [{"input_ids": torch.arange(2, 9), "labels": torch.arange(3, 10)} for _ in range(2)]
    docs[1][field][4] = value
    pack = pack_documents(docs, 16)[0]
    input_ids, _, _ = pack_tensors(pack, torch.device("meta"))  # without the vocabulary: moved unchecked
    assert input_ids.device.type == "meta"
    with pytest.raises(ValueError, match=f"{value}.*outside the .*vocabulary \\[0, {VOCAB}\\)"):
        pack_tensors(pack, torch.device("meta"), VOCAB)
    assert pack_tensors(pack_documents(docs[:1], 16)[0], torch.device("meta"), VOCAB)[0].shape == (1, 16)
