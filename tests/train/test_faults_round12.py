"""Round 12 of fault hunting (docs/reliability.md, "Round 12"): each test holds one class of fault."""

from __future__ import annotations

import json

import pytest

from tests.train.fault_probes import cli, one_line

U, A = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}
S, T = {"role": "system", "content": "be brief"}, {"role": "tool", "content": "42"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from hybridpar.data.tokenizers import load_pretrained_tokenizer
    from tests.data.bpe import train_tiny_bpe

    folder = tmp_path_factory.mktemp("tok")
    train_tiny_bpe(folder)
    return load_pretrained_tokenizer(folder)


@pytest.mark.parametrize("messages, said", [
    ([A, U, A], "message 0 has role 'assistant' out of order (roles: ['assistant', 'user', 'assistant']): the "
                "conversation must open with a user message"),
    ([S, U, U, A], "message 2 has role 'user' out of order"),
    ([U, A, A], "message 2 has role 'assistant' out of order"),
    ([U, A, S, U, A], "message 2 has role 'system' out of order"),
    ([U, T, A], "message 1 has role 'tool' out of order"),
    ([U, A, U], "the conversation ends with message 2 ('user') after the last reply"),
])
def test_chat_turns_out_of_order_are_refused(tmp_path, tokenizer, messages, said):
    """ChatML rendered each of these without a word: a reply trained as the answer to a prompt it does not follow,
    a system prompt in mid-conversation, a last prompt read and never trained on."""
    from hybridpar.data.chat import chat_documents

    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ValueError) as error:
        chat_documents([tmp_path / "chat.jsonl"], tokenizer)
    assert one_line(error).startswith(f"{tmp_path}/chat.jsonl:1: {said}")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [S, U, A, T, A, U, A]}) + "\n")
    assert len(chat_documents([tmp_path / "chat.jsonl"], tokenizer)) == 1  # tool results after the call are fine
