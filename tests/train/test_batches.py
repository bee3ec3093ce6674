"""Training batches: the same packs for a step under every layout, and held-out eval text."""

import pytest
import torch

from hybridpar.config import DataConfig
from hybridpar.train.batches import DataError, PackStream, load_documents


def test_text_file_holds_out_its_last_documents_for_evaluation(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(f"paragraph number {i} with some words" for i in range(20)))
    config = DataConfig(task="text", path=str(path))
    train = load_documents(config, num_docs=0, seed_offset=0, vocab_size=256)
    held_out = load_documents(config, num_docs=0, seed_offset=10_000, vocab_size=256)
    assert len(train) == 18 and len(held_out) == 2
    assert not {tuple(d) for d in train} & {tuple(d) for d in held_out}


def test_step_packs_do_not_depend_on_the_data_parallel_split():
    stream = PackStream(DataConfig(pack_size=128, packs_per_step=4, task_options={"min_len": 32, "max_len": 64, "num_kv_pairs": [2, 4]}),
                        cp_size=2, vocab_size=256)
    whole = stream.step_packs(2)
    shares = stream.rank_packs(2, 0, 2) + stream.rank_packs(2, 1, 2)
    assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(whole, shares))


@pytest.mark.parametrize(
    "config, message",
    [
        (DataConfig(pack_size=102), "pack_size=102 is not a multiple of the document padding 4"),
        (DataConfig(pad_to_multiple_of=6), "not a multiple of 2\\*cp=4"),
        (DataConfig(task="parquet"), "is unknown"),
        (DataConfig(task_options={"vocab_size": 300}), "vocab_size=300 is larger than the model's vocabulary"),
        (DataConfig(task_options={"num_kv_pair": 3}), r"\['num_kv_pair'\] do not apply to data.task='mqar'; its options"),
        (DataConfig(task_options={"num_queries": 0}), "task_options=.* do not fit data.task='mqar'"),
        (DataConfig(task="text", path=__file__, task_options={"split": "sentence"}), "split='sentence' is invalid"),
        (DataConfig(task="jsonl", path=__file__, task_options={"min_len": 3}), r"\['min_len'\] do not apply"),
        (DataConfig(task="jsonl", path="/no/such/file.jsonl"), "is not a file"),
    ],
)
def test_bad_data_settings_name_the_fix(config, message):
    with pytest.raises(DataError, match=message):
        PackStream(config, cp_size=2, vocab_size=256)


def test_the_batch_of_a_step_depends_on_neither_the_run_length_nor_the_layout():
    """Packs are drawn in fixed windows, so step k's packs are the same whether the run is
    10 or 20 steps long, asked in order or not, and at cp=1 with the padding a cp=2 run used."""
    config = DataConfig(pack_size=64, packs_per_step=3, task_options={"min_len": 16, "max_len": 48, "num_kv_pairs": 2})
    first = PackStream(config, cp_size=2, vocab_size=256)
    steps_10 = [first.step_packs(k) for k in range(10)]
    longer = PackStream(config, cp_size=1, vocab_size=256, pad_to_multiple_of=4)
    steps_20 = [longer.step_packs(k) for k in range(20)]
    again = PackStream(config, cp_size=2, vocab_size=256)
    again.step_packs(15)  # a later step first: earlier steps are drawn again from the seed
    for k in range(10):
        for a, b, c in zip(steps_10[k], steps_20[k], again.step_packs(k)):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], c["labels"])
    assert not torch.equal(steps_20[10][0]["input_ids"], steps_20[0][0]["input_ids"])  # no early cycling


def test_a_text_file_too_small_to_hold_out_evaluation_says_what_to_do(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("a single paragraph\nwith two lines and no blank line\n")
    config = DataConfig(task="text", path=str(path), pack_size=64)
    assert PackStream(config, cp_size=1, vocab_size=256).pool  # training is fine
    with pytest.raises(DataError, match="holds 1 document.*split='paragraph'.*split=line.*train.eval_every=0"):
        PackStream(config, cp_size=1, vocab_size=256, seed_offset=10_000)
    lines = DataConfig(task="text", path=str(path), pack_size=64, task_options={"split": "line"})
    assert len(load_documents(lines, 0, 10_000, 256)) == 1  # two lines: one trains, one evaluates
