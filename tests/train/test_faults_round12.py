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


def test_a_documents_labels_are_checked_like_its_ids():
    """``pack_documents`` cut float labels (1.5 -> 1) and passed a negative label other than -100 to the loss (a
    cross-entropy error at the first step; a device assert on a GPU)."""
    from hybridpar import pack_documents

    for labels, said in (([1.5, 1, 2], "a document's labels are float32, not integers"),
                         ([-5, 1, 2], "a document holds the negative label -5"),
                         ("abc", "a document's labels are token ids, not text")):
        with pytest.raises(ValueError) as error:
            pack_documents([{"input_ids": [1, 2, 3], "labels": labels}], 8)
        assert said in one_line(error)
    assert pack_documents([{"input_ids": [1, 2, 3], "labels": [-100, 3, -100]}], 8)[0]["labels"][:3].tolist() == [-100, 3, -100]


def test_pack_documents_other_arguments_are_checked():
    """``pad_id=-1`` padded with an id outside the embedding, ``pad_id=1.5`` was cut to 1, ``pad_to_multiple_of=0``
    said "not a multiple of 0 ... use pack_size=8", ``docs=None`` was a TypeError; a padding multiple given by
    ``pad_to_multiple_of`` was blamed on ``2*cp_size``."""
    from hybridpar import pack_documents

    for kwargs, said in ((dict(pad_id=-1), "pad_id=-1 must be a token id, an integer >= 0"),
                         (dict(pad_id=1.5), "pad_id=1.5 must be a token id"),
                         (dict(pad_to_multiple_of=0), "pad_to_multiple_of=0 must be None (2*cp_size) or an integer >= 1"),
                         (dict(pad_to_multiple_of=3), "pack_size=8 is not a multiple of 3 (pad_to_multiple_of)"),
                         (dict(docs=None), "docs=None must be a list of documents")):
        with pytest.raises(ValueError) as error:
            pack_documents(**{"docs": [[1, 2, 3]], "pack_size": 8, **kwargs})
        assert said in one_line(error)


@pytest.mark.parametrize("field, value, said", [
    ("rope_theta", 0.0, "rope_theta=0.0 must be a finite number > 0"), ("norm_eps", -1.0, "norm_eps=-1.0 must be"),
    ("time_step_limit", (1.0, 0.5), "must be [low, high] with 0 <= low <= high"),
    ("rope_theta", "1e4", "rope_theta='1e4' must be a finite number > 0"),
    ("mlp_activation", "swish", "must be one of 'silu', 'relu2', 'gelu'"), ("rotary_fraction", True, "must be a number in"),
])
def test_a_hybrid_configs_numbers_and_choices_are_checked_in_the_api(field, value, said):
    """``HybridConfig(rope_theta=0)`` or ``norm_eps=-1`` built a model whose logits were NaN: the rules held for
    ``model.overrides`` only."""
    from hybridpar import HybridConfig

    with pytest.raises(ValueError) as error:
        HybridConfig(**{field: value})
    assert said in one_line(error)


def test_a_hybrid_lm_of_something_else_than_a_hybrid_config_is_one_line():
    """``HybridLM("tiny")`` was an AttributeError from inside the backbone; ``HybridConfig(dtype="float32")``
    passed and ``dtype=torch.int64`` was ``nn.Module.to``'s TypeError."""
    import torch

    from hybridpar import HybridConfig, HybridLM

    for call, said in ((lambda: HybridLM("tiny"), "config='tiny' is not a HybridConfig (type str)"),
                       (lambda: HybridConfig(dtype="float32"), "dtype='float32' must be a floating torch.dtype"),
                       (lambda: HybridConfig(dtype=torch.int64), "dtype=torch.int64 must be a floating torch.dtype")):
        with pytest.raises(ValueError) as error:
            call()
        assert said in one_line(error)


def test_api_paths_and_configs_of_the_wrong_kind_are_one_line(tmp_path):
    """``load_config(5)``, ``load_hf(5)``, ``save_hf(model, 5)`` were os.fspath's TypeError, ``make_plan("run.yaml")``
    and ``add_lora("model")`` an AttributeError, ``make_plan(docs_per_pack=0)`` a plan, and ``load_config(None, "train.steps=3")`` read the string letter by letter ("override 't'")."""
    import hybridpar as hp

    model = hp.HybridLM(hp.HybridConfig())
    for call, said in ((lambda: hp.load_config(5), "config path=5 is not a path (type int)"),
                       (lambda: hp.load_config(None, "train.steps=3"), "overrides='train.steps=3' must be a list of"),
                       (lambda: hp.load_config(None, ["train.steps=3", 5]), "must be a list of 'key=value' strings"),
                       (lambda: hp.load_hf(5), "path=5 is not a path"), (lambda: hp.load_causal_lm(None), "path=None is"),
                       (lambda: hp.save_hf(model, 5), "path=5 is not a path"),
                       (lambda: hp.export_causal_lm(model, 5), "out_dir=5 is not a path"),
                       (lambda: hp.make_plan("run.yaml"), "the run config 'run.yaml' is not a RunConfig (type str)"),
                       (lambda: hp.make_plan(hp.load_config(None), world_size=0), "world_size=0 must be an integer >= 1"),
                       (lambda: hp.make_plan(hp.load_config(None), docs_per_pack=0), "docs_per_pack=0 must be an integer"),
                       (lambda: hp.make_plan(hp.load_config(None), docs_per_pack=1.5), "docs_per_pack=1.5 must be"),
                       (lambda: hp.add_lora("model", r=4), "add_lora takes the model (an nn.Module), got 'model'")):
        with pytest.raises(ValueError) as error:
            call()
        assert said in one_line(error)
    assert hp.load_config(None, ("train.steps=3",)).train.steps == 3


def test_a_jsonl_integer_too_long_for_python_names_the_file_and_line(tmp_path):
    """A 5,000-digit number in a JSONL record was Python's "Exceeds the limit (4300 digits) for integer string
    conversion ... use sys.set_int_max_str_digits()", naming no file or line."""
    from hybridpar.data.sources import read_jsonl

    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"text": "b", "n": 1' + "0" * 5000 + "}\n")
    with pytest.raises(ValueError) as error:
        list(read_jsonl(tmp_path / "d.jsonl"))
    assert one_line(error).startswith(f"{tmp_path}/d.jsonl:2: not valid JSON (an integer of more than 4300 digits at "
                                      "column 20)")


def test_a_data_file_written_for_another_task_or_format_is_named(tmp_path):
    """``data.task=text`` on a JSONL file trained on its braces, quotes and keys without a word; ``jsonl`` on chat
    records said only "pass text_field="; a JSON array file was "Expecting value at column 2"."""
    import warnings

    from hybridpar.config_rules import Notice
    from hybridpar.data.chat import prompt_completion_documents
    from hybridpar.data.sources import jsonl_documents, text_documents

    chat = {"messages": [U, A]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(text_documents(tmp_path / "chat.jsonl", split="line")) == 1
    said = [str(w.message) for w in caught if issubclass(w.category, Notice)]
    assert len(said) == 1 and "a text task trains on the JSON syntax too" in said[0] and "data.task=chat" in said[0]
    for read, task in ((jsonl_documents, "jsonl"), (prompt_completion_documents, "prompt_completion")):
        with pytest.raises(ValueError) as error:
            read(tmp_path / "chat.jsonl", None)
        assert "; it is a chat record: use data.task=chat" in one_line(error), task
    for text in (json.dumps([chat, chat]), json.dumps([chat, chat], indent=2)):
        (tmp_path / "d.json").write_text(text)
        with pytest.raises(ValueError) as error:
            jsonl_documents(tmp_path / "d.json")
        assert "the file is one JSON array, not JSON lines: write one object per line" in one_line(error)


def test_a_dry_run_says_a_resume_has_nothing_left_to_train(tmp_path, monkeypatch):
    """A checkpoint at or past ``train.steps`` passed ``--dry-run`` without a word; the run then built the model,
    loaded the checkpoint and trained nothing. (The checkpoint itself is checked by ``plan_resume``, tested in
    earlier rounds; here it stands in for one at step 5.)"""
    from hybridpar.train.run import resume

    monkeypatch.setattr(resume, "plan_resume", lambda config, model=None: resume.ResumePlan(
        str(tmp_path), checkpoint=str(tmp_path / "step_00000005"), start_step=5))
    args = ("train", "--dry-run", "--config", "configs/tiny-hybrid.yaml", "parallel.cp=1", "model.preset=tiny",
            "data.pack_size=64", "train.warmup_steps=0", f"output_dir={tmp_path}")
    for steps, said in ((5, True), (6, False)):
        code, output = cli(*args, f"train.steps={steps}")
        assert code == 0 and ("the checkpoint is at step 5, and train.steps=5: nothing is left to train" in output) == said, output


def test_an_override_of_a_whole_section_does_not_drop_keys_set_before_it(tmp_path):
    """``train={lr: 0.01}`` replaced the file's whole ``train`` section: its ``steps: 500`` became the default 60
    without a word (so did ``train=null``)."""
    from hybridpar.config import ConfigError, load_config

    for override in ("train={lr: 0.01}", "train=null"):
        with pytest.raises(ConfigError) as error:
            load_config("configs/tiny-hybrid.yaml", [override])
        assert "an override of the whole section 'train' would drop ['train.collective_timeout_s'," in one_line(error)
    with pytest.raises(ConfigError) as error:
        load_config(None, ["train.steps=4", "train={lr: 0.01}"])
    assert "would drop ['train.steps'] set before it; set its keys one by one" in one_line(error)
    assert load_config(None, ["train={lr: 0.01, steps: 3}"]).train.steps == 3  # nothing set before: allowed
    assert load_config("configs/tiny-hybrid.yaml", ["data.task_options={}"]).data.task_options == {}  # a mapping key


def test_a_text_file_with_classic_mac_line_ends_is_split_into_its_documents(tmp_path):
    """A file whose lines end in a lone CR (classic Mac OS, some exporters) was one document holding the CR bytes,
    under ``split=line`` and ``paragraph`` alike; Python's text mode reads a lone CR as a line end."""
    from hybridpar.data.sources import text_documents

    (tmp_path / "mac.txt").write_bytes(b"first doc\r\rsecond doc\r\rthird\r")
    for split, count in (("paragraph", 3), ("line", 3)):
        docs = text_documents(tmp_path / "mac.txt", split=split)
        assert len(docs) == count and all(13 not in doc for doc in docs), (split, docs)


def test_shard_inputs_and_canonical_state_arguments_of_the_wrong_kind_are_one_line():
    """``shard_inputs`` with a list for ``input_ids``, cu_seqlens for ``packed`` or a string for ``cp_group``, and
    ``canonical_state_dict`` / ``load_canonical_state_dict`` given no module, were an ``AttributeError`` from inside
    (``'list' object has no attribute 'dim'``)."""
    import torch

    import hybridpar as hp
    from hybridpar.data.thd import PackedSeqParams

    ids = torch.zeros(1, 8, dtype=torch.long)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 8], dtype=torch.int32))
    for kwargs, said in ((dict(input_ids=[[1, 2]]), "input_ids must be a torch.Tensor or None, got list"),
                         (dict(input_ids=ids, labels="x"), "labels must be a torch.Tensor or None, got str"),
                         (dict(input_ids=ids, packed=[0, 8]), "packed must be a PackedSeqParams or None, got list"),
                         (dict(input_ids=ids, packed=packed, cp_group="cp"), "cp_group must be a torch.distributed")):
        with pytest.raises(ValueError) as error:
            hp.shard_inputs(**kwargs)
        assert said in one_line(error)
    assert hp.shard_inputs(input_ids=ids, packed=packed).input_ids.shape == (1, 8)
    for call, said in ((lambda: hp.canonical_state_dict("model"), "canonical_state_dict takes the model"),
                       (lambda: hp.load_canonical_state_dict(None, {}), "load_canonical_state_dict takes the model"),
                       (lambda: hp.load_canonical_state_dict(torch.nn.Linear(2, 2), [1]), "state must be a dict")):
        with pytest.raises(ValueError) as error:
            call()
        assert said in one_line(error)


TINY_RUN = ["--config", "configs/tiny-hybrid.yaml", "parallel.cp=1", "parallel.tp=1", "data.pack_size=128",
            "train.steps=2", "train.eval_every=0", "plot=false", "tensorboard=false", "--dry-run"]


@pytest.mark.parametrize("setting, said", [
    (["train.lr=1e300"], "train.lr=1e+300 is too large: AdamW's first step, lr/(1-beta1) = 1e+301, is past the "
                         "largest float32"),
    (["train.lr=1e308", "model.dtype=float64", "train.weight_decay=0"], "train.lr=1e+308 is too large: AdamW's "
                                                                         "first step, lr/(1-beta1) = inf, is past "
                                                                         "the largest float64"),
    (["train.weight_decay=1e10"], "train.lr * train.weight_decay = 0.003 * 1e+10 = 3e+07 is >= 1: decoupled weight "
                                  "decay multiplies every weight"),
])
def test_optimizer_settings_that_overflow_or_flip_the_weights_are_refused_before_step_1(tmp_path, setting, said):
    """Before: lr >= ~3.4e37 was a traceback per rank from inside AdamW at step 1; lr * weight_decay >= 1 trained
    into NaN and blamed train.lr."""
    code, output = cli("train", *TINY_RUN, f"output_dir={tmp_path}", *setting)
    assert code == 2 and said in output and "Traceback" not in output, output
    ok = cli("train", *TINY_RUN, f"output_dir={tmp_path}", "train.lr=1e30", "model.dtype=float64", "train.weight_decay=0")
    assert ok[0] == 0, ok[1]


def test_the_pack_size_a_padding_message_suggests_is_itself_in_range(tmp_path):
    """Before: data.pack_size=2**31-1 at cp=2 was told to use 2**31, which the int32 rule refuses."""
    code, output = cli("train", *TINY_RUN, f"output_dir={tmp_path}", "data.pack_size=2147483647", "parallel.cp=2",
                       "--nproc-per-node", "2")
    assert code == 2 and "use data.pack_size=2147483644." in output, output


def test_a_resume_that_changes_the_gradient_clip_or_the_adapters_dropout_says_so():
    """Before: train.lr, betas and the like were warned about at resume, train.grad_clip and peft.dropout
    were applied without a word."""
    from hybridpar.config import load_config
    from hybridpar.train.run.numerics import numeric_changes

    info = {"config": {"train": {"grad_clip": 1.0}, "peft": {"dropout": 0.0}}}
    notes = numeric_changes("ck", info, load_config("configs/tiny-hybrid.yaml", ["train.grad_clip=0.001",
                                                                                 "peft.dropout=0.3"]))
    assert notes == [f"warning: checkpoint ck was trained with {key}={before}; resuming with {now} applies {now} from "
                     "the next step on, so the losses will not be those of the uninterrupted run"
                     for key, before, now in (("train.grad_clip", "1.0", "0.001"), ("peft.dropout", "0.0", "0.3"))]
    assert numeric_changes("ck", info, load_config("configs/tiny-hybrid.yaml", ["train.grad_clip=1.0"])) == []


def test_check_packing_proves_the_lora_model_training_runs(tmp_path):
    """Before: check --packing ignored peft.* without a word and compared the full model's gradients."""
    args = ["--config", "configs/tiny-hybrid.yaml", "parallel.cp=1", "parallel.tp=1", "data.pack_size=128",
            "train.eval_every=0", "plot=false", "tensorboard=false", "model.dtype=float64", f"output_dir={tmp_path}"]
    code, output = cli("check", "--packing", *args, "peft.method=lora", "peft.dropout=0.5")
    assert code == 0 and "check --packing exact" in output, output
    grads = [line.split()[1] for line in output.splitlines() if line.strip().startswith("grad ")]
    assert grads and all(".lora_A." in name or ".lora_B." in name for name in grads), grads
    assert "LoRA r=8: adapters on" in output and "peft.dropout=0.5 off here" in output, output


@pytest.mark.parametrize("override, said", [
    ("peft.method=LoRA", "use peft.method='lora' (the nearest choice)."),
    ("parallel.cp_attention=rign", "use parallel.cp_attention='ring' (the nearest choice)."),
    ("parallel.cp_attention=xyz", "e.g. parallel.cp_attention='allgather' (the default)."),
])
def test_a_choice_in_other_case_or_misspelt_is_named(override, said):
    """Before: peft.method=LoRA was told to use the default 'none'."""
    from hybridpar.config import ConfigError, load_config

    with pytest.raises(ConfigError) as error:
        load_config("configs/tiny-hybrid.yaml", [override])
    assert str(error.value).endswith(said), str(error.value)


def test_more_documents_per_pack_than_tokens_is_refused_by_plan_and_make_plan():
    """Before: --docs-per-pack 100000000 with 128-token packs was planned."""
    import hybridpar as hp

    code, output = cli("plan", "data.pack_size=128", "--docs-per-pack", "129")
    assert code == 2 and "--docs-per-pack 129 is invalid: it must be an integer in [1, data.pack_size=128]" in output
    with pytest.raises(ValueError, match=r"docs_per_pack=129 must be an integer in \[1, data.pack_size=128\]"):
        hp.make_plan(hp.load_config(None, ["data.pack_size=128"]), docs_per_pack=129)
    assert cli("plan", "data.pack_size=128", "--docs-per-pack", "128")[0] == 0


def test_a_resume_compares_target_lists_as_sets():
    """Before: [q_proj, v_proj] -> [v_proj, q_proj] (or a name written twice) was "adapters of another layout"."""
    import dataclasses

    from hybridpar.config import load_config
    from hybridpar.train.run.resume import CheckpointError, _check_peft

    lora = load_config("configs/tiny-hybrid.yaml", ["peft.method=lora", "peft.target_modules=[q_proj,v_proj]"])
    info = {"config": {"peft": json.loads(json.dumps(dataclasses.asdict(lora.peft)))}}
    for targets in ("[v_proj,q_proj]", "[q_proj,v_proj,q_proj]"):
        _check_peft("ck", info, load_config("configs/tiny-hybrid.yaml", ["peft.method=lora",
                                                                         f"peft.target_modules={targets}"]))
    with pytest.raises(CheckpointError, match=r"peft.target_modules \["):
        _check_peft("ck", info, load_config("configs/tiny-hybrid.yaml", ["peft.method=lora", "peft.target_modules=[q_proj]"]))
