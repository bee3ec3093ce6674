"""The packer and the collators: properties (hypothesis) and the documented rules."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpar.data.packing import (
    IGNORE_INDEX,
    collate_padded,
    collate_thd,
    document_tokens_and_labels,
    pack_documents,
    padding_fraction,
)
from hybridpar.data.thd import PackedSeqParams, process_input_for_thd


@st.composite
def packing_cases(draw):
    cp_size = draw(st.sampled_from([1, 2, 4]))
    multiple = 1 if cp_size == 1 else 2 * cp_size
    pack_size = multiple * draw(st.integers(min_value=max(1, 4 // multiple), max_value=64 // multiple))
    docs = draw(st.lists(st.lists(st.integers(1, 255), min_size=1, max_size=80), min_size=1, max_size=12))
    return docs, pack_size, cp_size, multiple


def pack_quietly(docs, pack_size, cp_size, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pack_documents(docs, pack_size, cp_size=cp_size, **kwargs)


@settings(max_examples=60, deadline=None)
@given(packing_cases())
def test_every_real_token_appears_once_and_in_order(case):
    docs, pack_size, cp_size, _ = case
    packs = pack_quietly(docs, pack_size, cp_size)
    pieces = {i: [] for i in range(len(docs))}  # document -> [(offset, tokens, labels)]
    for pack in packs:
        starts = torch.cat([torch.zeros(1, dtype=torch.long), pack["seq_lens_padded"].cumsum(0)[:-1]])
        for start, length, index, offset in zip(starts, pack["seq_lens"], pack["document_index"], pack["document_offset"]):
            span = slice(int(start), int(start) + int(length))
            pieces[int(index)].append((int(offset), pack["input_ids"][span].tolist(), pack["labels"][span].tolist()))
    for index, doc in enumerate(docs):
        ordered = sorted(pieces[index])
        assert [o for o, _, _ in ordered] == list(range(0, len(doc), pack_size))  # each piece once
        assert sum((t for _, t, _ in ordered), []) == doc
        assert sum((l for _, _, l in ordered), []) == doc[1:] + [IGNORE_INDEX]  # shifted within the document


@settings(max_examples=60, deadline=None)
@given(packing_cases())
def test_pack_layout_padding_and_seq_idx(case):
    docs, pack_size, cp_size, multiple = case
    packs = pack_quietly(docs, pack_size, cp_size)
    for pack in packs:
        real, padded = pack["seq_lens"], pack["seq_lens_padded"]
        assert int(padded.sum()) == pack_size
        assert bool((padded % multiple == 0).all()) and bool((padded >= real).all()) and bool((real > 0).all())
        assert bool((padded[:-1] - real[:-1] < multiple).all())  # only the last document takes pack padding
        thd = process_input_for_thd(collate_thd([pack]))
        assert bool((thd["labels"][thd["padding_mask"]] == IGNORE_INDEX).all())
        assert int((~thd["padding_mask"]).sum()) == int(real.sum())
        params = PackedSeqParams.from_batch(thd)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)[:-1]])
        changes = torch.nonzero(params.seq_idx[0, 1:] != params.seq_idx[0, :-1]).flatten() + 1
        assert changes.tolist() == starts[1:].tolist()  # seq_idx changes exactly at document starts
        assert bool((params.position_ids[0, starts] == 0).all())
        assert torch.equal(params.position_ids[0], pack["position_ids"])


def test_best_fit_decreasing_fills_packs():
    docs = [[1] * n for n in (6, 2, 4, 6, 2, 4)]
    packs = pack_documents(docs, 8)
    assert len(packs) == 3 and padding_fraction(packs) == 0.0
    assert sorted(sorted(p["seq_lens"].tolist()) for p in packs) == [[2, 6], [2, 6], [4, 4]]
    assert [p["document_index"].tolist() for p in packs] == [[0, 1], [2, 5], [3, 4]]  # input order kept


def test_cp_padding_layout_of_one_pack():
    pack = pack_documents([[5, 6, 7], [8, 9, 10, 11, 12]], 16, cp_size=2, pad_id=0)[0]
    assert pack["seq_lens"].tolist() == [3, 5] and pack["seq_lens_padded"].tolist() == [4, 12]
    assert pack["input_ids"].tolist() == [5, 6, 7, 0, 8, 9, 10, 11, 12] + [0] * 7
    assert pack["labels"].tolist() == [6, 7, -100, -100, 9, 10, 11, 12, -100] + [-100] * 7
    assert pack["position_ids"].tolist() == [0, 1, 2, 3] + list(range(12))


def test_mapping_documents_keep_their_own_labels():
    doc = {"input_ids": [4, 5, 6, 7], "labels": [-100, 6, -100, -100]}
    pack = pack_documents([doc], 4)[0]
    assert pack["labels"].tolist() == doc["labels"]
    with pytest.raises(ValueError, match="one \\(already shifted\\) label per token"):
        document_tokens_and_labels({"input_ids": [1, 2], "labels": [1]})


def test_overlong_documents_are_split_or_dropped_with_a_warning():
    docs = [[1] * 20, [2] * 3, [], [3] * 9]
    with pytest.warns(UserWarning, match="split 2 documents.*dropped 0.*skipped 1 empty"):
        packs = pack_documents(docs, 8)
    assert sorted(int(n) for p in packs for n in p["seq_lens"]) == [1, 3, 4, 8, 8, 8]
    with pytest.warns(UserWarning, match="split 0 documents.*dropped 2 such documents \\(29 tokens\\)"):
        packs = pack_documents(docs, 8, overlong="drop")
    assert [p["seq_lens"].tolist() for p in packs] == [[3]]
    with pytest.raises(ValueError, match="document 0 has 20 tokens.*overlong='split'"):
        pack_documents(docs, 8, overlong="error")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pack_documents([[1] * 8], 8)  # nothing to report: no warning


@pytest.mark.parametrize("pack_size, cp_size", [(12, 4), (10, 8), (7, 2)])
def test_pack_size_must_divide_by_two_cp(pack_size, cp_size):
    with pytest.raises(ValueError, match=f"pack_size={pack_size} is not a multiple of {2 * cp_size}.*use pack_size="):
        pack_documents([[1, 2]], pack_size, cp_size=cp_size)


def test_bad_options_raise():
    with pytest.raises(ValueError, match="overlong="):
        pack_documents([[1]], 8, overlong="truncate")
    with pytest.raises(ValueError, match="cp_size must be a positive int"):
        pack_documents([[1]], 8, cp_size=0)


def test_collate_thd_pads_seq_lens_with_the_sentinel():
    packs = pack_documents([[1] * 3, [2] * 3, [3] * 8], 8)
    batch = collate_thd(packs)
    assert batch["input_ids"].shape == (2, 8) and batch["qkv_format"] == "thd"
    assert batch["seq_lens"].tolist() == [[3, 3], [8, -1000]]
    assert batch["seq_lens_padded"].tolist() == [[3, 5], [8, -1000]]
    thd = process_input_for_thd(batch)
    assert thd["cu_seqlens"].tolist() == [0, 3, 6, 14] and thd["cu_seqlens_padded"].tolist() == [0, 3, 8, 16]
    assert collate_thd(packs, seq_lens_padding_value=-7)["seq_lens"].tolist() == [[3, 3], [8, -7]]
    with pytest.raises(ValueError, match="different lengths"):
        collate_thd(packs + pack_documents([[1]], 4))


def test_collate_padded_pads_to_longest_or_a_multiple():
    batch = collate_padded([[5, 6, 7], [8, 9]], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["labels"].tolist() == [[6, 7, -100], [9, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2]] * 2 and batch["qkv_format"] == "bshd"
    wide = collate_padded([[5, 6, 7], [8, 9]], pad_to_multiple_of=4)
    assert wide["input_ids"].shape == (2, 4) and wide["seq_lens"].tolist() == [[3], [2]]
    thd = process_input_for_thd(wide)  # one document per row
    assert thd["cu_seqlens"].tolist() == [0, 3, 5] and thd["cu_seqlens_padded"].tolist() == [0, 4, 8]
    with pytest.raises(ValueError, match="empty"):
        collate_padded([[1], []])
