"""A tiny byte-level BPE tokenizer trained in the test session (no downloads)."""

from hybridpar.data.tokenizers import PretrainedTokenizer, train_bpe_tokenizer

CORPUS = [
    "hello there, how are you today?",
    "the quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "assistant user system: be brief and kind.",
] * 20


def train_tiny_bpe(out_dir, **kwargs):
    return train_bpe_tokenizer(CORPUS, out_dir, vocab_size=kwargs.pop("vocab_size", 320), **kwargs)


def with_template(tokenizer, template):
    """A copy of a ``PretrainedTokenizer`` with another chat template."""
    clone = PretrainedTokenizer(tokenizer.hf, tokenizer.source_dir)
    clone.chat_template = template
    return clone
