"""Faults, round 5: variants of the earlier classes found by probing as a careful user, one test per
class, on real files (in-process where the fault allows, so the file stays fast)."""

import datetime
import json
import os
import re

import pytest

from hybridpar.config import ConfigError, load_config
from tests.train.test_faults_round3 import DEFAULT, TINY, tiny_hf
from tests.train.fault_probes import one_line as _one_line

FILE_TASK = [*TINY, "data.task=text", "data.task_options={}"]


# -- config: a misspelt or misplaced key names the one meant; a path or list element says what is wrong --


@pytest.mark.parametrize("override, meant", [
    ("train.tp=2", "parallel.tp"), ("train.stpes=2", "train.steps"), ("trian.steps=2", "train"),
    ("data.packsize=64", "data.pack_size"), ("lr=0.1", "train.lr"), ("output=runs/x", "output_dir")])
def test_an_unknown_key_names_the_key_it_most_likely_is(override, meant):
    """``train.tp=2`` listed the keys of train:, none of which it is; the right key is parallel.tp."""
    with pytest.raises(ConfigError) as error:
        load_config(DEFAULT, [override])
    assert f"; did you mean {meant}?" in _one_line(error)


def test_a_mapping_written_without_the_space_after_the_colon_says_so(tmp_path):
    """``{rotary_fraction:0.0}`` is one YAML key (``'rotary_fraction:0.0'``) with no value."""
    from hybridpar.train.batches import DataError, validate_data
    from hybridpar.train.preflight import model_config

    with pytest.raises(ConfigError) as error:
        model_config(load_config(DEFAULT, [*TINY, "model.overrides={rotary_fraction:0.0}"]))
    assert "YAML needs a space after the colon: write 'rotary_fraction: 0.0'" in _one_line(error)
    (tmp_path / "docs.txt").write_text("text\n")
    config = load_config(DEFAULT, [*TINY, "data.task=text", f"data.path={tmp_path}/docs.txt", "data.task_options={splt: line}"])
    with pytest.raises(DataError, match="did you mean split?"):
        validate_data(config.data, 256)


def test_a_path_that_cannot_be_looked_up_says_why_and_a_bad_list_element_is_named(tmp_path):
    """A symlink loop was "must be a path the system can look up (no NUL, every name at most 255 bytes)",
    neither of which it broke; ``train.betas=[0.9,nan]`` said "a list of 2 numbers (got list)"."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(ConfigError) as error:
        load_config(DEFAULT, [f"data.path={tmp_path}/a"])
    assert "this one: the system cannot look it up (Too many levels of symbolic links)" in _one_line(error)
    with pytest.raises(ConfigError) as error:
        load_config(DEFAULT, ["train.betas=[0.9,nan]"])
    assert "(got a str in it: 'nan')" in _one_line(error)


def test_a_collective_timeout_is_a_duration_the_process_group_can_hold():
    """``train.collective_timeout_s=1e300`` passed the config and was an OverflowError traceback in
    ``datetime.timedelta`` when the process group started (after the launcher's checks)."""
    for value in ("1e300", "0.5", "0"):
        with pytest.raises(ConfigError, match=r"it must be a number in \[1, 1e\+09\]"):
            load_config(DEFAULT, [f"train.collective_timeout_s={value}"])
    longest = load_config(DEFAULT, ["train.collective_timeout_s=1e9"]).train.collective_timeout_s
    assert datetime.timedelta(seconds=longest).days > 10_000


def test_a_flag_given_twice_is_said(tmp_path, capsys):
    """argparse keeps the last ``--config`` (two files are not merged) or ``--nproc-per-node`` silently."""
    from hybridpar.cli import main, repeated_arguments

    notes = repeated_arguments(["train", "--config", "a.yaml", "--conf=b.yaml", "--dry-run", "--nproc-per-node", "2",
                                "--nproc-per-node", "2", "train.steps=3"])
    assert notes == ["--config is given twice (--config a.yaml, then --config b.yaml); the last one is used: config "
                     "files are not merged"]
    assert main(["train", "--config", DEFAULT, "--nproc-per-node", "2", "--nproc-per-node", "1", *TINY,
                 f"output_dir={tmp_path}", "--dry-run"]) == 0
    assert ("hybridpar: warning: --nproc-per-node is given twice (--nproc-per-node 2, then --nproc-per-node 1); the last "
            "one is used") in capsys.readouterr().err


# -- keys the run would not read ------------------------------------------------------------------------


def test_a_key_the_run_would_not_read_is_refused_or_said():
    """``data.path`` with a synthetic task trained on MQAR without a word (the file was never read);
    an export architecture without an export, adapter settings without adapters, and a skip limit
    that never skips changed nothing, silently."""
    from hybridpar.train.batches import DataError, validate_data
    from hybridpar.train.unused_keys import unused_key_notices

    with pytest.raises(DataError) as error:
        validate_data(load_config(DEFAULT, [*TINY, "data.path=/etc/hostname"]).data, 256)
    assert _one_line(error).startswith("data.path='/etc/hostname' is not read by data.task='mqar'")
    notes = unused_key_notices(load_config(DEFAULT, [*TINY, "model.export_architecture=BambaForCausalLM", "peft.r=4",
                                                     "peft.merge=true", "train.max_nonfinite_skips=3"]))
    assert [n.split(" is not used")[0].split(" are not used")[0] for n in notes] == [
        "model.export_architecture='BambaForCausalLM'", "peft.r, peft.merge", "train.max_nonfinite_skips=3"]
    assert unused_key_notices(load_config(DEFAULT, TINY)) == []
    assert unused_key_notices(load_config(DEFAULT, [*TINY, "peft.method=lora", "peft.r=4"])) == []


@pytest.mark.parametrize("export, output_dir, problem", [
    ("run", "run", "it is or holds output_dir="), ("top", "top/run", "it is or holds output_dir="),
    ("run/checkpoints/hf", "run", "it lies in output_dir's checkpoints/")])
def test_an_export_the_run_itself_would_fill_is_refused_at_start(tmp_path, export, output_dir, problem):
    """An export target that is output_dir (or holds it, or lies in its checkpoints/) passed the
    preflight, was full when training ended, and the export went elsewhere with a warning."""
    from hybridpar.train.preflight import model_config
    from hybridpar.train.run.export import validate_export

    config = load_config(DEFAULT, [*TINY, f"model.export_hf={tmp_path / export}", f"output_dir={tmp_path / output_dir}",
                                   "model.export_architecture=NemotronHForCausalLM", "model.overrides={rotary_fraction: 0.0}"])
    with pytest.raises(ConfigError) as error:
        validate_export(config, model_config(config))
    assert f"model.export_hf='{tmp_path / export}' cannot be written: {problem}" in _one_line(error)
    fine = load_config(DEFAULT, [*TINY, f"model.export_hf={tmp_path}/run/export", f"output_dir={tmp_path}/run",
                                 "model.export_architecture=NemotronHForCausalLM", "model.overrides={rotary_fraction: 0.0}"])
    validate_export(fine, model_config(fine))


# -- files: JSON nested too deep, config.json values transformers refuses, directories of another kind ---


def test_json_nested_too_deep_is_one_line_naming_the_file(tmp_path):
    """A JSON file of 100,000 nested brackets (a JSONL line, config.json, the shard index, a checkpoint
    manifest) was a RecursionError traceback: not a ValueError, so no handler saw it."""
    from hybridpar.data.sources import read_jsonl
    from hybridpar.models.hf.causal_lm import load_causal_lm
    from hybridpar.train.run.checkpoint import incomplete_reason

    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "deep.jsonl").write_text('{"text": "fine"}\n' + deep + "\n")
    with pytest.raises(ValueError) as error:
        list(read_jsonl(tmp_path / "deep.jsonl"))
    assert _one_line(error).startswith(f"{tmp_path}/deep.jsonl:2: not valid JSON (nested too deeply to read")
    config_json = tiny_hf(tmp_path / "config")
    (config_json / "config.json").write_text(deep)
    with pytest.raises(ValueError) as error:
        load_causal_lm(config_json)
    assert f"{config_json}/config.json is not valid JSON" in _one_line(error)
    index = tiny_hf(tmp_path / "index")
    (index / "model.safetensors").rename(index / "model-00001-of-00001.safetensors")
    (index / "model.safetensors.index.json").write_text(deep)
    with pytest.raises(ValueError) as error:
        load_causal_lm(index, "transformers")
    assert "model.safetensors.index.json is not a valid safetensors index" in _one_line(error)
    (tmp_path / "step_00000001").mkdir()
    (tmp_path / "step_00000001" / "manifest.json").write_text(deep)
    assert "manifest.json is unreadable (maximum recursion depth" in incomplete_reason(tmp_path / "step_00000001")


@pytest.mark.parametrize("field, value, error", [("hidden_size", "32", "expected int, got str"),
                                                 ("num_attention_heads", 0, "ZeroDivisionError")])
def test_a_config_json_value_transformers_refuses_is_one_line(tmp_path, field, value, error):
    """transformers' config classes refuse such values with exceptions that are not ValueError
    (a hub validation error, ZeroDivisionError): a traceback from train, plan and generate."""
    import transformers as hf

    from hybridpar.models.hf.causal_lm import load_causal_lm
    from hybridpar.train.hf_model import hf_shape

    hf.LlamaForCausalLM(hf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                       vocab_size=260)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ConfigError) as raised:
        hf_shape(tmp_path)  # train, check and plan
    assert f"model.hf_path='{tmp_path}': {tmp_path}/config.json cannot be read by transformers (" in _one_line(raised)
    assert error in str(raised.value)
    with pytest.raises(ValueError) as raised:
        load_causal_lm(tmp_path, "transformers")  # generate --hf-path: read_hf_config's own rule (round 9)
    assert f"config.json: {field}={value!r} must be an integer >= 1; restore the checkpoint's config.json." \
        in _one_line(raised)


def test_a_directory_of_another_kind_is_named_for_what_it_is(tmp_path):
    """model.hf_path at a LoRA adapter, a training run or a tokenizer said "config.json not found; a
    Hugging Face checkpoint directory needs config.json"; checkpoint.resume at a Hugging Face model
    said its "manifest.json is missing (the save did not finish)"."""
    from hybridpar.models.hf.config import read_hf_config
    from hybridpar.train.run.checkpoint import incomplete_reason
    from tests.data.bpe import train_tiny_bpe

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base"}))
    (tmp_path / "run" / "checkpoints" / "step_00000002").mkdir(parents=True)
    train_tiny_bpe(tmp_path / "tok")
    cases = {"adapter": "is a LoRA adapter (adapter_config.json) of the base model '/models/base', not a whole model",
             "run": "is a hybridpar training run or checkpoint, not a Hugging Face model",
             "run/checkpoints/step_00000002": "is a hybridpar training run or checkpoint",
             "tok": "holds a tokenizer only, no model (no config.json)"}
    for name, kind in cases.items():
        with pytest.raises(FileNotFoundError, match=re.escape(kind)):
            read_hf_config(tmp_path / name)
    model = tiny_hf(tmp_path / "hf")
    assert "is a Hugging Face model (config.json), not a hybridpar training checkpoint" in incomplete_reason(model)
    assert "not a hybridpar training checkpoint: start a run from that base model" in incomplete_reason(tmp_path / "adapter")
    assert incomplete_reason(tmp_path / "run/checkpoints/step_00000002").endswith("manifest.json is missing (the save did "
                                                                                  "not finish)")


# -- data: a UTF-16 file, a conversation that opens with the assistant -------------------------------------


def test_a_utf16_file_is_named_as_utf16_not_binary(tmp_path):
    """A file saved as "Unicode" (UTF-16, with its byte-order mark) was called binary, with a latin1 fix."""
    from hybridpar.data.sources import read_text_file

    for encoding, name in (("utf-16", "UTF-16"), ("utf-32", "UTF-32")):
        (tmp_path / "docs.txt").write_text("first document\n\nsecond\n", encoding=encoding)
        with pytest.raises(ValueError) as error:
            read_text_file(tmp_path / "docs.txt")
        assert _one_line(error).startswith(f"{tmp_path}/docs.txt: the file is {name} text (it starts with the {name} "
                                           f"byte-order mark), not UTF-8; convert it (e.g. iconv -f {name} -t utf-8")


def test_a_conversation_opening_with_the_assistant_is_named_as_such(tmp_path):
    """It was "Cannot apply chat template to an empty conversation": the conversation was not empty."""
    from hybridpar.data.chat import chat_documents
    from hybridpar.data.tokenizers import load_pretrained_tokenizer
    from tests.data.bpe import train_tiny_bpe

    train_tiny_bpe(tmp_path / "tok")
    record = {"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "how can I help?"}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError) as error:
        chat_documents([tmp_path / "chat.jsonl"], load_pretrained_tokenizer(tmp_path / "tok"))
    assert _one_line(error).startswith(f"{tmp_path}/chat.jsonl:1: message 0 has role 'assistant' out of order")
    assert "must open with a user message" in str(error.value)  # round 12: whatever the template renders


# -- checkpoints and runs: run.json not what hybridpar writes; advice that fits what is there ---------------


@pytest.mark.parametrize("edit, said", [(lambda info: [1, 2], "it holds a JSON list, not an object"),
                                        (lambda info: {**info, "step": "two"}, "its step is 'two', not an integer >= 0"),
                                        (lambda info: {**info, "config": [1]}, "its config is a list, not an object")])
def test_a_run_json_that_is_not_what_hybridpar_writes_is_one_line(tmp_path, edit, said):
    """run.json edited (its manifest re-signed) was an AttributeError traceback or "invalid literal for
    int()", naming no file, from train and generate --checkpoint alike."""
    from hybridpar.train.run.checkpoint import CheckpointError, _write_manifest, read_run_info

    step = tmp_path / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "run.json").write_text(json.dumps(edit({"step": 2, "run_id": "x", "config": {}})))
    _write_manifest(step)
    with pytest.raises(CheckpointError) as error:
        read_run_info(step)
    assert _one_line(error).startswith(f"{step}/run.json cannot be read ({said}): it was edited or written by another")


def test_a_fresh_run_into_a_run_without_checkpoints_is_not_told_to_resume_it(tmp_path):
    """An earlier run that saved no checkpoint (checkpoint.every=-1) left metrics.jsonl; the refusal said
    "resume it with checkpoint.resume=auto", which had just found nothing to resume."""
    from hybridpar.train.run.resume import plan_resume

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError) as error:
        plan_resume(load_config(DEFAULT, [*TINY, f"output_dir={tmp_path}"]))
    message = _one_line(error)
    assert "it saved no checkpoint to resume (checkpoint.resume=auto found none): set checkpoint.if_exists" in message
    assert "resume it with" not in message


def test_a_shard_index_pointing_outside_its_checkpoint_is_refused(tmp_path):
    """An index whose shard is '../other/model.safetensors' loaded weights from another checkpoint."""
    from hybridpar.models.hf.causal_lm import load_causal_lm

    tiny_hf(tmp_path / "other")
    path = tiny_hf(tmp_path / "hf")
    names = json.loads((path / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (path / "model.safetensors").read_bytes()[:8], "little")])
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: "../other/model.safetensors" for name in names if name != "__metadata__"}}))
    with pytest.raises(ValueError) as error:
        load_causal_lm(path, "transformers")
    assert "lists the shard '../other/model.safetensors', outside" in _one_line(error)


# -- the command line: bytes that are not UTF-8, a world size the layout cannot divide -----------------------


def test_command_line_bytes_that_are_not_utf8_are_named_not_called_malformed(tmp_path):
    """A file name that is not UTF-8 (valid on Linux) reaches Python as surrogate escapes: an override
    holding one was "a malformed value ... write it as a YAML value", a --prompt one an encoder error."""
    from argparse import Namespace

    from hybridpar.generate import check_generate_arguments

    path = os.fsdecode(bytes(tmp_path) + b"/\xff.txt")
    with pytest.raises(ConfigError) as error:
        load_config(DEFAULT, [f"data.path={path}"])
    assert "it holds a byte that is not UTF-8 (0xff at character" in _one_line(error) and "rename it" in str(error.value)
    args = Namespace(max_new_tokens=2, temperature=0.0, top_p=1.0, seed=None, hf_path=None, checkpoint=str(tmp_path),
                     tokenizer="auto", backend="auto", dtype=None, prompt="a\udcffb")
    with pytest.raises(ValueError, match=r"--prompt 'a\\udcffb' is not usable: it holds a byte that is not UTF-8 \(0xff "
                                         r"at character 1\); pass UTF-8 text."):
        check_generate_arguments(args)


def test_a_world_size_the_layout_cannot_divide_gets_a_layout_that_fits():
    """``plan --world-size 3`` with cp=2 suggested "dp_shard=?"."""
    from hybridpar.parallel.dims import ParallelDims

    with pytest.raises(ValueError, match=r"\(e.g. dp_shard=3 with dp_replicate=cp=tp=1, as 3 is not divisible by "
                                         r"dp_replicate\*cp\*tp=2\)"):
        ParallelDims(cp=2).validate(3)


def test_a_resume_in_another_precision_is_said(tmp_path):
    """model.dtype (or parallel.mixed_precision) changed on resume cast the checkpoint without a word:
    the run went on, but its losses were no longer those of the uninterrupted run."""
    from hybridpar.train.run.numerics import numeric_changes

    info = {"config": {"model": {"dtype": "float32"}, "parallel": {"mixed_precision": None}}}
    notes = numeric_changes(tmp_path, info, load_config(DEFAULT, [*TINY, "model.dtype=float64",
                                                                  "parallel.mixed_precision=bf16"]))
    assert [n.split(";")[0] for n in notes] == [
        f'warning: checkpoint {tmp_path} was trained with model.dtype="float32"',
        f"warning: checkpoint {tmp_path} was trained with parallel.mixed_precision=null"]
    assert numeric_changes(tmp_path, info, load_config(DEFAULT, TINY)) == []
    assert numeric_changes(tmp_path, {}, load_config(DEFAULT, [*TINY, "model.dtype=float64"])) == []


@pytest.mark.parametrize("task, options, said", [
    ("jsonl", "{text_field: [a]}", "data.task_options.text_field=['a'] is invalid: it must be a non-empty string"),
    ("prompt_completion", "{prompt_field: ''}", "data.task_options.prompt_field='' is invalid"),
    ("hf_dataset", "{field: 5}", "data.task_options.field=5 is invalid: it must be a non-empty string (a field or "
                                 "column name) or null"),
    ("hf_dataset", "{kind: prose}", "data.task_options.kind='prose' is invalid: it must be one of ['messages', "
                                    "'prompt_completion', 'text']")])
def test_a_file_task_option_of_the_wrong_type_is_refused_before_any_process(tmp_path, task, options, said):
    """``text_field: [a]`` was a TypeError traceback on the ranks; ``kind: prose`` and ``field: 5`` were
    found on the ranks after the model was built, naming neither data.task_options key."""
    from hybridpar.train.batches import DataError, validate_data

    (tmp_path / "data.jsonl").write_text('{"text": "hi", "prompt": "a", "completion": "b"}\n')
    config = load_config(DEFAULT, [*TINY, f"data.task={task}", f"data.path={tmp_path}/data.jsonl",
                                   f"data.task_options={options}"])
    with pytest.raises(DataError) as error:
        validate_data(config.data, 256)
    assert _one_line(error).startswith(said)


@pytest.mark.parametrize("argv, said", [
    (["check", "--tolerance", "abc"], "argument --tolerance: invalid float value: 'abc' ('hybridpar check --help'"),
    (["plan", "--dry-run"], "unrecognized arguments: --dry-run ('hybridpar plan --help' lists the flags)."),
    (["train", "--nproc-per-node", "x" * 5000], "argument --nproc-per-node: invalid int value: 'xxx"),
    ([], "the following arguments are required: VERB ('hybridpar --help' lists the flags).")])
def test_a_flag_argparse_cannot_read_is_one_bounded_line(capsys, argv, said):
    """argparse printed its usage (several lines), then ``hybridpar VERB: error:`` with the value whole."""
    from hybridpar.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith(f"hybridpar: error: {said}"), err
    assert len(err) < 600


def test_a_tokenizer_that_encodes_text_to_nothing_is_refused(tmp_path):
    """A tokenizer.json whose vocabulary is empty encoded every document as [BOS, EOS] (or a WordLevel
    one as all unknown tokens): the run trained on nothing, without a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hybridpar.data.tokenizers import load_pretrained_tokenizer
    from tests.data.bpe import train_tiny_bpe

    train_tiny_bpe(tmp_path / "empty")
    saved = json.loads((tmp_path / "empty" / "tokenizer.json").read_text())
    saved["model"].update(vocab={}, merges=[])
    (tmp_path / "empty" / "tokenizer.json").write_text(json.dumps(saved))
    unknown = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2}, unk_token="[UNK]"))
    unknown.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=unknown, unk_token="[UNK]", bos_token="<s>",
                            eos_token="</s>").save_pretrained(tmp_path / "unknown")
    for name, said in (("empty", "encodes text to no tokens"), ("unknown", "encodes text to its unknown token only")):
        with pytest.raises(ValueError) as error:
            load_pretrained_tokenizer(tmp_path / name)
        assert _one_line(error).startswith(f"the tokenizer in '{tmp_path / name}' {said}")
    train_tiny_bpe(tmp_path / "fine")
    assert load_pretrained_tokenizer(tmp_path / "fine").encode("fox", add_special_tokens=False)


def test_a_yaml_key_that_is_a_list_or_mapping_is_one_line(tmp_path):
    """``? [a, b]`` (a complex key) in a config file or an override was a TypeError traceback."""
    (tmp_path / "run.yaml").write_text("train:\n  ? [a, b]\n  : 3\n")
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "run.yaml")
    assert _one_line(error).startswith(f"config file '{tmp_path}/run.yaml' is not valid YAML at line 2, column 5: the "
                                       "key ['a', 'b'] is a list; a key is a name")
    with pytest.raises(ConfigError, match=r"the key \{'a': 1\} is a dict; a key is a name"):
        load_config(DEFAULT, ["data.task_options={{a: 1}: 1}"])


def test_an_override_the_shell_split_at_a_space_says_to_quote_it():
    """``data.task_options={vocab_size: 16}`` unquoted reaches hybridpar as two words; the first was "a
    malformed value ... write it as a YAML value", which it was, in the user's shell."""
    with pytest.raises(ConfigError) as error:
        load_config(DEFAULT, ["data.task_options={vocab_size:", "16}"])
    assert _one_line(error).endswith('in quotes: the shell splits an unquoted override at its spaces, so quote it whole '
                                     '("data.task_options={vocab_size: ...").')
    with pytest.raises(ConfigError) as error:
        load_config(DEFAULT, ["train.betas=[0.9,]]"])
    assert "quote" not in _one_line(error)


def test_model_overrides_dtype_points_at_model_dtype():
    """``model.overrides={dtype: float64}`` listed the HybridConfig fields, dtype among them in spirit."""
    from hybridpar.train.preflight import model_config

    with pytest.raises(ConfigError) as error:
        model_config(load_config(DEFAULT, [*TINY, "model.overrides={dtype: float64}"]))
    assert "unknown field(s) ['dtype']; the dtype is model.dtype;" in _one_line(error)


def test_an_output_folder_that_is_a_dangling_or_looping_link_is_named_as_one(tmp_path):
    """output_dir/checkpoints as a symlink to itself was "it is a file, not a directory"."""
    from hybridpar.train.run.directory import check_run_paths

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(tmp_path / "run" / "checkpoints")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for output_dir, key in (("run", "output_dir (its checkpoints/)"), ("gone", "output_dir=")):
        with pytest.raises(ConfigError) as error:
            check_run_paths(load_config(DEFAULT, [*TINY, f"output_dir={tmp_path / output_dir}"]))
        assert key in _one_line(error) and "it is a symbolic link to nothing that exists (" in str(error.value)
        assert "a file, not a directory" not in str(error.value)


def test_a_path_starting_with_a_tilde_is_the_home_directory(tmp_path, monkeypatch):
    """``~/data.txt`` in a YAML file or a quoted override reaches hybridpar unexpanded (only a shell
    expands it): data.path "is not a file", and output_dir wrote to a folder named '~' in the
    working directory without a word."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run.yaml").write_text("data:\n  path: ~/docs.txt\noutput_dir: ~/runs/x\n")
    config = load_config("~/run.yaml", ["model.hf_path=~/model", "checkpoint.resume=auto", "data.tokenizer=bytes"])
    assert (config.data.path, config.output_dir, config.model.hf_path) == (
        f"{tmp_path}/docs.txt", f"{tmp_path}/runs/x", f"{tmp_path}/model")
    assert (config.checkpoint.resume, config.data.tokenizer) == ("auto", "bytes")


def test_a_data_file_moved_with_its_content_unchanged_resumes_and_generate_names_a_moved_tokenizer(tmp_path):
    """A data file moved to another path (same bytes) was refused as "would change the training batches
    ... set those keys back to the recorded values", a path that no longer existed; its content
    fingerprint shows the batches are the same. generate --checkpoint on a run whose tokenizer
    directory moved said "tokenizer=... is neither 'auto', 'bytes' nor an existing directory"."""
    from hybridpar.config import to_dict
    from hybridpar.generate import load_for_generation
    from hybridpar.train.run.checkpoint import CheckpointError, _write_manifest
    from hybridpar.train.run.resume import data_stream, plan_resume

    (tmp_path / "a.txt").write_text("one\n\ntwo\n")
    old = load_config(DEFAULT, [*FILE_TASK, f"data.path={tmp_path}/a.txt", f"output_dir={tmp_path}/run",
                                f"data.tokenizer={tmp_path}/tok"])
    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    (step / "run.json").write_text(json.dumps({"step": 1, "run_id": "r", "config": to_dict(old),
                                               "data": data_stream(old, 2)}))
    _write_manifest(step)
    (tmp_path / "a.txt").rename(tmp_path / "b.txt")
    new = load_config(DEFAULT, [*FILE_TASK, f"data.path={tmp_path}/b.txt", f"output_dir={tmp_path}/run",
                                f"data.tokenizer={tmp_path}/tok"])
    plan = plan_resume(new)
    assert plan.checkpoint == str(step)
    assert [n for n in plan.notes if n.startswith(f"data.path moved from '{tmp_path}/a.txt' to '{tmp_path}/b.txt' with "
                                                  "the same content (sha256 ")]
    (tmp_path / "b.txt").write_text("one\n\nthree\n")
    with pytest.raises(CheckpointError, match="would change the training batches"):
        plan_resume(new)
    with pytest.raises(ValueError) as error:
        load_for_generation(checkpoint=str(step))
    assert _one_line(error).startswith(f"the run's data.tokenizer '{tmp_path}/tok' (recorded in {step}/run.json) is gone")


def test_sampling_settings_that_greedy_decoding_ignores_are_said(capsys):
    """--seed and --top-p at --temperature 0 (and train.sample's), or --backend with --checkpoint,
    changed nothing, silently."""
    from argparse import Namespace

    from hybridpar.generate import check_generate_arguments
    from hybridpar.train.unused_keys import unused_key_notices

    args = dict(max_new_tokens=2, temperature=0.0, top_p=0.5, seed=5, hf_path=None, checkpoint="runs/x", tokenizer="auto",
                backend="transformers", dtype=None, prompt="hi")
    check_generate_arguments(Namespace(**args))
    assert capsys.readouterr().err.splitlines() == [
        "hybridpar: warning: --seed and --top-p are not used: --temperature 0 is greedy (the most likely token each "
        "step); set --temperature > 0 to sample",
        "hybridpar: warning: --backend transformers is not used: it chooses how --hf-path loads; a --checkpoint model "
        "is built as it was trained"]
    check_generate_arguments(Namespace(**{**args, "temperature": 0.8, "backend": "auto"}))
    assert capsys.readouterr().err == ""
    config = load_config(DEFAULT, [*TINY, "train.sample={prompt: hi, seed: 3}"])
    assert unused_key_notices(config) == ["train.sample's seed is not used: its temperature 0 is greedy (set "
                                          "train.sample.temperature > 0 to sample)"]


def test_a_jsonl_lone_surrogate_escape_is_named_with_its_line(tmp_path):
    """``{"text": "\\ud800"}`` is valid JSON but not text: an encoder error naming no file or line."""
    from hybridpar.data.sources import jsonl_documents
    from hybridpar.data.tokenizers import ByteTokenizer

    (tmp_path / "data.jsonl").write_text('{"text": "\\ud83d\\ude80 a pair is fine"}\n{"text": "x\\ud800"}\n')
    with pytest.raises(ValueError) as error:
        jsonl_documents([tmp_path / "data.jsonl"], tokenizer=ByteTokenizer())
    assert _one_line(error) == (f"{tmp_path}/data.jsonl:2: holds a lone surrogate escape (\\ud800), half of a UTF-16 "
                                "pair and not a character; fix or remove that record.")


def test_an_export_killed_mid_write_leaves_no_staging_folder_after_the_next_export(tmp_path):
    """SIGKILL during an export left ``.<name>.tmp-<pid>`` beside the target for good; the next export
    removes the staging folders of processes that are gone, and leaves a live one's alone."""
    import subprocess
    import sys

    from hybridpar.train.run.export import write_export

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    target = tmp_path / "export"
    stale = tmp_path / f".export.tmp-{int(gone.stdout)}"
    live = tmp_path / f".export.tmp-{os.getppid()}"  # this test's parent process: alive
    for folder in (stale, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    write_export(target, lambda staging: (staging.mkdir(), (staging / "config.json").write_text("{}")), None)
    assert (target / "config.json").is_file() and not stale.exists() and live.exists()
