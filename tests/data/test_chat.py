"""SFT documents: labels exactly on the assistant (or completion) tokens, checked by hand.

The hand-built example renders a ChatML conversation piece by piece (special tokens are
never merged, and every piece ends at a pre-tokenizer boundary, so the pieces tokenize as
in the whole) and marks the assistant replies and their end-of-turn tokens.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from hybridpar.data.chat import (
    assistant_mask, chat_document, chat_documents, prompt_completion_document, prompt_completion_documents,
    shifted_labels,
)
from hybridpar.data.packing import IGNORE_INDEX, collate_thd, pack_documents
from hybridpar.data.tokenizers import ByteTokenizer
from tests.data.bpe import train_tiny_bpe, with_template

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "how are you"},
    {"role": "user", "content": "the fox"},
    {"role": "assistant", "content": "jumps over"},
]
# The same ChatML rendering, with the assistant turns inside {% generation %} blocks.
TAGGED_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}\n{% endgeneration %}"
    "{% else %}{{ message['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_tiny_bpe(tmp_path_factory.mktemp("bpe"))


def hand_built(tok):
    """ids and assistant mask of CONVERSATION under ChatML, piece by piece."""
    im_start, eos, newline = tok.hf.convert_tokens_to_ids("<|im_start|>"), tok.eos_id, tok.encode("\n", False)
    ids, mask = [tok.bos_id], [False]
    for message in CONVERSATION:
        header = [im_start] + tok.encode(message["role"] + "\n", False)
        turn = tok.encode(message["content"], False) + [eos] + newline
        ids += header + turn
        mask += [False] * len(header) + [message["role"] == "assistant"] * len(turn)
    return ids, mask


def test_chat_labels_are_exactly_the_assistant_tokens(bpe):
    ids, mask = hand_built(bpe)
    assert bpe.apply_chat_template(CONVERSATION) == ids  # the hand rendering is the template's
    assert assistant_mask(CONVERSATION, bpe) == (ids, mask)
    doc = chat_document(CONVERSATION, bpe)
    expected = [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
    assert doc == {"input_ids": ids, "labels": expected}
    trained = [bpe.decode([label], skip_special_tokens=False) for label in doc["labels"] if label != IGNORE_INDEX]
    assert "".join(trained) == "how are you<|eos|>\njumps over<|eos|>\n"
    # a template with {% generation %} tags: transformers' assistant mask, same labels
    tagged = with_template(bpe, TAGGED_TEMPLATE)
    assert tagged.has_generation_tags and not bpe.has_generation_tags
    assert chat_document(CONVERSATION, tagged) == doc


def test_a_conversation_is_rendered_once_plus_twice_per_earlier_reply(bpe, monkeypatch):
    """Each render is a tokenization, the cost of reading chat data: the whole conversation, then per reply its
    header's prefix, and the prefix through its end of turn unless the reply is the last message (the whole
    conversation then). The render without the generation prompt only where the one with it is no prefix.
    Two replies: 4 renders (it was 7, 1 + 3 per reply)."""
    calls = []
    render = type(bpe).apply_chat_template
    monkeypatch.setattr(type(bpe), "apply_chat_template", lambda self, m, *a, **k: calls.append(len(m)) or render(self, m, *a, **k))
    assert assistant_mask(CONVERSATION, bpe) == hand_built(bpe)
    assert sorted(calls) == [2, 3, 4, 5]  # the whole, reply 2's end, and each reply's header prefix
    calls.clear()
    other_prompt = with_template(bpe, bpe.chat_template.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>model\n{% endif %}"))
    assistant_mask(CONVERSATION, other_prompt)
    assert sorted(calls) == [2, 3, 4, 5]  # a prompt the replies part from: found on the rendered text (round 32)


def test_templates_without_a_generation_prompt_or_that_rewrite_turns(bpe):
    no_prompt = with_template(bpe, bpe.chat_template.replace("{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", ""))
    ids, mask = assistant_mask(CONVERSATION, no_prompt)
    _, hand_mask = hand_built(bpe)
    header = len(bpe.encode("assistant\n", False)) + 1
    first = hand_mask.index(True)
    assert mask[first - header:first] == [True] * header  # the header is learned when there is no prompt
    reversed_turns = with_template(bpe, "{% for m in messages|reverse %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    with pytest.raises(ValueError, match="does not render message 2 as a continuation.*generation"):
        chat_document(CONVERSATION, reversed_turns)


def test_prompt_completion_labels_cover_completion_and_eos(bpe):
    doc = prompt_completion_document("hello there", " how are you", bpe)
    prompt, completion = [bpe.bos_id] + bpe.encode("hello there", False), bpe.encode(" how are you", False) + [bpe.eos_id]
    assert doc["input_ids"] == prompt + completion
    assert doc["labels"] == [IGNORE_INDEX] * (len(prompt) - 1) + completion + [IGNORE_INDEX]
    byte_doc = prompt_completion_document("ab", "c", ByteTokenizer())
    assert byte_doc == {"input_ids": [97, 98, 99, 3], "labels": [IGNORE_INDEX, 99, 3, IGNORE_INDEX]}


def test_jsonl_files_and_errors_name_the_line(bpe, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": CONVERSATION}) + "\n\n" + json.dumps({"messages": CONVERSATION[:3]}) + "\n")
    docs = chat_documents(chat, bpe)
    assert docs[0] == chat_document(CONVERSATION, bpe) and docs[1] == chat_document(CONVERSATION[:3], bpe)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    assert prompt_completion_documents(pairs, bpe) == [prompt_completion_document("a", "b", bpe)]
    bad = tmp_path / "bad.jsonl"
    cases = [
        ('{"messages": [{"role": "user", "content": "hi"}]}', "bad.jsonl:2: no message has role 'assistant'"),
        ('{"messages": [{"role": "user"}]}', "bad.jsonl:2: message 0 .* needs string 'role' and 'content'"),
        ('{"text": "hi"}', "bad.jsonl:2 has no 'messages' field"),
        ("not json", "bad.jsonl:2: not valid JSON"),
    ]
    for line, message in cases:
        bad.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=message):
            chat_documents(bad, bpe)
    bad.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1 has no \['completion'\] field"):
        prompt_completion_documents(bad, bpe)
    with pytest.raises(ValueError, match="has no chat template"):
        chat_documents(chat, ByteTokenizer())


def test_each_conversation_is_one_packed_document_with_its_labels(bpe):
    docs = [chat_document(CONVERSATION, bpe), chat_document(CONVERSATION[:3], bpe),
            prompt_completion_document("hello", " there", bpe)]
    packs = pack_documents(docs, pack_size=128)
    batch = collate_thd(packs)
    assert len(packs) == 1 and batch["seq_lens"][0, :3].tolist() == [len(d["input_ids"]) for d in docs]
    start = 0
    for doc in docs:
        end = start + len(doc["input_ids"])
        assert batch["input_ids"][0, start:end].tolist() == doc["input_ids"]
        assert batch["labels"][0, start:end].tolist() == doc["labels"]  # last token -100: no target across documents
        start = end
    assert (batch["labels"][0, start:] == IGNORE_INDEX).all()
    assert shifted_labels([], []) == []
    assert torch.equal(batch["position_ids"][0, :len(docs[0]["input_ids"])], torch.arange(len(docs[0]["input_ids"])))


def test_file_documents_is_one_entry_point_for_file_tasks(bpe, tmp_path):
    from hybridpar.data.documents import file_documents

    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    assert file_documents("chat", chat, bpe) == [chat_document(CONVERSATION, bpe)]
    text = tmp_path / "a.txt"
    text.write_text("hello there\n\nthe fox\n")
    assert file_documents("text", text, bpe, {"split": "file"}) == [bpe.document("hello there\n\nthe fox\n")]
    assert len(file_documents("text", text, None)) == 2  # paragraphs, bytes
    with pytest.raises(ValueError, match=r"data.task_options \['text_field'\] do not apply to task 'chat'"):
        file_documents("chat", chat, bpe, {"text_field": "x"})
    with pytest.raises(ValueError, match="data.path=None does not exist"):
        file_documents("prompt_completion", None, bpe)
    with pytest.raises(ValueError, match="'mqar' is not a file task"):
        file_documents("mqar", chat, bpe)
