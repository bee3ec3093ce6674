"""Round 18 of fault hunting (docs/reliability.md, "Round 18"): the data path and the config as a careful user
meets them; every case in this process (the CLI's config loading, the data readers)."""

from __future__ import annotations

import pytest

from tests.train.fault_probes import one_line


def _refusal(overrides, path=None) -> str:
    from hybridpar.config import ConfigError, load_config

    with pytest.raises(ConfigError) as error:
        load_config(path, overrides)
    return one_line(error)


@pytest.mark.parametrize("override, fix", [
    ("plot=yes", "write plot=true"), ("tensorboard=Off", "write tensorboard=false"), ("plot=n", "write plot=false"),
    ("train.lr=inf", ".inf"), ("train.grad_clip=NaN", ".nan"), ("train.lr=-Infinity", "finite"),
    ("train.steps=1e3", "write train.steps=1000"), ("data.pack_size=64.0", "write data.pack_size=64"),
    ("parallel.cp=2e0", "write parallel.cp=2"),
])
def test_a_value_spelled_as_yaml_1_1_or_a_float_is_told_its_spelling(override, fix):
    """Before: ``plot=yes``, ``train.lr=inf`` and ``train.steps=1e3`` were told only "it must be true or false (got
    str)", "a number (got str)" (of a number) or "an integer (got float)" (of 1000): YAML 1.2 reads yes/no/on/off as
    text, infinity as ``.inf``, and an exponent or a point as a float; the message now says so and gives the spelling."""
    message = _refusal([override])
    assert fix in message and "YAML" in message, message


def test_a_yaml_1_1_spelling_in_the_file_is_told_too(tmp_path):
    """The same values in a config file (``plot: on``, ``steps: 1e3``)."""
    path = tmp_path / "run.yaml"
    path.write_text("plot: on\n")
    assert "write plot=true" in _refusal([], path)
    path.write_text("train:\n  steps: 1e3\n")
    assert "write train.steps=1000" in _refusal([], path)


@pytest.mark.parametrize("argv, joined", [
    (["train.lr", "=", "1e-3"], "train.lr=1e-3"), (["train.lr", "=1e-3"], "train.lr=1e-3"),
    (["train.steps=2", "train.lr=", "1e-3"], "train.lr=1e-3"), (["data.path", "=", "a b.txt"], "data.path=a b.txt"),
])
def test_an_override_split_at_spaces_around_its_equals_is_shown_joined(argv, joined):
    """Before: ``train.lr = 1e-3`` (three words to the shell) said "override 'train.lr' is not key=value", and
    ``train.lr= 1e-3`` said it of '1e-3', neither naming the spaces."""
    message = _refusal(argv)
    assert f"'{joined}'" in message and "spaces around '='" in message, message


def test_a_yaml_file_passed_as_an_override_is_pointed_at_config():
    """Before: ``hybridpar train configs/tiny-hybrid.yaml`` said "is not key=value; write e.g. train.steps=100"."""
    for name in ("configs/tiny-hybrid.yaml", "my.YML"):
        assert f"--config {name}" in _refusal([name])
    assert "write e.g. train.steps=100" in _refusal(["steps"])  # any other word: the old message


@pytest.mark.parametrize("text", ["train:\n\tsteps: 2\n", "train:\n  steps:\t2\n", "train:\n    steps: 2\n\tlr: 1\n"])
def test_a_tab_in_a_config_file_is_named_as_a_tab(tmp_path, text):
    """Before: "found character '\\t' that cannot start any token", PyYAML's words for a tab."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    message = _refusal([], path)
    assert "a tab character" in message and "replace the tabs with spaces" in message and "\\t" not in message, message


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A ``save_to_disk`` DatasetDict with an empty split, a saved Dataset, a parquet file and a folder of parquet."""
    datasets = pytest.importorskip("datasets")
    folder = tmp_path_factory.mktemp("hf")
    rows = datasets.Dataset.from_dict({"text": [f"row {i} of text" for i in range(8)]})
    datasets.DatasetDict({"train": rows, "validation": rows.select(range(3)), "empty": rows.select([])}).save_to_disk(
        str(folder / "dict"))
    rows.save_to_disk(str(folder / "one"))
    rows.to_parquet(str(folder / "rows.parquet"))
    (folder / "pq").mkdir()
    rows.to_parquet(str(folder / "pq" / "train-0.parquet"))
    rows.select(range(2)).to_parquet(str(folder / "pq" / "test-0.parquet"))
    return folder


@pytest.mark.parametrize("where, split, said", [
    ("dict", "validation", None), ("dict", "train", None), ("pq", "test", None),
    ("dict", "empty", "split 'empty' of"), ("dict", "test", "has splits ['empty', 'train', 'validation'], not 'test'"),
    ("one", "validation", "is one saved Dataset (no splits)"),
    ("rows.parquet", "validation", "has splits ['train'], not 'validation' (a data file alone is the split 'train')"),
    ("pq", "validation", "has splits ['train', 'test'], not 'validation'; pass one of them"),
])
def test_a_split_the_dataset_does_not_have_or_holds_empty_is_one_line(saved, where, split, said):
    """Before: a DatasetDict saved with an empty split was an IndexError traceback from ``load_from_disk`` for every
    split (it read them all); a saved Dataset took ``split=validation`` and trained on its every row without a word;
    a data file or folder without the split said "cannot be read ...; fix the file" of a file that is fine."""
    from hybridpar.data.hf_datasets import hf_dataset_documents

    if said is None:
        assert hf_dataset_documents(saved / where, split=split)
        return
    with pytest.raises(ValueError) as error:
        hf_dataset_documents(saved / where, split=split)
    message = one_line(error)
    assert said in message and "data.task_options.split" in message and "fix the file" not in message, message


@pytest.mark.parametrize("lines, said", [
    (['[{"role": "user", "content": "hi", "name": "x"}, {"role": "assistant", "content": "yo", "weight": 1}]'] * 3,
     "a conversation as a bare list of messages"),
    (['[{"role": "user", "content": "hi"}]'], "a conversation as a bare list of messages"),
    (['[{"text": "a"}, {"text": "b"}]', '[{"text": "c"}]'], "a list of records on one line (the file has more lines)"),
    (['[{"text": "a"}, {"text": "b"}]'], "the file is one JSON array"),
])
def test_a_json_lines_file_of_arrays_is_told_what_its_lines_hold(tmp_path, lines, said):
    """Before: a chat JSONL whose every line is a conversation as a bare list of messages (``[{"role": ...}, ...]``)
    was told "the file is one JSON array, not JSON lines" with ``jq -c '.[]'``, which would split each conversation
    into one line per message; so was a file of several array lines."""
    from hybridpar.data.sources import read_jsonl

    path = tmp_path / "rows.jsonl"
    path.write_text("\r\n".join(lines) + "\r\n")
    with pytest.raises(ValueError) as error:
        list(read_jsonl(path))
    message = one_line(error)
    assert said in message, message
    if "conversation" in said:
        assert "jq -c '{messages: .}'" in message and "'.[]'" not in message, message


def test_a_pack_count_beyond_what_a_step_can_hold_is_refused_by_the_config():
    """Before: ``hybridpar plan data.packs_per_step=10**12`` was a MemoryError traceback (the plan tallies each pack),
    while ``train --dry-run`` took the value; both are now refused by the key's rule, and so is ``train.eval_packs``."""
    from tests.train.fault_probes import cli

    for key in ("data.packs_per_step", "train.eval_packs"):
        assert f"{key}=1000000000000 is invalid" in _refusal([f"{key}=1000000000000"])
        code, output = cli("plan", "model.preset=tiny", "parallel.cp=1", f"{key}=1000000000000")
        assert code == 2 and "<= 2**24" in output and "Traceback" not in output, output
    from hybridpar.config import load_config

    assert load_config(None, ["data.packs_per_step=16777216"]).data.packs_per_step == 2**24


def test_plan_fit_bounds_its_search_and_does_not_recommend_what_train_refuses():
    """Before: ``plan --fit 80 --world-size 100000000`` ran for minutes (27,225 layouts, each validated and priced; the
    divisors found by trying every number up to the world size), and at a prime world size of 2**31-1 it recommended
    ``data.packs_per_step=2147483647``, more packs than ``train`` takes."""
    import time

    from hybridpar.config import load_config
    from hybridpar.plan.search import divisor_layouts, search_layouts

    started = time.perf_counter()
    assert len(divisor_layouts(2**31 - 1)) == 4 and len(divisor_layouts(12)) == 40
    assert time.perf_counter() - started < 1
    config = load_config(None, ["model.preset=tiny", "parallel.cp=1"])
    with pytest.raises(ValueError) as error:
        search_layouts(config, 10**8, 80.0)
    assert "27,225 layouts" in one_line(error) and "--world-size" in one_line(error)
    candidates = search_layouts(config, 2**31 - 1, 80.0)
    assert not [c for c in candidates if c.plan is not None and c.data.get("data.packs_per_step", 0) > 2**24]
    assert any("data.packs_per_step=2147483647 is not" in (c.refused or "") for c in candidates)


def test_a_document_padding_no_pack_can_hold_is_not_told_pack_size_zero():
    """Before: ``data.pad_to_multiple_of=4294967296`` (or ``2*cp`` past 2**31-1) was told "use data.pack_size=0"."""
    from hybridpar.config import load_config
    from hybridpar.train.batches import pack_size_fix
    from hybridpar.train.preflight import validate_layout

    config = load_config(None, ["model.preset=tiny", "parallel.cp=1", "data.pad_to_multiple_of=4294967296"])
    with pytest.raises(ValueError) as error:
        validate_layout(config, 1)
    message = one_line(error)
    assert "no pack holds a document" in message and "data.pack_size=0" not in message, message
    assert pack_size_fix(100, 128) == 128 and pack_size_fix(2**31 - 2, 4) == 2**31 - 4
