"""Round 32: the data path end to end (every data.task, tokenizers, chat templates, hf_dataset) (docs/reliability.md)."""

from __future__ import annotations

import importlib.util
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from hybridpar.config import DataConfig
from hybridpar.data.chat import chat_document, prompt_completion_documents
from hybridpar.data.packing import IGNORE_INDEX
from hybridpar.train.batches import DataError, validate_data
from tests.data.bpe import train_tiny_bpe, with_template
from tests.data.test_chat import CONVERSATION


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_tiny_bpe(tmp_path_factory.mktemp("bpe"))


def _turns(reply: str) -> str:
    return ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
            "{% elif m['role'] == 'assistant' %}Assistant: " + reply + "{% else %}{{ m['content'] }}\n{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}")


def test_a_generation_prompt_whose_last_token_merges_with_the_reply_keeps_its_header_unlearned(bpe):
    """The generation prompt ``Assistant: `` ends in a space, which the byte-level BPE joins to the reply's first word
    (``:`` `` how``), so its tokens were no prefix of the conversation's and the start fell back to the render without
    it: the header ``Assistant:`` was trained on, silently. Now the start is found on the rendered text: the labels
    equal transformers' ``{% generation %}`` mask of the same template (which takes the token the reply begins in)."""
    plain = with_template(bpe, _turns("{{ m['content'] }}{{ eos_token }}\n"))
    tagged = with_template(bpe, _turns("{% generation %}{{ m['content'] }}{{ eos_token }}\n{% endgeneration %}"))
    doc = chat_document(CONVERSATION, plain)
    assert doc == chat_document(CONVERSATION, tagged)
    trained = [bpe.decode([label], skip_special_tokens=False) for label in doc["labels"] if label != IGNORE_INDEX]
    assert "".join(trained) == " how are you<|eos|>\n jumps over<|eos|>\n"


def test_hf_dataset_prompt_completion_reads_columns_of_other_names(bpe, tmp_path):
    """``kind=prompt_completion`` on columns ``instruction``/``output`` was told "pass the field option", and ``field``
    was then refused ("leave field unset"): no setting read the dataset. The columns are named by
    ``prompt_field``/``completion_field`` (as ``data.task=prompt_completion`` names its fields), and ``field`` with
    that kind is refused before any process starts, naming them."""
    datasets = pytest.importorskip("datasets")
    from hybridpar.data.hf_datasets import hf_dataset_documents

    rows = [{"instruction": "hello there", "output": " how are you"}, {"instruction": "the fox", "output": " jumps"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = {"prompt_field": "instruction", "completion_field": "output"}
    expected = prompt_completion_documents(tmp_path / "rows.jsonl", bpe, **fields)
    assert hf_dataset_documents(tmp_path / "saved", bpe, kind="prompt_completion", **fields) == expected
    with pytest.raises(ValueError, match="pass data.task_options.prompt_field / completion_field"):
        hf_dataset_documents(tmp_path / "saved", bpe, kind="prompt_completion")
    config = DataConfig(task="hf_dataset", path=str(tmp_path / "saved"), tokenizer=str(bpe.source_dir),
                        task_options={"kind": "prompt_completion", "field": "instruction"})
    with pytest.raises(DataError, match="field='instruction' does not apply to kind='prompt_completion'.*prompt_field"):
        validate_data(config, 4096)
    config.task_options = {"kind": "text", "prompt_field": "instruction"}
    with pytest.raises(DataError, match="apply to kind='prompt_completion' only"):
        validate_data(config, 4096)


LLAMA_DATE = (  # Llama 3.2's system header (its date lines), on ChatML turns
    "{{- bos_token }}{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- endif %}{{- '<|im_start|>system\\nToday Date: ' + date_string + '\\n' + eos_token }}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + eos_token }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_chat_template_that_writes_todays_date_renders_one_fixed_date(bpe, monkeypatch):
    """Llama 3.2's template writes ``strftime_now('%d %b %Y')`` into every system header: a conversation's tokens (and
    their number, so the packs) changed with the day the data was read, a run resumed another day (or ranks reading
    on either side of midnight) trained other batches. Every render now reads one fixed date, Llama 3.1's default, and
    transformers' own renders of the template after it still read today."""
    import datetime

    import transformers.utils.chat_template_utils as templates

    tokenizer = with_template(bpe, LLAMA_DATE)
    conversation = CONVERSATION[1:3]
    doc = chat_document(conversation, tokenizer)
    assert "Today Date: 26 Jul 2024\n" in bpe.decode(doc["input_ids"], skip_special_tokens=False)

    class Tomorrow(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2031, 12, 31, 23, 59)
    monkeypatch.setattr(templates, "datetime", Tomorrow, raising=False)
    templates._compile_jinja_template.cache_clear()  # a fresh compile, as in another process on another day
    assert chat_document(conversation, with_template(bpe, LLAMA_DATE)) == doc
    assert tokenizer.apply_chat_template(conversation, add_generation_prompt=True)[:len(doc["input_ids"])] == doc["input_ids"]
    own = bpe.hf.apply_chat_template(conversation, tokenize=False, chat_template=LLAMA_DATE)  # transformers' own: today
    assert "Today Date: 31 Dec 2031\n" in own


def _prepending_tokenizer(folder):
    """A SentencePiece-style BPE saved as a plain ``tokenizer.json`` (the legacy Llama/Mistral pipeline: a normalizer
    that prepends ``▁`` to every text and writes spaces as ``▁``, no pre-tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from hybridpar.data.tokenizers import load_pretrained_tokenizer
    from tests.data.bpe import CORPUS

    raw = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=list("▁abcdefghijklmnopqrstuvwxyz"),
                                                        show_progress=False))
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(folder))
    return load_pretrained_tokenizer(folder)


def test_a_completion_is_tokenized_as_it_reads_after_its_prompt(tmp_path):
    """The completion was tokenized on its own: a tokenizer that prepends ``▁`` to every text read the completion
    `` how are you`` (a leading space, as OpenAI's format writes it) as ``▁▁`` ``how``, where the same text after the
    prompt is ``▁how``: every completion was trained on a double space it never meets. Now the completion's tokens are
    those of ``prompt + completion`` after the prompt's (when the prompt's tokens begin them)."""
    from hybridpar.data.chat import prompt_completion_document

    tokenizer = _prepending_tokenizer(tmp_path)
    doc = prompt_completion_document("hello there", " how are you", tokenizer)
    whole = tokenizer.document("hello there how are you", add_eos=False)
    prompt = tokenizer.document("hello there", add_eos=False)
    assert doc["input_ids"] == whole + [tokenizer.eos_id]
    assert doc["labels"] == [IGNORE_INDEX] * (len(prompt) - 1) + whole[len(prompt):] + [tokenizer.eos_id, IGNORE_INDEX]
    assert "▁▁" not in tokenizer.hf.convert_ids_to_tokens(doc["input_ids"])


def test_a_tokenizer_with_named_chat_templates_only_is_told_so(bpe, tmp_path):
    """A ``tokenizer_config.json`` whose ``chat_template`` is a list of named templates without ``default`` (transformers
    reads it as a dict) was told "tokenizer ... has none; set data.tokenizer to a directory whose tokenizer_config.json
    ... defines one", of a directory that defines one. Now the named templates are listed with the fix."""
    import shutil

    from hybridpar.data.tokenizers import CHATML_TEMPLATE

    shutil.copytree(bpe.source_dir, tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").unlink()
    config_file = tmp_path / "tok" / "tokenizer_config.json"
    settings = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**settings, "chat_template": [{"name": "tool_use", "template": CHATML_TEMPLATE}]}))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    config = DataConfig(task="chat", path=str(tmp_path / "chat.jsonl"), tokenizer=str(tmp_path / "tok"))
    with pytest.raises(DataError, match=r"has only named ones \(\['tool_use'\]\); write the one to train with into its "
                                        "chat_template.jinja"):
        validate_data(config, 4096)


def test_a_prompt_field_that_is_also_the_completion_field_is_refused(tmp_path):
    """``prompt_field`` and ``completion_field`` naming one field (``prompt``, ``prompt``) trained each prompt as its own
    completion without a word. Refused before any process starts (prompt_completion and hf_dataset), and by the reader."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "hello there", "completion": " how are you"}) + "\n")
    same = {"prompt_field": "prompt", "completion_field": "prompt"}
    with pytest.raises(DataError, match="prompt_field and completion_field both name 'prompt'"):
        validate_data(DataConfig(task="prompt_completion", path=str(tmp_path / "p.jsonl"), tokenizer="bytes",
                                 task_options=same), 256)
    with pytest.raises(ValueError, match="prompt_field and completion_field both name 'prompt'"):
        prompt_completion_documents(tmp_path / "p.jsonl", None, **same)
    if importlib.util.find_spec("datasets") is not None:
        with pytest.raises(DataError, match="prompt_field and completion_field both name 'prompt'"):
            validate_data(DataConfig(task="hf_dataset", path=str(tmp_path / "p.jsonl"), tokenizer="bytes",
                                     task_options={"kind": "prompt_completion", **same}), 256)


def test_a_reply_rendered_unlike_the_generation_prompt_starts_where_the_two_part(bpe):
    """DeepSeek-R1's template prompts ``<|Assistant|><think>\\n`` but renders a past reply as ``<|Assistant|>`` + content:
    the prompt was no prefix, and the start fell back to the render without it, so the header was trained on. The reply
    now starts where the prompt's text and the conversation's part: the labels are those of ``{% generation %}`` tags
    around the reply."""
    def template(reply):
        return ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n" + reply +
                "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    doc = chat_document(CONVERSATION, with_template(bpe, template("{{ m['content'] }}{{ eos_token }}")))
    tagged = with_template(bpe, template("{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"))
    assert doc == chat_document(CONVERSATION, tagged)
    trained = [bpe.decode([label], skip_special_tokens=False) for label in doc["labels"] if label != IGNORE_INDEX]
    assert "".join(trained) == "how are you<|eos|>jumps over<|eos|>"


def test_a_file_of_fewer_packs_than_a_step_is_said(tmp_path):
    """Steps cycle over a file's packs: with 3 packs and ``data.packs_per_step=4`` step 0 trained pack 0 twice and the
    others once (its documents weighted double in the step), without a word (evaluation said it, training did not)."""
    import warnings

    from hybridpar.train.batches import PackStream

    (tmp_path / "t.txt").write_text("\n\n".join(f"paragraph {i} of the file" for i in range(4)))
    config = DataConfig(task="text", path=str(tmp_path / "t.txt"), tokenizer="bytes", pack_size=32, packs_per_step=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = PackStream(config, 1, 256)
    assert len(stream.pool) == 3 and [id(p) for p in stream.step_packs(0)].count(id(stream.pool[0])) == 2
    assert [str(w.message) for w in caught] == [
        f"data.path={str(tmp_path / 't.txt')!r} fills 3 pack(s) of data.pack_size=32, fewer than data.packs_per_step=4: "
        "every step trains some packs (their documents) more than once, and some more often than others; use "
        "data.packs_per_step=3 or fewer (a multiple of the data-parallel size), a smaller data.pack_size, or more data"]


def test_paragraphs_are_separated_by_any_blank_line(tmp_path):
    """``split=paragraph`` split on ``\\n\\n`` only: a line of spaces (an editor's indentation, text pasted from the web)
    joined two paragraphs into one document, and a third newline led the next paragraph with a ``\\n`` token, so a
    document's tokens depended on invisible whitespace. Lines of whitespace are blank lines; errors still name the line."""
    from hybridpar.data.sources import text_documents
    from hybridpar.data.tokenizers import ByteTokenizer

    (tmp_path / "t.txt").write_text("first one\n   \nsecond\n\n\n\nthird\nand more\n \t \n\nlast\n")
    tokens = ByteTokenizer()
    assert [tokens.decode(d) for d in text_documents(tmp_path / "t.txt", split="paragraph")] == [
        "first one", "second", "third\nand more", "last\n"]
    (tmp_path / "t.txt").write_text("first one\n   \nsecond\n\n\n\nbad \x03 byte\n")
    with pytest.raises(ValueError, match=r"t.txt:7"):
        text_documents(tmp_path / "t.txt", split="paragraph")
