"""Kernel choice and the index math the CUDA kernels need, checked on CPU.

The fused kernels themselves run only on CUDA (``benchmarks/attention_cuda_check.py``);
here: which kernel each input gets, ``cu_seqlens`` for varlen, and FlexAttention's
``mask_mod`` and ``BlockMask`` against the dense reference visibility (FlexAttention's eager
forward runs on CPU, so the mask and the call convention are checked end to end).
"""

from __future__ import annotations

import logging

import pytest
import torch

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.attention import kernels as attention_kernels
from hybridpar.models.attention.mixer import sequence_layout
from hybridpar.models.attention.kernels import attention_core, flex_block_mask, flex_mask_mod, kernel_for
from hybridpar.models.attention.layout import AttentionLayout, cu_seqlens_of_rows
from tests.attention_reference import attend, document_causal_mask, reference_attention

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@pytest.mark.parametrize("device, dtype, head_dim, ordered, capability, kernel", [
    ("cpu", BF16, 64, True, None, "blockwise"),
    ("cpu", F32, 64, False, None, "blockwise"),
    ("cuda", BF16, 64, True, (9, 0), "varlen"),  # one process / ulysses
    ("cuda", F16, 80, True, (8, 0), "varlen"),  # flash takes any multiple of 8 up to 256
    ("cuda", BF16, 64, False, (9, 0), "flex"),  # allgather: queries out of order
    ("cuda", F32, 64, True, (9, 0), "flex"),  # flash has no float32
    ("cuda", BF16, 64, True, (7, 5), "flex"),  # flash needs sm80
    ("cuda", F64, 64, True, (9, 0), "blockwise"),
    ("cuda", BF16, 80, False, (9, 0), "flex"),  # flex: zero-padded to 128
    ("cuda", BF16, 8, False, (9, 0), "flex"),  # padded to 16
    ("cuda", BF16, 320, False, (9, 0), "blockwise"),  # past flex's 256
])
def test_kernel_choice(device, dtype, head_dim, ordered, capability, kernel):
    assert kernel_for(device, dtype, head_dim, ordered, capability)[0] == kernel


@pytest.mark.parametrize("dtype, head_dim, ordered, kernel", [
    (BF16, 256, True, "flex"),  # Gemma2: varlen cannot cap, flex can
    (F32, 64, False, "flex"),
    (BF16, 80, True, "flex"),  # padded to 128
    (BF16, 512, True, "blockwise"),
    (F64, 64, True, "blockwise"),
])
def test_soft_capped_scores_take_flex_on_cuda_never_varlen(dtype, head_dim, ordered, kernel):
    assert kernel_for("cuda", dtype, head_dim, ordered, (9, 0), softcap=True)[0] == kernel
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match=r"'varlen' does not soft-cap"):
        attention_core(q, q, q, AttentionLayout.sequence(torch.zeros(8)), kernel="varlen", softcap=5.0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("sliding_window", [None, 9])
def test_flex_soft_capping_equals_the_blockwise_core(sliding_window):
    """Gemma2's ``c * tanh(s / c)`` as flex's ``score_mod``, eager forward on CPU in float64 (flex has
    no CPU backward; it differentiates ``score_mod`` itself), against the blockwise core's cap."""
    layout = allgather_like_layout()
    gen = torch.Generator().manual_seed(1)
    q = 3 * torch.randn(1, 43, 4, 16, generator=gen, dtype=F64)
    k, v = (3 * torch.randn(1, 83, 2, 16, generator=gen, dtype=F64) for _ in range(2))
    got = attention_kernels._run_flex(q, k, v, layout, 0.3, sliding_window, softcap=2.0, compiled=False)
    want = attention_core(q, k, v, layout, scale=0.3, sliding_window=sliding_window, softcap=2.0, kernel="blockwise")
    uncapped = attention_core(q, k, v, layout, scale=0.3, sliding_window=sliding_window, kernel="blockwise")
    assert (got - want).abs().max() < 1e-12 and (uncapped - want).abs().max() > 1e-2


def test_varlen_cu_seqlens_are_the_documents():
    """Packed: the padded document boundaries; rows laid end to end shift them by S per row."""
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 5, 9, 16]), torch.tensor([0, 6, 10, 20]))
    layout = sequence_layout(packed, 20, torch.device("cpu"))
    assert layout.sequence_ordered and layout.max_seqlen == 10
    doc = layout.q_doc
    for d, (start, end) in enumerate(zip(layout.cu_seqlens[:-1].tolist(), layout.cu_seqlens[1:].tolist())):
        assert bool((doc[start:end] == d).all()) and int((doc == d).sum()) == end - start
    rows = cu_seqlens_of_rows(layout.cu_seqlens, 3)
    assert rows.dtype == torch.int32 and rows.tolist() == [0, 6, 10, 20, 26, 30, 40, 46, 50, 60]
    dense = sequence_layout(None, 12, torch.device("cpu"))
    assert dense.cu_seqlens.tolist() == [0, 12] and dense.max_seqlen == 12
    assert cu_seqlens_of_rows(dense.cu_seqlens, 2).tolist() == [0, 12, 24]


def allgather_like_layout(sliding_window=None):
    """Queries: a zigzag-like subset in local order; keys: every token of the row, shuffled."""
    cu = torch.tensor([0, 7, 8, 40, 70, 83])
    pos = torch.arange(83)
    doc = torch.searchsorted(cu[1:], pos, right=True)
    q_idx = torch.cat([torch.arange(0, 20), torch.arange(60, 83)])
    k_idx = torch.randperm(83, generator=torch.Generator().manual_seed(0))
    return AttentionLayout(pos[q_idx], doc[q_idx], pos[k_idx], doc[k_idx])


@pytest.mark.parametrize("sliding_window", [None, 9])
def test_flex_mask_mod_is_the_reference_visibility(sliding_window):
    layout = allgather_like_layout()
    mask_mod = flex_mask_mod(layout, sliding_window)
    q_idx = torch.arange(layout.q_pos.numel())[:, None]
    kv_idx = torch.arange(layout.k_pos.numel())[None, :]
    got = mask_mod(torch.tensor(0), torch.tensor(0), q_idx, kv_idx)
    want = document_causal_mask(layout.q_pos, layout.q_doc, layout.k_pos, layout.k_doc, sliding_window)
    assert torch.equal(got, want)


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 9])
def test_flex_block_mask_covers_every_visible_pair(ordered, sliding_window):
    """Full blocks are entirely visible; every visible pair is in a full or a partial block."""
    layout = allgather_like_layout() if not ordered else AttentionLayout.sequence(
        torch.searchsorted(torch.tensor([7, 8, 40, 70, 300]), torch.arange(300), right=True))
    block = 16
    mask = flex_block_mask(layout, sliding_window, block_size=block)
    dense = document_causal_mask(layout.q_pos, layout.q_doc, layout.k_pos, layout.k_doc, sliding_window)
    n_q, n_k = -(-dense.shape[0] // block), -(-dense.shape[1] // block)
    padded = torch.zeros(n_q * block, n_k * block, dtype=torch.bool)
    padded[: dense.shape[0], : dense.shape[1]] = dense
    tiles = padded.view(n_q, block, n_k, block).transpose(1, 2)  # [n_q, n_k, block, block]
    any_visible = tiles.flatten(2).any(-1)
    listed = mask.to_dense()[0, 0].bool()  # partial or full
    full = torch.zeros_like(listed)
    for row in range(n_q):
        full[row, mask.full_kv_indices[0, 0, row, : mask.full_kv_num_blocks[0, 0, row]].long()] = True
    assert bool((listed | ~any_visible).all()), "a block with a visible pair is missing"
    sizes = torch.ones_like(padded)
    sizes[: dense.shape[0], : dense.shape[1]] = False  # padding counts as visible in a full tile
    tiles_all = (padded | sizes).view(n_q, block, n_k, block).transpose(1, 2).flatten(2).all(-1)
    assert bool((tiles_all | ~full).all()), "a full block holds a hidden pair"
    if ordered and sliding_window is None:
        assert torch.equal(listed, any_visible)  # exact in sequence order: nothing computed for nothing


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_forward_on_cpu_with_our_block_mask():
    """FlexAttention's eager forward (CPU, no grad) with our mask equals the dense reference."""
    flex_attention = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention
    layout = allgather_like_layout()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 43, 4, 16, generator=gen)
    k, v = (torch.randn(1, 83, 2, 16, generator=gen) for _ in range(2))
    mask = flex_block_mask(layout, block_size=16)
    out = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                         scale=0.3, enable_gqa=True).transpose(1, 2)
    want = reference_attention(q, k, v, layout.q_pos, layout.q_doc, layout.k_pos, layout.k_doc, scale=0.3)
    assert (out - want).abs().max() < 1e-5


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("head_dim", [24, 80])
def test_flex_pads_a_head_dim_that_is_not_a_power_of_two(head_dim):
    """DeepSeek's 192 or Phi-2's 80 on flex: zero-padded to the next power of two (q . k unchanged,
    the extra output columns dropped), forward equal to the blockwise core in float64."""
    layout = allgather_like_layout(9)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 43, 4, head_dim, generator=gen, dtype=F64)
    k, v = (torch.randn(1, 83, 2, head_dim, generator=gen, dtype=F64) for _ in range(2))
    got = attention_kernels._run_flex(q, k, v, layout, 0.2, 9, compiled=False)
    want = attention_core(q, k, v, layout, scale=0.2, sliding_window=9, kernel="blockwise")
    assert got.shape == want.shape and (got - want).abs().max() < 1e-12
    assert attention_kernels.flex_head_dim(head_dim) == {24: 32, 80: 128}[head_dim]


def test_kernel_choice_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(attention_kernels, "_LOGGED", set())
    layout = AttentionLayout.sequence(torch.zeros(8, dtype=torch.int32))
    q = torch.randn(1, 8, 2, 4)
    with caplog.at_level(logging.INFO, logger="hybridpar.models.attention.kernels"):
        attention_core(q, q, q, layout)
        attention_core(q, q, q, layout)
    lines = [r.getMessage() for r in caplog.records if r.name == "hybridpar.models.attention.kernels"]
    assert len(lines) == 1 and "blockwise" in lines[0] and "device cpu" in lines[0]


def test_unknown_kernel_names_the_choices():
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match=r"'fused'.*\['varlen', 'flex', 'blockwise'\]"):
        attention_core(q, q, q, AttentionLayout.sequence(torch.zeros(8)), kernel="fused")


def _varlen_stand_in(gqa: bool):
    """``varlen_attn`` written out in float64 on CPU, with torch 2.11's signature (windows, no
    ``enable_gqa``: unequal head counts refused, as its documentation allows only equal ones) or
    torch 2.12's (``enable_gqa``); it records the key heads it was given."""
    seen = []

    def attend_documents(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, **gqa_flag):
        assert torch.equal(cu_seq_q, cu_seq_k) and window_size[1] == 0
        if query.shape[1] != key.shape[1] and not gqa_flag.get("enable_gqa"):
            raise RuntimeError(f"Hq={query.shape[1]} != Hkv={key.shape[1]}")
        seen.append(key.shape[1])
        doc = torch.searchsorted(cu_seq_q[1:].long(), torch.arange(query.shape[0]), right=True)
        pos = torch.arange(query.shape[0])
        window = None if window_size[0] < 0 else window_size[0] + 1
        mask = document_causal_mask(pos, doc, pos, doc, window)
        return attend(query[None], key[None], value[None], mask=mask, scale=scale)[0]

    if gqa:
        def varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1), enable_gqa=False):
            return attend_documents(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                    window_size=window_size, enable_gqa=enable_gqa)
    else:
        def varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1)):
            return attend_documents(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                    window_size=window_size)
    return varlen, seen


@pytest.mark.parametrize("takes_gqa", [False, True])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_varlen_call_with_and_without_enable_gqa(monkeypatch, takes_gqa, sliding_window):
    """torch 2.11's ``varlen_attn`` (no ``enable_gqa``) gets each key/value head repeated to its query
    heads, torch >= 2.12's the grouped heads; either way the output and dq, dk, dv equal the blockwise
    core's in float64, two rows of packed documents laid end to end."""
    varlen, seen = _varlen_stand_in(takes_gqa)
    monkeypatch.setattr(attention_kernels, "_VARLEN", (varlen, takes_gqa))
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 5, 9, 16]), torch.tensor([0, 6, 10, 20]))
    layout = sequence_layout(packed, 20, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 20, 6, 8, generator=gen, dtype=F64, requires_grad=True)
    k, v = (torch.randn(2, 20, 2, 8, generator=gen, dtype=F64, requires_grad=True) for _ in "kv")
    grad = torch.randn(2, 20, 6, 8, generator=gen, dtype=F64)
    results = []
    for kernel in ("varlen", "blockwise"):
        out = attention_core(q, k, v, layout, scale=0.4, sliding_window=sliding_window, kernel=kernel)
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
    for got, want in zip(*results):
        assert got.shape == want.shape and (got - want).abs().max() < 1e-12
    assert seen == [2 if takes_gqa else 6]


@torch.library.custom_op("hybridpar_test::varlen_stand_in", mutates_args=())
def _opaque_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq: torch.Tensor, max_len: int,
                   scale: float, window: list[int]) -> torch.Tensor:
    """torch 2.11's ``varlen_attn`` stand-in as an opaque op, as torch's own is (``torch_attn::_varlen_attn``)."""
    varlen, _ = _varlen_stand_in(False)
    return varlen(query, key, value, cu_seq, cu_seq, max_len, max_len, scale=scale, window_size=tuple(window))


@_opaque_varlen.register_fake
def _(query, key, value, cu_seq, max_len, scale, window):
    return torch.empty_like(query)


def test_varlen_call_traces_whole_under_torch_compile(monkeypatch):
    """Compiled blocks run the varlen call inside their graph: the kernel's lookup, the cached
    ``cu_seqlens`` and torch 2.11's head repeat trace whole (``fullgraph``), equal to eager in float64."""
    def varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1)):
        return _opaque_varlen(query, key, value, cu_seq_q, max_q, scale, list(window_size))

    monkeypatch.setattr(attention_kernels, "_VARLEN", (varlen, False))
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 5, 9, 16]), torch.tensor([0, 6, 10, 20]))
    layout = sequence_layout(packed, 20, torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 20, 4, 8, generator=gen, dtype=F64)
    k, v = (torch.randn(1, 20, 2, 8, generator=gen, dtype=F64) for _ in "kv")
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attention_core(q, k, v, layout, kernel="varlen"), backend="eager",
                             fullgraph=True)
    assert (compiled(q, k, v) - attention_core(q, k, v, layout, kernel="blockwise")).abs().max() < 1e-12
