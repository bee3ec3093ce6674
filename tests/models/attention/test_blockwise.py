"""The blockwise attention core against the dense-mask reference, its block plan, and its memory.

Parity is float64 at 1e-10 for outputs and the gradients of q, k, v, with small blocks so that
every case has several query and key blocks, partial last blocks, cut runs, skipped blocks,
documents that start inside a block, GQA ratios 1, 2, 4 and head_dim 16 and 64.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.attention.mixer import Attention, causal_attention
from hybridpar.models.attention.layout import AttentionLayout, block_plan, invisible
from hybridpar.models.attention.blockwise import blockwise_attention
from tests.attention_reference import dense_causal_attention, document_causal_mask, naive_attention, reference_attention
from tests.op_outputs import OpOutputs

TOL = 1e-10


def documents(cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``0..T-1`` and document ids of the boundaries ``cu``."""
    pos = torch.arange(cu[-1])
    return pos, torch.searchsorted(torch.tensor(cu[1:]), pos, right=True).to(torch.int32)


def qkv(batch, seq_q, seq_k, hq, hkv, dh, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_q, hq, dh, dtype=dtype, generator=gen).requires_grad_()
    k = torch.randn(batch, seq_k, hkv, dh, dtype=dtype, generator=gen).requires_grad_()
    v = torch.randn(batch, seq_k, hkv, dh, dtype=dtype, generator=gen).requires_grad_()
    return q, k, v


def out_and_grads(fn, q, k, v, seed=1):
    """``fn``'s output and the gradients of q, k, v under a fixed random cotangent."""
    out = fn(q, k, v)
    weight = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    return [out.detach(), *grads]


def assert_close(got, want, tol=TOL, what=""):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = (a - b).abs().max().item()
        assert err <= tol, f"{what}: {name} differs by {err:.3g}"


CASES = [  # (Hq, Hkv, Dh, document boundaries)
    (4, 4, 16, [0, 37]),  # GQA ratio 1, one document, 37 = not a multiple of the block
    (4, 2, 16, [0, 8, 9, 30, 45]),  # ratio 2, a one-token document, boundaries on and off block edges
    (8, 2, 64, [0, 13, 40, 41, 53]),  # ratio 4, head_dim 64
    (4, 1, 64, [0, 16, 32, 48, 50]),  # ratio 4, every boundary on a block edge
]


@pytest.mark.parametrize("hq, hkv, dh, cu", CASES)
@pytest.mark.parametrize("block_size, keys_per_step", [(8, 16), (5, 15), (64, 64)])
def test_blockwise_matches_dense_reference(hq, hkv, dh, cu, block_size, keys_per_step):
    q, k, v = qkv(2, cu[-1], cu[-1], hq, hkv, dh)
    pos, doc = documents(cu)
    got = out_and_grads(lambda *t: blockwise_attention(*t, pos, doc, pos, doc, block_size=block_size,
                                                       keys_per_step=keys_per_step), q, k, v)
    want = out_and_grads(lambda *t: reference_attention(*t, pos, doc, pos, doc), q, k, v)
    assert_close(got, want, what=f"{hq}/{hkv} x {dh}, docs {cu}, blocks {block_size}/{keys_per_step}")


@pytest.mark.parametrize("sliding_window", [None, 1, 6])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_any_token_order_window_and_scale(sliding_window, scale):
    """Queries and keys shuffled (positions and documents travel with them); one subset of queries."""
    cu = [0, 11, 12, 35, 47]
    pos, doc = documents(cu)
    gen = torch.Generator().manual_seed(3)
    q_perm, k_perm = torch.randperm(47, generator=gen)[:29], torch.randperm(47, generator=gen)
    q, k, v = qkv(1, 29, 47, 6, 2, 16)
    kwargs = dict(scale=scale, sliding_window=sliding_window)
    got = out_and_grads(lambda *t: blockwise_attention(*t, pos[q_perm], doc[q_perm], pos[k_perm], doc[k_perm],
                                                       block_size=6, keys_per_step=12, **kwargs), q, k, v)
    args = (pos[q_perm], doc[q_perm], pos[k_perm], doc[k_perm])
    want = out_and_grads(lambda *t: reference_attention(*t, *args, **kwargs), q, k, v)
    second = out_and_grads(lambda *t: naive_attention(*t, *args, **kwargs), q, k, v)
    assert_close(got, want, what=f"window {sliding_window}, scale {scale}")
    assert_close(second, want, what="the two references")


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_soft_capped_scores_match_the_written_out_softmax(sliding_window):
    """Gemma2's logit soft-capping ``c * tanh(S / c)`` with ``c`` small enough to bend the scores:
    output and every input gradient, any token order, queries without keys included."""
    cu = [0, 11, 12, 35, 47]
    pos, doc = documents(cu)
    gen = torch.Generator().manual_seed(4)
    q_perm, k_perm = torch.randperm(47, generator=gen)[:29], torch.randperm(47, generator=gen)
    q, k, v = qkv(1, 29, 47, 6, 2, 16)
    q = (3 * q).detach().requires_grad_()  # scores well past the cap
    args = (pos[q_perm], doc[q_perm], pos[k_perm], doc[k_perm])
    got = out_and_grads(lambda *t: blockwise_attention(*t, *args, block_size=6, keys_per_step=12, softcap=1.5,
                                                       sliding_window=sliding_window, scale=0.7), q, k, v)
    want = out_and_grads(lambda *t: naive_attention(*t, *args, softcap=1.5, sliding_window=sliding_window, scale=0.7),
                         q, k, v)
    uncapped = out_and_grads(lambda *t: naive_attention(*t, *args, sliding_window=sliding_window, scale=0.7), q, k, v)
    assert_close(got, want, what=f"softcap, window {sliding_window}")
    assert (want[0] - uncapped[0]).abs().max() > 1e-2  # the cap changes the result


def test_queries_without_visible_keys_get_zero_output_and_gradient():
    """Keys of one document only: queries of the other document see nothing (out 0, grads 0, no NaN)."""
    pos, doc = documents([0, 10, 24])
    q, k, v = qkv(1, 24, 14, 2, 1, 16)
    got = out_and_grads(lambda *t: blockwise_attention(*t, pos, doc, pos[10:], doc[10:], block_size=4,
                                                       keys_per_step=8), q, k, v)
    assert all(torch.isfinite(g).all() for g in got)
    assert got[0][:, :10].abs().max() == 0 and got[1][:, :10].abs().max() == 0

    def reference(q, k, v):  # zeros for the first document's queries, then the second document
        rest = reference_attention(q[:, 10:], k, v, pos[10:], doc[10:], pos[10:], doc[10:])
        return torch.cat([torch.zeros_like(q[:, :10]), rest], dim=1)

    assert_close(got, out_and_grads(reference, q, k, v), what="queries without keys")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_low_precision_is_close_to_float64(dtype, tol):
    pos, doc = documents([0, 20, 70])
    q, k, v = qkv(1, 70, 70, 4, 2, 16)
    want = out_and_grads(lambda *t: reference_attention(*t, pos, doc, pos, doc), q, k, v)
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    got = out_and_grads(lambda *t: blockwise_attention(*t, pos, doc, pos, doc, block_size=16, keys_per_step=32), *low)
    assert all(g.dtype == dtype for g in got)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        relative = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert relative <= tol, f"{dtype} {name}: relative error {relative:.3g}"


@pytest.mark.parametrize("cu", [[0, 300], [0, 100, 257, 300]])
def test_causal_attention_default_blocks_match_the_old_dense_path(cu):
    """The model's core (default 256-token blocks, so two blocks here) equals the dense-mask one."""
    q, k, v = qkv(1, cu[-1], cu[-1], 4, 2, 16)
    packed = None if len(cu) == 2 else PackedSeqParams.from_cu_seqlens(torch.tensor(cu))
    got = out_and_grads(lambda *t: causal_attention(*t, packed), q, k, v)
    assert_close(got, out_and_grads(lambda *t: dense_causal_attention(*t, packed), q, k, v))


# ---------------------------------------------------------------- the block plan


@pytest.mark.parametrize("sliding_window", [None, 7])
def test_block_plan_skips_only_invisible_blocks(sliding_window):
    """Every visible pair lies in exactly one step; steps marked all-visible hold no hidden pair.

    In sequence order without a window no step is empty either (the block test is exact there);
    shuffled tokens only make the block ranges wider, so some computed steps may be empty.
    """
    pos, doc = documents([0, 9, 10, 31, 64, 77])
    gen = torch.Generator().manual_seed(0)
    orders = ((pos, pos, sliding_window is None), (torch.randperm(77, generator=gen)[:50], torch.randperm(77, generator=gen), False))
    for q_idx, k_idx, exact in orders:
        mask = document_causal_mask(pos[q_idx], doc[q_idx], pos[k_idx], doc[k_idx], sliding_window)  # [Sq, Sk]
        block = 8
        plan = block_plan(pos[q_idx], doc[q_idx], pos[k_idx], doc[k_idx], block, 24, sliding_window)
        covered = torch.zeros_like(mask, dtype=torch.int64)
        for q_block, k_start, k_end, all_visible in plan.tolist():
            assert k_end - k_start <= 24
            tile = mask[q_block * block:(q_block + 1) * block, k_start:k_end]
            assert tile.any() or not exact, "a step with no visible pair was not skipped"
            if all_visible:
                assert tile.all()
            covered[q_block * block:(q_block + 1) * block, k_start:k_end] += 1
        assert covered.max() <= 1 and bool((covered[mask] == 1).all())
    assert plan.device.type == "cpu" and plan.dtype == torch.int64


def test_block_plan_skips_other_documents_and_the_future():
    """Sequence order, 4 documents of 64 in 16-token blocks: only the 4 diagonal 4x4 triangles remain."""
    pos, doc = documents([0, 64, 128, 192, 256])
    plan = block_plan(pos, doc, pos, doc, 16, 16)
    assert len(plan) == 4 * 10  # per document: 4 diagonal (token rule) + 6 below it (all visible)
    assert int(plan[:, 3].sum()) == 4 * 6


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("call, needles", [
    (lambda q, k, p: blockwise_attention(q, k, k, p, p, p, p, block_size=0), ["block_size", "0", ">= 1"]),
    (lambda q, k, p: blockwise_attention(q, k, k, p, p, p, p, block_size=8, keys_per_step=4), ["keys_per_step", "4"]),
    (lambda q, k, p: blockwise_attention(q, k[:, :, :1].expand(-1, -1, 3, -1), k[:, :, :1].expand(-1, -1, 3, -1),
                                         p, p, p, p), ["query heads 4", "kv heads 3"]),
    (lambda q, k, p: blockwise_attention(q, k[..., :8], k[..., :8], p, p, p, p), ["(1, 12, 2, 8)"]),
    (lambda q, k, p: blockwise_attention(q, k, k, p[:5], p, p, p), ["q_pos (5,)", "12 queries"]),
    (lambda q, k, p: blockwise_attention(q, k, k, p, p, p, p, sliding_window=0), ["sliding_window", "0"]),
    (lambda q, k, p: causal_attention(q, k, k, PackedSeqParams.from_cu_seqlens(torch.tensor([0, 5, 9]))),
     ["12 tokens", "describe 9"]),
])
def test_bad_input_raises_value_error_naming_the_value(call, needles):
    q, k = torch.randn(1, 12, 4, 16), torch.randn(1, 12, 2, 16)
    with pytest.raises(ValueError) as error:
        call(q, k, torch.arange(12))
    assert all(n in str(error.value) for n in needles), str(error.value)


# ---------------------------------------------------------------- memory: nothing of [S_q, S_k]


def test_no_tensor_of_sq_times_sk_elements_exists():
    """A packed row of 96 tokens, 2 heads x 4: every op output and every saved tensor < 96 * 96."""
    seq = 96
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 40, 41, 96]))
    q, k, v = qkv(1, seq, seq, 2, 1, 4)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with OpOutputs() as tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = blockwise_attention(q, k, v, torch.arange(seq), packed.seq_idx[0], torch.arange(seq), packed.seq_idx[0],
                                  block_size=16, keys_per_step=32)
        out.sum().backward()  # sum saves nothing: every saved tensor is the core's
    assert 0 < tracker.largest < seq * seq
    assert saved and max(t.numel() for t in saved) < seq * seq
    floats = sorted(tuple(t.shape) for t in saved if t.is_floating_point())
    assert floats == sorted([(1, seq, 2, 4), (1, seq, 1, 4), (1, seq, 1, 4), (1, seq, 2, 4), (1, 2, seq)])  # q k v out lse
    with OpOutputs() as dense:
        dense_causal_attention(q, k, v, packed).square().sum().backward()
    assert dense.largest >= seq * seq  # the tracker sees the dense mask it is meant to catch


# ---------------------------------------------------------------- torch.compile


def test_attention_module_compiles_without_graph_breaks_and_matches_eager():
    """dynamo sees the core as one op per direction; aot_eager runs the custom ops and equals eager."""
    torch.manual_seed(0)
    module = Attention(32, 4, 2, 8, rope_theta=100.0).double()
    x = torch.randn(1, 40, 32, dtype=torch.float64, requires_grad=True)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 10, 40]))
    for params in (packed, None):
        explanation = torch._dynamo.explain(module)(x, params)
        assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    for params in (packed, None):
        want = module(x, params)
        want_grad, = torch.autograd.grad(want.square().sum(), x)
        got = compiled(x, params)
        got_grad, = torch.autograd.grad(got.square().sum(), x)
        assert (got - want).abs().max() <= 1e-12 and (got_grad - want_grad).abs().max() <= 1e-12


def test_custom_ops_pass_opcheck():
    pos, doc = documents([0, 5, 12])
    q, k, v = qkv(1, 12, 12, 2, 1, 8)
    plan = block_plan(pos, doc, pos, doc, 4, 8)
    for softcap in (None, 3.0):
        args = (q, k, v, pos, doc, pos, doc, plan, 1 / math.sqrt(8), None, 4, 8, softcap)
        torch.library.opcheck(torch.ops.hybridpar.blockwise_attention_fwd.default, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
