"""Round 14 of fault hunting (docs/reliability.md, "Round 14"): SFT records of OpenAI's format (tool calls,
``weight``), special tokens' text in chat content, a chat template ending turns with a missing EOS, and the
Python API's tensors of the wrong layout. Each test holds one class of fault; all run in this process."""

from __future__ import annotations

import json

import pytest
import torch

from tests.train.fault_probes import cli, one_line

U, A, TOOL = {"role": "user", "content": "weather?"}, {"role": "assistant", "content": "It is sunny."}, \
    {"role": "tool", "content": "sunny"}
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
TOOL_TEMPLATE = (  # ChatML that renders an assistant's tool calls, as Qwen's and Llama 3's templates do
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}{% if message.tool_calls %}"
    "{% for call in message.tool_calls %}<tool_call>{{ call.function.name }}({{ call.function.arguments }})</tool_call>"
    "{% endfor %}{% endif %}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.data.bpe import train_tiny_bpe

    folder = tmp_path_factory.mktemp("tok")
    train_tiny_bpe(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(folder):
    from hybridpar.data.tokenizers import load_pretrained_tokenizer

    return load_pretrained_tokenizer(folder)


def _trained(messages, tokenizer) -> str:
    from hybridpar.data.chat import chat_document

    document = chat_document(messages, tokenizer)
    return tokenizer.hf.decode([t for t in document["labels"] if t != -100])


def test_an_assistant_tool_call_is_trained_not_masked(tmp_path, folder):
    """An assistant turn that calls a tool (``content: ""`` beside ``tool_calls``) was masked as an empty reply, so a
    function-calling SFT never trained the call itself; ``content: null`` (OpenAI's own form) was refused as a message
    without string content."""
    from hybridpar.data.tokenizers import load_pretrained_tokenizer

    (tmp_path / "tool").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "tool" / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "tool" / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tool = load_pretrained_tokenizer(tmp_path / "tool")
    for call in (CALL, {**CALL, "content": ""}):
        trained = _trained([U, call, TOOL, A], tool)
        assert trained.startswith('<tool_call>get_weather({"city": "Paris"})</tool_call>'), trained
        assert "It is sunny." in trained and "sunny<" not in trained.split("</tool_call>")[0]


def test_a_tool_call_the_template_never_renders_is_refused(tokenizer):
    """A template that never reads ``tool_calls`` (or ``reasoning_content``) dropped them without a word: the reply
    after the tool's result was trained as if no call had been made."""
    from hybridpar.data.chat import chat_document

    for messages, key in (([U, {**CALL, "content": ""}, TOOL, A], "tool_calls"),
                          ([U, {**A, "reasoning_content": "Look it up."}], "reasoning_content")):
        with pytest.raises(ValueError) as error:
            chat_document(messages, tokenizer)
        assert f"message 1 ('assistant') has '{key}', which the chat template never reads" in one_line(error)


def test_openai_weight_zero_is_not_trained(tokenizer):
    """OpenAI's fine-tuning format marks a reply not to learn with ``"weight": 0``; it was trained on like any other."""
    from hybridpar.data.chat import chat_document

    bad, good = {"role": "assistant", "content": "no idea", "weight": 0}, {"role": "assistant", "content": "ok", "weight": 1}
    trained = _trained([U, bad, {"role": "user", "content": "again"}, good], tokenizer)
    assert "ok" in trained and "no idea" not in trained, trained
    assert set(chat_document([U, bad], tokenizer)["labels"]) == {-100}  # nothing to learn: skipped and counted
    assert "It is sunny." in _trained([U, {**A, "weight": None}], tokenizer)  # a table's filler for a missing field
    for message, said in (({**A, "weight": 2}, "message 1 ('assistant') has weight 2; a weight is 0"),
                          ({**A, "weight": True}, "has weight True"), ({**U, "weight": 1}, "message 0 ('user') has weight 1")):
        messages = [message, A] if message["role"] == "user" else [U, message]
        with pytest.raises(ValueError) as error:
            chat_document(messages, tokenizer)
        assert said in one_line(error)


def test_a_special_tokens_text_in_chat_content_is_refused(tmp_path, tokenizer):
    """The tokenizer reads ``<|eos|>`` in a reply as its end token (trained mid-reply: the model learns to stop
    there), and ``<|im_start|>assistant`` in a user message forges a turn; both passed without a word."""
    from hybridpar.data.chat import chat_documents, prompt_completion_document

    for messages, said in (([U, {**A, "content": "fine <|eos|> more"}], "message 1 ('assistant') holds '<|eos|>'"),
                           ([{**U, "content": "<|im_start|>assistant\nx"}, A], "message 0 ('user') holds '<|im_start|>'")):
        (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
        with pytest.raises(ValueError) as error:
            chat_documents([tmp_path / "chat.jsonl"], tokenizer)
        assert one_line(error).startswith(f"{tmp_path}/chat.jsonl:1: {said} in its content, the text of the "
                                          "tokenizer's special token")
    with pytest.raises(ValueError) as error:
        prompt_completion_document("q", "a <|eos|> b", tokenizer)
    assert "the completion holds '<|eos|>'" in one_line(error)


def test_a_chat_template_ending_turns_with_a_missing_eos_is_said(tmp_path, folder):
    """A tokenizer without an EOS renders the template's ``{{ eos_token }}`` as nothing: every reply trained without
    an end, silently (the text tasks said it; chat did not)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tmp_path / "model"
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(model)
    for name in ("tokenizer.json", "chat_template.jinja"):
        (model / name).write_bytes((folder / name).read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": [{**U, "content": f"q {i}"}, A]}) + "\n"
                                                 for i in range(20)))
    code, output = cli("train", f"model.hf_path={model}", "data.task=chat", f"data.path={tmp_path / 'chat.jsonl'}",
                       f"output_dir={tmp_path / 'run'}", "train.steps=2", "train.warmup_steps=0", "--dry-run")
    assert code == 0 and "defines no EOS token" in output and "the chat template ends each turn with eos_token, which " \
        "renders as nothing: replies are trained without an end token" in output, output


def test_a_batch_tensor_is_not_one_document():
    """``pack_documents([batch])`` with a ``[B, S]`` tensor joined its rows into one document (each reading the one
    before); ``pack_size=True`` split every document into one-token pieces and failed in ``torch.full``."""
    from hybridpar import pack_documents

    with pytest.raises(ValueError) as error:
        pack_documents([torch.tensor([[1, 2], [3, 4]])], 8)
    assert "a document's token ids have shape [2, 2]: its 2 rows would be joined into one document" in one_line(error)
    assert pack_documents([torch.tensor([[1, 2, 3]])], 8)[0]["input_ids"][:3].tolist() == [1, 2, 3]  # [1, S]: one row
    for kwargs, said in ((dict(pack_size=True), "pack_size must be an int in [1, 2**31-1] (cu_seqlens are int32), "
                                                "got True"),
                         (dict(pack_size=8, cp_size=True), "cp_size must be a positive int, got True")):
        with pytest.raises(ValueError) as error:
            pack_documents([[1, 2, 3]], **kwargs)
        assert said in one_line(error)


@pytest.mark.parametrize("ids, said", [
    (torch.tensor([1, 2, 3]), "input_ids has shape [3] and dtype int64; it must be token ids [batch, seq] of an integer "
                              "dtype, at least one token long; a single row takes input_ids.unsqueeze(0)"),
    (torch.tensor([[1.0, 2.0]]), "input_ids has shape [1, 2] and dtype float32"),
    (torch.zeros(1, 0, dtype=torch.long), "input_ids has shape [1, 0]"),
    ([[1, 2]], "input_ids is a list, not a torch.Tensor"),
])
def test_hybridlm_input_of_the_wrong_layout_is_one_line(ids, said):
    """A ``[S]`` row was "not enough values to unpack (expected 3, got 2)", naming nothing; float ids, a list or an empty
    row were errors from inside the embedding or a reshape."""
    import hybridpar as hp

    model = hp.HybridLM(hp.HybridConfig.from_preset("tiny"))
    with pytest.raises(ValueError) as error:
        model(ids)
    assert said in one_line(error)
    assert model(torch.tensor([[1, 2, 3]])).shape[:2] == (1, 3)


def test_a_lora_export_names_its_base_by_an_absolute_path(tmp_path, monkeypatch, folder):
    """``model.hf_path=base`` (relative) was written as ``base_model_name_or_path: "base"``: peft or ``generate --hf-path
    ADAPTER`` started in another directory found no base, or merged the adapter onto another folder of that name
    without a word. An adapter's load error named the temporary folder it was merged into."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import hybridpar as hp
    from hybridpar.models.hf.lora_export import export_lora

    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "base")
    model = hp.load_causal_lm(tmp_path / "base")
    hp.add_lora(model, r=2)
    monkeypatch.chdir(tmp_path)
    export_lora(model, tmp_path / "adapter", hp.canonical_state_dict(model), base_path="base", tokenizer_dir=folder)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(tmp_path / "base")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, output = cli("generate", "--hf-path", str(tmp_path / "adapter"), "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 0, output
    code, output = cli("generate", "--hf-path", str(tmp_path / "adapter"), "--prompt", "hi", "--max-new-tokens", "2",
                       "--backend", "hybrid")
    assert code == 2 and f"but adapter '{tmp_path / 'adapter'}' merged onto its base holds ['LlamaForCausalLM']" in output \
        and "hybridpar-lora-" not in output, output


@pytest.mark.parametrize("template, messages, said", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role != 'assistant' %}{{ m.content }}{% endif %}"
     "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", [U, A],
     "the chat template drops message 1 ('assistant': 'It is sunny.'): its text is not in the rendered conversation, so "
     "it would be trained as an empty reply without a word"),
    ("{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}<|im_start|>{{ m.role }}\n{{ m.content }}"
     "{{ eos_token }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
     [{"role": "developer", "content": "be brief"}, U, A], "the chat template drops message 0 ('developer': 'be brief')"),
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}{% endgeneration %}"
     "{% endif %}{{ m.content }}{{ eos_token }}\n{% endfor %}", [U, A],
     "the chat template's {% generation %} tags wrap none of the assistant's replies"),
])
def test_a_chat_template_that_drops_text_is_refused(tmp_path, folder, template, messages, said):
    """A template that never renders a reply's text trained its header and end token (the refusal then blamed the
    records: "every one of the documents has no assistant text ... fill the records"); one that skips a role it does
    not know left that message out of the prompt without a word; empty ``{% generation %}`` tags asked "is the reply
    empty?" of a reply that was not."""
    from hybridpar.data.chat import chat_document
    from hybridpar.data.tokenizers import load_pretrained_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(template)
    with pytest.raises(ValueError) as error:
        chat_document(messages, load_pretrained_tokenizer(tmp_path))
    assert said in one_line(error)


@pytest.mark.parametrize("argv, flag", [
    (["generate", "--hf-path", "x", "--prompt", "-v", "--max-new-tokens", "2"], "--prompt"),
    (["generate", "--hf-path", "x", "--prompt", "k", "--temperature", "-1e-3"], "--temperature"),
])
def test_a_flag_value_that_starts_with_a_dash_says_how_to_write_it(capsys, argv, flag):
    """``--prompt -v`` or ``--temperature -1e-3`` said "expected one argument" of a flag that was given
    one: argparse reads a value that starts with '-' (other than a plain negative number) as a flag."""
    from hybridpar.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}: expected one argument (a value that starts with '-', such as a " \
        f"negative number or text, reads as a flag: write it as {flag}=VALUE)" in err and len(err.splitlines()) == 1, err


def test_a_bpe_tokenizer_trained_on_little_text_says_the_vocabulary_it_learned(tmp_path):
    """``data.tokenizer=bpe`` on two small files printed "trained a byte-level BPE tokenizer (vocab 4096)" though it
    learned 276 tokens: 3,820 embedding rows never used, and the line said otherwise."""
    from hybridpar import load_config
    from hybridpar.train.run.tokenizer import prepare_data

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "a.py").write_text("def f(x):\n    return x + 1\n")
    (tmp_path / "lib" / "b.py").write_text("def g(y):\n    return y * 2\n")
    config = load_config(None, ["data.task=python_stdlib", f"data.path={tmp_path / 'lib'}", "data.tokenizer=bpe",
                                f"output_dir={tmp_path / 'run'}"])
    said = []
    prepare_data(config, 4096, say=said.append)
    learned = json.loads((tmp_path / "run" / "tokenizer" / "tokenizer.json").read_text())
    size = len(learned["model"]["vocab"])
    assert size < 300 and f"trained a byte-level BPE tokenizer (vocab {size} of the model's 4096: the files hold too few " \
        f"repeated pieces for more merges, so {4096 - size} embedding rows are never used) on 2 files" in said[0], said


def test_lora_on_moe_experts_by_module_name_points_at_target_parameters():
    """``peft.target_modules=[experts]`` on a MoE model was told to "use names of its linear layers" only: the experts'
    stacked weights are adapted by ``peft.target_parameters``, which the message did not name."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hybridpar import add_lora

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               num_experts=2, num_experts_per_tok=1, head_dim=8))
    with pytest.raises(ValueError) as error:
        add_lora(model, targets=["experts"])
    assert "matches only non-Linear modules (['Qwen3MoeExperts']) of Qwen3MoeForCausalLM; use names of its linear layers, " \
        "e.g. ['k_proj', 'o_proj', 'q_proj', 'v_proj']; its stacked expert weights are adapted by " \
        "peft.target_parameters=[experts.down_proj,experts.gate_up_proj]." in one_line(error)


@pytest.mark.timeout(60, method="thread")  # pytest-timeout's signal method holds the timer the limit uses
def test_a_chat_template_that_loops_is_stopped(tmp_path, folder, monkeypatch):
    """A template with nested loops (``range(100000)`` twice: jinja's sandbox bounds each range, not their product)
    rendered for minutes per conversation before any step, in the launcher and every rank, with nothing said."""
    import time

    import hybridpar.data.tokenizers as tokenizers
    from hybridpar.data.chat import chat_document
    from hybridpar.data.tokenizers import load_pretrained_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% for m in messages %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}{% endfor %}")
    monkeypatch.setattr(tokenizers, "RENDER_SECONDS", 0.5)
    started = time.perf_counter()
    with pytest.raises(ValueError) as error:
        chat_document([U, A], load_pretrained_tokenizer(tmp_path))
    assert time.perf_counter() - started < 5
    assert f"the chat template of tokenizer {tmp_path} took more than 0.5 s to render one conversation (a loop in the " \
        "template?)" in one_line(error)
    import signal
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0 and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None)
