"""Built-in data sources: tokenizer, synthetic tasks and their metric, local files."""

import json

import pytest
import torch

from hybridpar.data.packing import IGNORE_INDEX, collate_thd, pack_documents
from hybridpar.data.sources import (
    TASKS,
    ByteTokenizer,
    MQARTask,
    SelectiveCopyTask,
    answer_accuracy,
    answer_counts,
    jsonl_documents,
    text_documents,
)


def test_byte_tokenizer_round_trips_and_guards_its_specials():
    tok = ByteTokenizer()
    ids = tok.encode("héllo", add_bos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == "héllo"
    with pytest.raises(ValueError, match="reserved control byte 3.*errors='drop'"):
        tok.encode("a\x03b")
    assert ByteTokenizer(errors="drop").encode("a\x03b", add_eos=False) == [ord("a"), ord("b")]


@pytest.mark.parametrize("task_cls", [MQARTask, SelectiveCopyTask])
def test_tasks_are_deterministic_variable_length_and_in_vocab(task_cls):
    task = task_cls(vocab_size=64, min_len=64, max_len=128, seed=3)
    docs = task.documents(20)
    assert docs == task_cls(vocab_size=64, min_len=64, max_len=128, seed=3).documents(20)
    assert docs != task_cls(vocab_size=64, min_len=64, max_len=128, seed=4).documents(20)
    lengths = {len(d["input_ids"]) for d in docs}
    assert len(lengths) > 5 and min(lengths) >= 64 and max(lengths) <= 128
    for doc in docs:
        assert len(doc["labels"]) == len(doc["input_ids"])
        assert 0 < min(doc["input_ids"]) and max(doc["input_ids"]) < 64
        assert any(label != IGNORE_INDEX for label in doc["labels"])


@pytest.mark.parametrize("filler", ["blank", "random"])
def test_mqar_answers_are_the_values_bound_earlier(filler):
    task = MQARTask(vocab_size=40, num_kv_pairs=(2, 8), min_len=40, max_len=120, seed=0, filler=filler)
    for doc in task.documents(30):
        tokens, labels = doc["input_ids"], doc["labels"]
        answered = [t for t, label in enumerate(labels) if label != IGNORE_INDEX]
        pairs = len(answered)  # num_queries=None queries every pair once
        bound = dict(zip(tokens[0:2 * pairs:2], tokens[1:2 * pairs:2]))  # key -> value of the kv prefix
        assert len(bound) == pairs and answered[0] >= 2 * pairs  # distinct keys, queries after the prefix
        for t in answered:
            assert labels[t] == bound[tokens[t]] == tokens[t + 1]
        assert {tokens[t] for t in answered} == set(bound)
        assert all(tokens[t] not in bound for t in range(2 * pairs, len(tokens)) if t not in answered)


def test_selective_copy_answers_are_the_content_in_order():
    task = SelectiveCopyTask(vocab_size=32, num_tokens=(2, 6), min_len=20, max_len=60, seed=1)
    for doc in task.documents(30):
        tokens, labels = doc["input_ids"], doc["labels"]
        sep = tokens.index(SelectiveCopyTask.SEP)
        content = [t for t in tokens[:sep] if t != SelectiveCopyTask.BLANK]
        assert tokens[sep + 1:] == content
        assert labels == [IGNORE_INDEX] * sep + content + [IGNORE_INDEX]


def test_task_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="raise vocab_size"):
        MQARTask(vocab_size=10, num_kv_pairs=8)
    with pytest.raises(ValueError, match="raise min_len"):
        MQARTask(num_kv_pairs=16, min_len=32)
    with pytest.raises(ValueError, match="raise min_len"):
        SelectiveCopyTask(num_tokens=16, min_len=20)
    assert set(TASKS) == {"mqar", "selective_copy"}


def test_answer_accuracy_on_perfect_partial_and_random_logits():
    task = MQARTask(vocab_size=64, min_len=64, max_len=128, seed=0)
    batch = collate_thd(pack_documents(task.documents(16), 512))
    labels = batch["labels"]
    answered = labels != IGNORE_INDEX
    perfect = torch.nn.functional.one_hot(labels.clamp(min=0), 64).double()  # [B, S, V]
    assert answer_accuracy(perfect, batch) == 1.0
    wrong = perfect.clone()
    flip = answered & (torch.arange(labels.numel()).reshape(labels.shape) % 2 == 0)
    wrong[flip] = torch.nn.functional.one_hot((labels[flip] + 1) % 64, 64).double()
    expected = 1 - int(flip.sum()) / int(answered.sum())
    assert answer_accuracy(wrong, batch) == pytest.approx(expected)
    random = torch.randn(*labels.shape, 64, generator=torch.Generator().manual_seed(0))
    assert answer_accuracy(random, batch) < 0.1  # chance is 1/64
    correct, total = answer_counts(perfect.reshape(-1, 64), labels.reshape(-1))  # flat THD layout
    assert int(correct) == int(total) == int(answered.sum())
    with pytest.raises(ValueError, match="no answer positions"):
        answer_accuracy(perfect, torch.full_like(labels, IGNORE_INDEX))
    with pytest.raises(ValueError, match="different token counts"):
        answer_accuracy(perfect[:, :-1], batch)


def test_text_and_jsonl_files(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("first line\nsecond\n\nthird para\n", encoding="utf-8")
    tok = ByteTokenizer()
    assert [tok.decode(d) for d in text_documents(text, split="line")] == ["first line", "second", "third para"]
    assert [tok.decode(d) for d in text_documents(text, split="paragraph")] == ["first line\nsecond", "third para\n"]
    assert len(text_documents([text, text])) == 2
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(json.dumps({"text": "hi"}) + "\n\n" + json.dumps({"text": "yo", "id": 2}) + "\n", encoding="utf-8")
    assert jsonl_documents(jsonl) == [[ord("h"), ord("i"), tok.eos_id], [ord("y"), ord("o"), tok.eos_id]]
    with pytest.raises(ValueError, match="b.jsonl:1 has no string field 'body'.*text_field="):
        jsonl_documents(jsonl, text_field="body")
    with pytest.raises(ValueError, match="files not found"):
        text_documents(tmp_path / "missing.txt")
