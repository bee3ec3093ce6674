"""Data and model files that cannot be used: the message names the file and the line (or
byte) and says what to do; nothing fails later with a message about something else."""

import json

import pytest

from hybridpar.config import DataConfig
from hybridpar.models.hf.config import read_hf_config
from hybridpar.train.batches import PackStream


def _stream(tmp_path, task, content: bytes, **options):
    path = tmp_path / f"data.{'txt' if task == 'text' else 'jsonl'}"
    path.write_bytes(content)
    return lambda: PackStream(DataConfig(task=task, path=str(path), pack_size=64, task_options=options), 1, 256)


@pytest.mark.parametrize(
    "task, content, message",
    [
        ("text", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", r"data.txt:1: byte 0 \(0x89\) is not UTF-8; the file looks binary"),
        ("text", "caf\u00e9\n\nline two\n\nthird ".encode() + b"\xff\n", r"data.txt:5: byte \d+ \(0xff\) is not UTF-8.*iconv"),
        ("text", b"ok\n\nfine\n\nbad \x00 byte here\n", r"data.txt:5: contains the control byte 0 .*binary file"),
        ("text", b"one\ntwo\nthree\x03\n", r"data.txt:3: contains the control byte 3"),
        ("jsonl", b'{"text": "a"}\n\n{"text": "b"}\n{"text": oops}\n', r"data.jsonl:4: not valid JSON \(Expecting value at column 10\)"),
        ("jsonl", b'{"text": "a"}\n["a list"]\n', r"data.jsonl:2 holds a list, not a JSON object"),
        ("jsonl", b'{"text": "a"}\n{"body": "b"}\n', r"data.jsonl:2 has no string field 'text' \(keys: \['body'\]\).*text_field"),
        ("jsonl", b'{"text": "a"}\r\n{"text": "b\xc3"}\r\n', r"data.jsonl:2: byte \d+ \(0xc3\) is not UTF-8"),
    ],
)
def test_bad_files_name_the_file_and_line(tmp_path, task, content, message):
    with pytest.raises(ValueError, match=message):
        _stream(tmp_path, task, content, split="paragraph")() if task == "text" else _stream(tmp_path, task, content)()


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_an_empty_file_is_named(tmp_path, content):
    with pytest.raises(ValueError, match=r"data.path='.*data.txt' holds no document \(it is empty or blank\)"):
        _stream(tmp_path, "text", content, split="paragraph")()


def test_a_byte_order_mark_is_not_text(tmp_path):
    from hybridpar.train.batches import load_documents

    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "ab"}\n{"text": "cd"}\n')
    docs = load_documents(DataConfig(task="jsonl", path=str(path), task_options={}), 0, 0, 256)
    assert len(docs) == 1 and docs[0][:2] == [97, 98]  # "ab" (the last 10% is held out), no BOM bytes 239 187 191


def test_line_numbers_count_only_newlines(tmp_path):
    """U+2028 or U+0085 inside a record is not a line break (str.splitlines thinks so)."""
    make = _stream(tmp_path, "jsonl", '{"text": "a\u2028b"}\n{"text": "c\u0085d"}\n{"text": 3}\n'.encode())
    with pytest.raises(ValueError, match=r"data.jsonl:3 has no string field"):
        make()


@pytest.mark.parametrize("split, documents", [("paragraph", 2), ("line", 3), ("file", 1)])
def test_the_text_split_rule_is_an_option(tmp_path, split, documents):
    from hybridpar.train.batches import load_documents

    path = tmp_path / "t.txt"
    path.write_text("first line\nsecond line\n\nthird line\n")
    config = DataConfig(task="text", path=str(path), task_options={"split": split})
    train = load_documents(config, 0, 0, 256)
    held_out = load_documents(config, 0, 10_000, 256) if documents > 1 else []
    assert len(train) + len(held_out) == documents


@pytest.mark.parametrize(
    "content, message",
    [
        ('["architectures", "Mamba2ForCausalLM"]', r"config.json holds a JSON list, not an object"),
        ('{"architectures": ["Mamba2ForCausalLM"],\n "vocab_size": 256,,}', r"config.json is not valid JSON at line 2"),
        ("\"just a string\"", r"holds a JSON str"),
    ],
)
def test_a_broken_config_json_is_named(tmp_path, content, message):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        read_hf_config(tmp_path)


def test_a_broken_hf_path_is_refused_before_any_process_starts(tmp_path):
    from hybridpar.config import load_config
    from hybridpar.train.preflight import validate_run

    (tmp_path / "config.json").write_text(json.dumps(["not", "a", "config"]))
    config = load_config("configs/tiny-hybrid.yaml", [f"model.hf_path={tmp_path}", "parallel.cp=1", "parallel.tp=1",
                                                      f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=r"model.hf_path=.*config.json cannot be used: .*holds a JSON list"):
        validate_run(config, "train", 1)


@pytest.mark.parametrize("task, options, guess", [
    ("mqar", {"VOCAB_SIZE": 16}, "; did you mean vocab_size?"), ("selective_copy", {"Min_Len": 20}, "; did you mean min_len?"),
    ("text", {"SPLIT": "line"}, "; did you mean split?"), ("mqar", {"zzz": 1}, "; remove the others."),
])
def test_a_task_option_in_other_case_is_named_and_the_sentence_ends_once(tmp_path, task, options, guess):
    """``data.task_options={VOCAB_SIZE: 16}`` is named by its key (the guess is not case-sensitive), and the
    message ends in the guess's question mark or in one full stop (it said "did you mean vocab_size?.")."""
    from hybridpar.train.batches import DataError, make_task, validate_data

    path = tmp_path / "data.txt"
    path.write_text("one\n\ntwo\n\nthree\n")
    config = DataConfig(task=task, path=str(path) if task == "text" else None, task_options=options)
    with pytest.raises(DataError) as error:
        make_task(config, 256) if task != "text" else validate_data(config, 256)
    assert str(error.value).endswith(guess), error.value
