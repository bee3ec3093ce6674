"""DualChunkSwap index math: property tests against a plain chunk-by-chunk reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpar.data.thd import PackedSeqParams
from hybridpar.parallel.context.zigzag import build_cp_layout, localize, zigzag_indices

CP_SIZES = [1, 2, 3, 4, 8]


def reference_indices(doc_lengths: list[int], cp: int, rank: int) -> list[int]:
    """Rank ``rank``'s tokens written out chunk by chunk: doc d chunk r, then chunk 2cp-1-r."""
    out, start = [], 0
    for length in doc_lengths:
        tokens = list(range(start, start + length))
        c = length // (2 * cp)
        chunks = [tokens[i * c : (i + 1) * c] for i in range(2 * cp)]
        out += chunks[rank] + chunks[2 * cp - 1 - rank]
        start += length
    return out


@st.composite
def packed_layouts(draw):
    """``(cp, padded doc lengths, real doc lengths)``, each padded length a multiple of 2*cp."""
    cp = draw(st.sampled_from(CP_SIZES))
    multiples = draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    padded = [m * 2 * cp for m in multiples]
    real = [draw(st.integers(1, p)) for p in padded]
    return cp, padded, real


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@settings(max_examples=150, deadline=None)
@given(packed_layouts())
def test_packed_indices_match_chunk_reference(layout):
    cp, padded, _ = layout
    total = sum(padded)
    per_rank = [zigzag_indices(cu(padded), cp, r) for r in range(cp)]
    for r, idx in enumerate(per_rank):
        assert idx.dtype == torch.int64
        assert idx.shape == (total // cp,)
        assert idx.tolist() == reference_indices(padded, cp, r)
    union = torch.cat(per_rank)
    assert torch.equal(union.sort().values, torch.arange(total))  # a permutation of range(T)


@settings(max_examples=150, deadline=None)
@given(packed_layouts())
def test_layout_permutations_round_trip(layout):
    cp, padded, real = layout
    total = sum(padded)
    x = torch.randn(2, total, 3, dtype=torch.float64)
    docs = torch.repeat_interleave(torch.arange(len(padded)), torch.tensor(padded))
    layouts = [build_cp_layout(cu(padded), cp, r) for r in range(cp)]
    shards = [x[:, lay.local_indices] for lay in layouts]  # what each rank holds
    for r, lay in enumerate(layouts):
        assert (lay.cp_size, lay.cp_rank) == (cp, r)
        assert torch.equal(lay.local_indices, zigzag_indices(cu(padded), cp, r))
        assert torch.equal(lay.gathered_indices, torch.cat([l.local_indices for l in layouts]))
        assert torch.equal(lay.gathered_to_sequence, torch.argsort(lay.gathered_indices))
        assert lay.global_seq_idx.shape == (1, total) and lay.global_seq_idx.dtype == torch.int32
        assert torch.equal(lay.global_seq_idx[0].long(), docs)
        gathered = torch.cat(shards, dim=1)  # an all-gather along the sequence: rank-major
        assert torch.equal(gathered[:, lay.gathered_to_sequence], x)
        assert torch.equal(x[:, lay.gathered_indices][:, lay.gathered_to_sequence], x)
        assert torch.equal(x[:, lay.gathered_to_sequence][:, lay.gathered_indices], x)
        assert torch.equal(gathered[:, lay.gathered_to_sequence][:, lay.local_indices], shards[r])

    params = PackedSeqParams.from_cu_seqlens(cu(real), cu(padded))
    for r in range(cp):
        view = localize(params, cp, r)
        idx = view.cp.local_indices
        assert view.seq_idx.shape == view.position_ids.shape == (1, total // cp)
        assert torch.equal(view.seq_idx, params.seq_idx[:, idx])
        assert torch.equal(view.position_ids, params.position_ids[:, idx])
        assert torch.equal(view.cu_seqlens, params.cu_seqlens)
        assert torch.equal(view.cu_seqlens_padded, params.cu_seqlens_padded)
        assert view.max_seqlen == params.max_seqlen and view.qkv_format == "thd"
        # local document boundaries are cu_seqlens_padded / cp, as every CP consumer assumes
        counts = torch.bincount(view.seq_idx[0].long(), minlength=len(padded))
        assert counts.tolist() == [p // cp for p in padded]
        assert bool((view.seq_idx[0][1:] >= view.seq_idx[0][:-1]).all())
    assert params.cp is None  # localize does not mutate the global params


@pytest.mark.parametrize("cp", CP_SIZES)
def test_dense_matches_megatron_reshape(cp):
    seq_len = 2 * cp * 3
    for r in range(cp):
        expected = torch.arange(seq_len).view(2 * cp, -1)[[r, 2 * cp - 1 - r]].flatten()
        assert torch.equal(zigzag_indices(seq_len, cp, r), expected)
        assert torch.equal(zigzag_indices(torch.tensor([0, seq_len]), cp, r), expected)
    dense = localize(PackedSeqParams.for_dense(seq_len), cp, cp - 1)
    assert dense.qkv_format == "bshd"
    assert torch.equal(dense.position_ids[0], zigzag_indices(seq_len, cp, cp - 1))


def test_example_cp2():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_indices(torch.tensor([0, 4, 12]), 2, 1).tolist() == [1, 2, 6, 7, 8, 9]


def test_cp1_is_identity():
    lay = build_cp_layout(torch.tensor([0, 3, 10]), 1, 0)  # no divisibility rule at cp=1
    assert torch.equal(lay.local_indices, torch.arange(10))
    assert torch.equal(lay.gathered_to_sequence, torch.arange(10))


def test_bad_dense_length_names_value_and_fix():
    with pytest.raises(ValueError, match=r"sequence length 10 .*2\*cp = 4.*multiple of 4"):
        zigzag_indices(10, 2, 0)


def test_bad_packed_length_names_document_and_fix():
    with pytest.raises(ValueError, match=r"document 1 .*length 6.*2\*cp = 4.*cp_size=2"):
        zigzag_indices(torch.tensor([0, 4, 10, 14]), 2, 0)
    with pytest.raises(ValueError, match=r"document 0 .*length 8.*2\*cp = 6"):
        build_cp_layout(torch.tensor([0, 8]), 3, 2)


@pytest.mark.parametrize(
    ("arg", "cp", "rank", "pattern"),
    [
        (8, 0, 0, "cp_size must be >= 1"),
        (8, 2, 2, r"cp_rank must be in \[0, cp_size=2\)"),
        (8, 2, -1, "cp_rank must be in"),
        (0, 1, 0, "positive"),
        (torch.tensor([1, 8]), 2, 0, "must start at 0"),
        (torch.tensor([0, 4, 4]), 2, 0, "strictly increase"),
        (torch.tensor([[0, 4]]), 2, 0, "1-D"),
    ],
)
def test_bad_arguments(arg, cp, rank, pattern):
    with pytest.raises(ValueError, match=pattern):
        zigzag_indices(arg, cp, rank)


def test_localize_rejects_views_and_partial_metadata():
    params = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="already localized"):
        localize(localize(params, 2, 0), 2, 1)
    params.seq_idx = params.seq_idx[:, :4]
    with pytest.raises(ValueError, match="cover all cu_seqlens_padded"):
        localize(params, 2, 0)
