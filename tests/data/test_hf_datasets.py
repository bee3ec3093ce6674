"""``data.task: hf_dataset``: local files and save_to_disk directories through ``datasets``."""

import builtins
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest

from hybridpar.data.chat import chat_document, prompt_completion_document
from hybridpar.data.hf_datasets import hf_dataset_documents
from hybridpar.data.tokenizers import ByteTokenizer
from tests.data.bpe import train_tiny_bpe

MESSAGES = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "there"}]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_tiny_bpe(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(autouse=True)
def dataset_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))


def test_text_rows_from_a_jsonl_file_and_a_saved_dataset(bpe, tmp_path):
    import datasets  # the data extra (make installs it)
    file = tmp_path / "rows.jsonl"
    file.write_text("\n".join(json.dumps({"body": t}) for t in ("abc", "", "hello there")) + "\n")
    # a blank row stays a document here; file_documents skips it with the other empty ones, counted
    assert hf_dataset_documents(file, field="body") == [ByteTokenizer().document(t) for t in ("abc", "", "hello there")]
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b"]}),
                          "test": datasets.Dataset.from_dict({"text": ["hello"]})}).save_to_disk(str(saved))
    assert hf_dataset_documents(saved, bpe, split="test") == [bpe.document("hello")]
    with pytest.raises(ValueError, match=r"has splits \['test', 'train'\], not 'validation'"):
        hf_dataset_documents(saved, bpe, split="validation")
    with pytest.raises(ValueError, match=r"has columns \['text'\], not \['body'\].*field option"):
        hf_dataset_documents(saved, bpe, field="body")


def test_messages_and_prompt_completion_rows(bpe, tmp_path):
    import datasets
    chats = tmp_path / "chats"
    datasets.Dataset.from_list([{"messages": MESSAGES}, {"messages": MESSAGES[:1]}]).save_to_disk(str(chats))
    with pytest.raises(ValueError, match=r"chats row 2 of 2 \(counted from 1; a CSV header is no row\): no message "
                                         "has role 'assistant'"):
        hf_dataset_documents(chats, bpe, kind="messages")
    file = tmp_path / "chat.jsonl"
    file.write_text(json.dumps({"conversation": MESSAGES}) + "\n")
    assert hf_dataset_documents(file, bpe, kind="messages", field="conversation") == [chat_document(MESSAGES, bpe)]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "hello", "completion": " there"}) + "\n")
    assert hf_dataset_documents(pairs, bpe, kind="prompt_completion") == [prompt_completion_document("hello", " there", bpe)]
    with pytest.raises(ValueError, match="kind='code' is unknown"):
        hf_dataset_documents(pairs, bpe, kind="code")
    with pytest.raises(ValueError, match="does not exist"):
        hf_dataset_documents(tmp_path / "missing.jsonl", bpe)


def test_missing_extra_is_a_clear_import_error(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ImportError, match=r"pip install 'hybridpar\[data\]'"):
        hf_dataset_documents(tmp_path / "rows.jsonl")


def test_a_cache_datasets_cannot_write_is_named_as_the_cache_not_the_file(tmp_path, monkeypatch):
    """Before: a ``HF_DATASETS_CACHE`` that cannot be written (a file, a full disk) was told "dataset rows.jsonl cannot
    be read ...; fix the file", of a file that is fine."""
    import datasets

    (tmp_path / "rows.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "taken").write_text("")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "taken" / "cache")
    with pytest.raises(ValueError, match=r"rows.jsonl: datasets could not write its cache \(NotADirectoryError.*taken/"
                                         r"cache'\); point HF_DATASETS_CACHE \(now .*\) at a writable folder"):
        hf_dataset_documents(tmp_path / "rows.jsonl")
