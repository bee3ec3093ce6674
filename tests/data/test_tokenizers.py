"""Tokenizer resolution (auto | bytes | dir), the vocabulary check, documents' BOS/EOS, BPE training."""

import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from hybridpar.data.sources import text_documents
from hybridpar.data.tokenizers import (
    ByteTokenizer, PretrainedTokenizer, as_tokenizer, check_tokenizer, resolve_tokenizer, ships_tokenizer,
)
from tests.data.bpe import train_tiny_bpe


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_tiny_bpe(tmp_path_factory.mktemp("bpe"))


def test_trained_bpe_directory_loads_in_transformers(bpe):
    from transformers import AutoTokenizer, GenerationConfig

    assert sorted(os.listdir(bpe.source_dir)) == ["chat_template.jinja", "generation_config.json",
                                                  "tokenizer.json", "tokenizer_config.json"]
    hf = AutoTokenizer.from_pretrained(bpe.source_dir, local_files_only=True)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2) == (bpe.pad_id, bpe.bos_id, bpe.eos_id)
    assert hf.chat_template == bpe.chat_template is not None
    generation = GenerationConfig.from_pretrained(bpe.source_dir)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 0)
    assert bpe.vocab_size == 320
    ids = bpe.encode("hello there")
    assert ids[0] == bpe.bos_id and len(ids) < 1 + len("hello there")  # merges learned
    assert bpe.decode(ids) == "hello there"


def test_documents_get_bos_and_eos_as_the_tokenizer_defines(bpe, tmp_path):
    text = "hello there"
    body = bpe.encode(text, add_special_tokens=False)
    assert bpe.document(text) == [bpe.bos_id] + body + [bpe.eos_id]
    assert bpe.document(text, add_bos=False, add_eos=False) == body
    assert ByteTokenizer().document("hi") == [ord("h"), ord("i"), 3]  # bytes: no BOS, EOS
    assert ByteTokenizer().document("hi", add_bos=True) == [2, ord("h"), ord("i"), 3]
    # the old bug: a transformers tokenizer passed to text_documents (positional encode arguments)
    file = tmp_path / "a.txt"
    file.write_text("hello there\n\nthe quick fox\n", encoding="utf-8")
    docs = text_documents(file, split="paragraph", tokenizer=bpe.hf)
    assert docs == [bpe.document("hello there"), bpe.document("the quick fox\n")]
    assert text_documents(file, split="paragraph", tokenizer=bpe) == docs


def test_auto_uses_the_checkpoint_tokenizer_and_bytes_only_when_asked(bpe, tmp_path):
    empty = tmp_path / "model_without_tokenizer"
    empty.mkdir()
    assert ships_tokenizer(bpe.source_dir) and not ships_tokenizer(empty) and not ships_tokenizer(None)
    auto = resolve_tokenizer("auto", model_path=bpe.source_dir, vocab_size=320)
    assert isinstance(auto, PretrainedTokenizer) and auto.source_dir == bpe.source_dir
    assert isinstance(resolve_tokenizer("auto", model_path=empty, vocab_size=256), ByteTokenizer)
    assert isinstance(resolve_tokenizer("auto"), ByteTokenizer)
    assert isinstance(resolve_tokenizer(str(bpe.source_dir), model_path=empty, vocab_size=400), PretrainedTokenizer)
    with pytest.warns(UserWarning, match="tokenizer='bytes' was asked for"):
        assert isinstance(resolve_tokenizer("bytes", model_path=bpe.source_dir, vocab_size=320), ByteTokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_tokenizer("bytes", model_path=empty, vocab_size=256)
    with pytest.raises(ValueError, match="ships its own tokenizer.*'auto'.*'bytes' explicitly"):
        check_tokenizer(ByteTokenizer(), 320, model_path=bpe.source_dir)


@pytest.mark.parametrize("spec, vocab_size, message", [
    ("auto", 300, r"produces ids up to 319, but the model's embedding has vocab_size=300.*vocab_size >= 320"),
    ("bytes", 128, r"produces ids up to 255, but the model's embedding has vocab_size=128"),
    ("no/such/dir", 320, "neither 'auto', 'bytes' nor an existing directory"),
])
def test_bad_tokenizer_settings_are_value_errors(bpe, spec, vocab_size, message):
    with pytest.raises(ValueError, match=message):
        resolve_tokenizer(spec, model_path=bpe.source_dir if spec == "auto" else None, vocab_size=vocab_size)


def test_not_a_tokenizer_directory_or_object(tmp_path):
    with pytest.raises(ValueError, match="is not a tokenizer directory"):
        from hybridpar.data.tokenizers import load_pretrained_tokenizer
        load_pretrained_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="is not a tokenizer"):
        as_tokenizer(42)
    with pytest.raises(ValueError, match="has no chat template"):
        ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
