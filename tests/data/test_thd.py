"""THD utilities (seed 003_*): the documented cases, the padding mask, chunking, errors,
and ``PackedSeqParams.from_batch``."""

import pytest
import torch

from hybridpar.data.packing import collate_thd, pack_documents
from hybridpar.data.thd import (
    PackedSeqParams,
    process_input_for_thd,
    split_batch_into_thd_chunks,
)

S = -1000  # default sentinel
PACK, SUB = 1024, 112


def make_batch(seq_lens, seq_lens_padded, seq_len, input_ids=None, **extra):
    seq_lens = torch.tensor(seq_lens)
    rows = seq_lens.shape[0]
    batch = {
        "input_ids": torch.zeros((rows, seq_len), dtype=torch.long) if input_ids is None else input_ids,
        "labels": torch.zeros((rows, seq_len), dtype=torch.long),
        "position_ids": torch.arange(seq_len).expand(rows, seq_len).clone(),
        "seq_lens": seq_lens,
        "seq_lens_padded": torch.tensor(seq_lens_padded),
    }
    batch.update(extra)
    return batch


def short_pack():  # 5 x 112 real tokens, 464 pad, in a 1024 pack
    return [SUB] * 5 + [S] * 4, [SUB] * 4 + [SUB + PACK - 5 * SUB] + [S] * 4


def full_pack():  # 9 x 112 real tokens, 16 pad
    return [SUB] * 9, [SUB] * 8 + [SUB + 16]


# --------------------------------------------------------------- seed's documented cases


def test_seed_docstring_example_flattens_and_builds_real_and_padded_cu_seqlens():
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 99, 4, 5], [6, 7, 8, 9, 10, 11]]),
        "labels": torch.tensor([[2, 3, 99, 4, 5, 6], [7, 8, 9, 10, 11, 12]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]]),
        "seq_lens": torch.tensor([[3, 2], [6, S]]),
        "seq_lens_padded": torch.tensor([[4, 2], [6, S]]),
    }
    out = process_input_for_thd(batch)
    assert out["input_ids"].shape == (12,) and out["input_ids"].dtype == torch.long
    assert out["labels"].tolist() == batch["labels"].reshape(-1).tolist()
    assert out["position_ids"].tolist() == batch["position_ids"].reshape(-1).tolist()
    assert out["cu_seqlens"].dtype == torch.int32 and out["cu_seqlens"].tolist() == [0, 3, 5, 11]
    assert out["cu_seqlens_padded"].dtype == torch.int32 and out["cu_seqlens_padded"].tolist() == [0, 4, 6, 12]
    assert out["max_seqlen"].dtype == torch.int32 and int(out["max_seqlen"]) == 6
    assert out["padding_mask"].tolist() == [False, False, False, True] + [False] * 8
    assert "seq_lens" not in out and "seq_lens_padded" not in out


def test_multiple_packs_per_row_real_against_padded():
    batch = make_batch([[3, 2], [2, 3]], [[4, 2], [3, 3]], 6)
    out = process_input_for_thd(batch)
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 7, 10]
    assert out["cu_seqlens_padded"].tolist() == [0, 4, 6, 9, 12]
    assert int(out["max_seqlen"]) == 3


def test_short_pack_absorbs_trailing_pad_with_truthful_max_seqlen():
    out = process_input_for_thd(make_batch([short_pack()[0]], [short_pack()[1]], PACK))
    assert out["cu_seqlens"].tolist() == [0, 112, 224, 336, 448, 1024]
    assert "cu_seqlens_padded" not in out
    assert int(out["max_seqlen"]) == 576
    # the absorbed pad is still padding: the mask comes from the real lengths
    assert out["padding_mask"].tolist() == [False] * 560 + [True] * 464


def test_full_pack_absorbs_and_bumps_max_seqlen():
    out = process_input_for_thd(make_batch([full_pack()[0]], [full_pack()[1]], PACK))
    assert int(out["cu_seqlens"][-1]) == PACK
    assert "cu_seqlens_padded" not in out
    assert int(out["max_seqlen"]) == 128


def test_two_chunks_mixed_full_and_short_give_per_chunk_max_seqlen():
    batch = make_batch([full_pack()[0], short_pack()[0]], [full_pack()[1], short_pack()[1]], PACK)
    out = split_batch_into_thd_chunks(batch, num_chunks=2)
    assert "cu_seqlens_padded" not in out
    assert out["input_ids"].shape == (2, PACK) and out["padding_mask"].shape == (2, PACK)
    assert out["max_seqlen"].tolist() == [128, 576]
    assert out["cu_seqlens"][0].tolist() == [0, 112, 224, 336, 448, 560, 672, 784, 896, 1024]
    assert out["cu_seqlens"][1].tolist() == [0, 112, 224, 336, 448, 1024, S, S, S, S]


def test_no_absorption_when_padding_sits_between_documents():
    out = process_input_for_thd(make_batch([[5, 3, S]], [[8, 8, S]], 16))
    assert out["cu_seqlens"].tolist() == [0, 5, 8]  # cumulative real lengths
    assert out["cu_seqlens_padded"].tolist() == [0, 8, 16]  # memory offsets
    assert int(out["max_seqlen"]) == 5  # widest slot of the real cu_seqlens
    assert out["padding_mask"].tolist() == [False] * 5 + [True] * 3 + [False] * 3 + [True] * 5


def test_sentinel_entries_are_filtered_and_a_short_row_fills_its_last_document():
    out = process_input_for_thd(make_batch([[4, S, S], [2, 2, 2]], [[4, S, S], [2, 2, 2]], 6))
    # row 0 holds one 4-token document in a 6-token row: its last 2 slots belong to it as padding
    assert out["cu_seqlens"].tolist() == [0, 4, 6, 8, 10]
    assert out["cu_seqlens_padded"].tolist() == [0, 6, 8, 10, 12]
    assert out["padding_mask"][:6].tolist() == [False] * 4 + [True] * 2


def test_custom_sentinel_pads_chunked_cu_seqlens():
    sentinel = -999
    batch = make_batch([[3, 3], [6, sentinel]], [[3, 3], [6, sentinel]], 6)
    out = split_batch_into_thd_chunks(batch, num_chunks=2, seq_lens_padding_value=sentinel)
    assert out["cu_seqlens"].tolist() == [[0, 3, 6], [0, 6, sentinel]]
    assert out["max_seqlen"].tolist() == [3, 6]


@pytest.mark.parametrize("num_chunks", [0, 1])
def test_one_chunk_or_fewer_equals_unchunked(num_chunks):
    batch = make_batch([[3, 2], [6, S]], [[4, 2], [6, S]], 6, qkv_format="thd")
    chunked, plain = split_batch_into_thd_chunks(batch, num_chunks), process_input_for_thd(batch)
    assert chunked.keys() == plain.keys()
    for key in plain:
        assert torch.equal(chunked[key], plain[key]) if torch.is_tensor(plain[key]) else chunked[key] == plain[key]


def test_eight_chunks_stack_and_pass_keys_through():
    rows, seq_len = 16, 8
    batch = make_batch([[seq_len]] * rows, [[seq_len]] * rows, seq_len, qkv_format="thd", sample_weight=torch.arange(rows))
    out = split_batch_into_thd_chunks(batch, num_chunks=8)
    assert out["input_ids"].shape == (8, 2 * seq_len) and out["labels"].shape == (8, 2 * seq_len)
    assert out["cu_seqlens"].tolist() == [[0, 8, 16]] * 8
    assert out["qkv_format"] == "thd"
    assert out["sample_weight"].tolist() == [[2 * i, 2 * i + 1] for i in range(8)]


def test_chunk_count_must_divide_the_batch():
    batch = make_batch([[6]] * 3, [[6]] * 3, 6)
    with pytest.raises(ValueError, match="not divisible by num_chunks=2.*multiple"):
        split_batch_into_thd_chunks(batch, num_chunks=2)


def test_other_keys_pass_through_unchanged():
    pixels = torch.randn(2, 3)
    out = process_input_for_thd(make_batch([[6], [6]], [[6], [6]], 6, qkv_format="thd", pixel_values=pixels, note=None))
    assert out["qkv_format"] == "thd" and out["pixel_values"] is pixels and "note" in out


def test_embeddings_flatten_to_tokens_by_hidden():
    embeds = torch.randn(2, 6, 4)
    out = process_input_for_thd(make_batch([[6], [3]], [[6], [6]], 6, input_ids=embeds))
    assert out["input_ids"].shape == (12, 4) and torch.equal(out["input_ids"], embeds.reshape(12, 4))
    assert out["padding_mask"].tolist() == [False] * 9 + [True] * 3


def test_mrope_position_ids_keep_rope_axis_and_a_unit_batch_axis():
    rows, seq_len = 4, 6
    batch = make_batch([[seq_len]] * rows, [[seq_len]] * rows, seq_len)
    batch["position_ids"] = torch.arange(3 * rows * seq_len).reshape(3, rows, seq_len)
    out = process_input_for_thd(batch)
    assert out["position_ids"].shape == (3, 1, rows * seq_len)
    assert torch.equal(out["position_ids"][:, 0], batch["position_ids"].reshape(3, -1))
    chunked = split_batch_into_thd_chunks(batch, num_chunks=2)
    assert chunked["position_ids"].shape == (3, 2, 2 * seq_len)
    assert torch.equal(chunked["position_ids"][:, 1], batch["position_ids"][:, 2:].reshape(3, -1))


# ----------------------------------------------------------------------- padding mask


def test_pad_id_equal_to_eos_does_not_mask_real_eos_tokens():
    eos = 2
    ids = torch.tensor([[5, 6, eos, 7, eos, eos, eos, eos]])  # two documents ending in EOS, then pad (= EOS)
    out = process_input_for_thd(make_batch([[3, 2]], [[3, 5]], 8, input_ids=ids), padding_token_id=eos)
    assert out["padding_mask"].tolist() == [False] * 5 + [True] * 3


def test_content_token_equal_to_pad_id_is_not_masked():
    ids = torch.tensor([[0, 4, 0, 5, 0, 0]])
    out = process_input_for_thd(make_batch([[4]], [[6]], 6, input_ids=ids), padding_token_id=0)
    assert out["padding_mask"].tolist() == [False] * 4 + [True] * 2


def test_token_id_fallback_without_seq_lens_makes_one_document_per_row():
    batch = {"input_ids": torch.tensor([[4, 5, 6, 0], [7, 8, 0, 0]]), "position_ids": torch.arange(4).expand(2, 4)}
    out = process_input_for_thd(batch)
    assert out["padding_mask"].tolist() == [False, False, False, True, False, False, True, True]
    assert out["cu_seqlens"].tolist() == [0, 3, 5] and out["cu_seqlens_padded"].tolist() == [0, 4, 8]


def test_token_id_fallback_raises_when_pad_id_is_also_content():
    batch = {"input_ids": torch.tensor([[4, 0, 6, 0]]), "position_ids": torch.arange(4)[None]}
    with pytest.raises(ValueError, match="also occurs as content.*pass seq_lens"):
        process_input_for_thd(batch)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "seq_lens, seq_lens_padded, match",
    [
        ([[3, 3], [6]], [[3, 3], [6]], "ragged.*pad every row"),  # ragged nested lists
        ([[3, 3], [6, S]], [[3, 3], [6, 0]], "sentinel .* in the same slots"),
        ([[3, 3, 3]], [[3, 3, 3]], "exceed the row length 6.*larger pack_size"),
        ([[-2, 6]], [[-2, 6]], "must be positive.*sentinel"),
        ([[4, 2]], [[3, 3]], "shorter than its real length"),
        ([[S, S]], [[S, S]], "hold no document.*drop empty rows"),
        ([[3.0, 3.0]], [[3.0, 3.0]], "integer lengths.*long"),
    ],
)
def test_bad_seq_lens_raise_with_the_fix(seq_lens, seq_lens_padded, match):
    rows = len(seq_lens)
    batch = {
        "input_ids": torch.ones((rows, 6), dtype=torch.long),
        "labels": torch.ones((rows, 6), dtype=torch.long),
        "position_ids": torch.zeros((rows, 6), dtype=torch.long),
        "seq_lens": seq_lens,
        "seq_lens_padded": seq_lens_padded,
    }
    with pytest.raises(ValueError, match=match):
        process_input_for_thd(batch)


def test_wrong_row_count_of_seq_lens_raises():
    batch = make_batch([[6], [6]], [[6], [6]], 6)
    batch["seq_lens"] = batch["seq_lens_padded"] = torch.tensor([[6], [6], [6]])
    with pytest.raises(ValueError, match=r"shape \(3, 1\) but the batch has 2 rows"):
        process_input_for_thd(batch)


@pytest.mark.parametrize("missing", ["input_ids", "position_ids"])
def test_missing_needed_keys_raise_with_the_fix(missing):
    batch = make_batch([[6]], [[6]], 6)
    del batch[missing]
    with pytest.raises(ValueError, match=f"missing \\['{missing}'\\].*collate_thd"):
        process_input_for_thd(batch)


def test_seq_lens_padded_without_seq_lens_raises():
    batch = make_batch([[6]], [[6]], 6)
    del batch["seq_lens"]
    with pytest.raises(ValueError, match="without seq_lens"):
        process_input_for_thd(batch)


def test_mismatched_label_and_position_shapes_raise():
    batch = make_batch([[6]], [[6]], 6)
    with pytest.raises(ValueError, match="labels shape"):
        process_input_for_thd({**batch, "labels": torch.zeros(1, 5, dtype=torch.long)})
    with pytest.raises(ValueError, match="position_ids shape"):
        process_input_for_thd({**batch, "position_ids": torch.zeros(1, 5, dtype=torch.long)})


# ---------------------------------------------------------------- PackedSeqParams.from_batch


def packed_row(cp_size):
    docs = [list(range(1, 8)), list(range(10, 13)), list(range(20, 37))]  # 7, 3, 17 tokens
    packs = pack_documents(docs, 32, cp_size=cp_size)
    assert len(packs) == 1
    return packs[0], process_input_for_thd(collate_thd(packs))


@pytest.mark.parametrize("cp_size", [1, 2])
def test_from_batch_on_a_packed_row(cp_size):
    pack, thd = packed_row(cp_size)
    params = PackedSeqParams.from_batch(thd)
    padded = pack["seq_lens_padded"]
    starts = torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)])
    assert params.cu_seqlens_padded.tolist() == starts.tolist()
    assert params.total_tokens == 32 and params.qkv_format == "thd"
    assert params.seq_idx.shape == (1, 32) and params.position_ids.shape == (1, 32)
    assert params.seq_idx[0].tolist() == torch.repeat_interleave(torch.arange(len(padded)), padded).tolist()
    assert torch.equal(params.position_ids[0], pack["position_ids"])
    if cp_size == 1:  # no padding between documents: the trailing pad was absorbed
        assert torch.equal(params.cu_seqlens, params.cu_seqlens_padded)
    else:
        assert params.cu_seqlens.tolist() == torch.cat([torch.zeros(1, dtype=torch.long), pack["seq_lens"].cumsum(0)]).tolist()
    assert PackedSeqParams.from_batch(collate_thd([pack])).cu_seqlens_padded.tolist() == starts.tolist()  # collated input
    one_chunk = {k: (v[None] if torch.is_tensor(v) and k != "max_seqlen" else v) for k, v in thd.items()}
    assert torch.equal(PackedSeqParams.from_batch(one_chunk).seq_idx, params.seq_idx)


def test_from_batch_rejects_layouts_that_do_not_cover_the_row():
    _, thd = packed_row(2)
    with pytest.raises(ValueError, match="must end at the row's token count 32"):
        PackedSeqParams.from_batch({**thd, "cu_seqlens_padded": thd["cu_seqlens_padded"][:-1]})
    with pytest.raises(ValueError, match="strictly increase"):
        bad = thd["cu_seqlens_padded"].clone()
        bad[1] = 0
        PackedSeqParams.from_batch({**thd, "cu_seqlens_padded": bad})
    with pytest.raises(ValueError, match="do not restart at every document start"):
        PackedSeqParams.from_batch({**thd, "position_ids": torch.arange(32)})
    with pytest.raises(ValueError, match="2 stacked chunks.*select a chunk"):
        two = collate_thd(pack_documents([[1] * 30, [2] * 30], 32, cp_size=2))
        PackedSeqParams.from_batch(split_batch_into_thd_chunks(two, 2))


def test_from_cu_seqlens_and_for_dense_keep_their_behaviour():
    params = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 3, 5]), torch.tensor([0, 4, 8]))
    assert params.seq_idx.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
    assert params.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert params.max_seqlen == 4
    dense = PackedSeqParams.for_dense(6)
    assert dense.qkv_format == "bshd" and dense.cu_seqlens.tolist() == [0, 6] and dense.seq_idx.tolist() == [[0] * 6]


def test_packed_params_survive_fsdp_input_casting_with_a_fresh_cache():
    """FSDP2's mixed precision casts forward inputs by ``dataclasses.replace`` of every field
    (``parallel.mixed_precision=bf16`` failed on every packed run while the cache was a field)."""
    import dataclasses

    from torch.distributed.utils import _apply_to_tensors

    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 3, 8], dtype=torch.int32))
    packed.cache["plan"] = torch.arange(3)
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, packed)
    assert isinstance(cast, PackedSeqParams) and cast.cache == {}
    assert torch.equal(cast.seq_idx, packed.seq_idx) and cast.max_seqlen == packed.max_seqlen
    assert "cache" not in {f.name for f in dataclasses.fields(PackedSeqParams)}
