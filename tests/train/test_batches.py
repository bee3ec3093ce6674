"""Training batches: the same packs for a step under every layout, and held-out eval text."""

import pytest

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
                        cp_size=2, vocab_size=256, steps=3)
    whole = stream.step_packs(2)
    shares = stream.rank_packs(2, 0, 2) + stream.rank_packs(2, 1, 2)
    assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(whole, shares))


@pytest.mark.parametrize(
    "config, message",
    [
        (DataConfig(pack_size=102), "not a multiple of 2\\*cp=4"),
        (DataConfig(pad_to_multiple_of=6), "not a multiple of 2\\*cp=4"),
        (DataConfig(task="parquet"), "is unknown"),
        (DataConfig(task="jsonl", path="/no/such/file.jsonl"), "is not a file"),
    ],
)
def test_bad_data_settings_name_the_fix(config, message):
    with pytest.raises(DataError, match=message):
        PackStream(config, cp_size=2, vocab_size=256, steps=1)
