"""Faults, round 6: inputs that were silently read another way (a JSON key written twice, a misspelt
chat role, environment variables that were not used), one test per class, in-process on real files."""

import json
import os
import struct

import pytest

from hybridpar.config import ConfigError
from tests.train.test_faults_round3 import DEFAULT, TINY, tiny_hf
from tests.train.fault_probes import one_line as _one_line


TWICE = "is written twice in one JSON object"


# -- JSON: a key written twice is refused by every reader, naming the file (and line) and the key --------


def test_a_json_key_written_twice_is_refused_by_every_reader(tmp_path):
    """``{"text": "a", "text": "b"}`` trained on "b" without a word; so did every JSON file hybridpar or
    transformers reads (config.json, the shard index, a safetensors header, the tokenizer's files, a
    checkpoint's run.json and manifest): the last of two values won."""
    from hybridpar.data.chat import chat_documents
    from hybridpar.data.hf_datasets import load_hf_dataset
    from hybridpar.data.sources import read_jsonl
    from hybridpar.data.tokenizers import load_pretrained_tokenizer
    from hybridpar.models.hf.config import read_hf_config
    from hybridpar.models.hf.weights import weight_files
    from hybridpar.train.run.checkpoint import CheckpointError, incomplete_reason, read_run_info
    from tests.data.bpe import train_tiny_bpe

    (tmp_path / "data.jsonl").write_text('{"text": "fine"}\n{"text": "a", "text": "b"}\n')
    with pytest.raises(ValueError) as error:
        list(read_jsonl(tmp_path / "data.jsonl"))
    assert _one_line(error).startswith(f"{tmp_path}/data.jsonl:2: the key 'text' {TWICE}")
    (tmp_path / "rows.json").write_text('[\n {"text": "a",\n  "text": "b"}]')  # datasets: the last won
    with pytest.raises(ValueError, match=f"rows.json:3: the key 'text' {TWICE}"):
        load_hf_dataset(tmp_path / "rows.json")
    train_tiny_bpe(tmp_path / "tok")
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi", "role": "assistant"}]}\n')
    with pytest.raises(ValueError, match=f"chat.jsonl:1: the key 'role' {TWICE}"):
        chat_documents(tmp_path / "chat.jsonl", load_pretrained_tokenizer(tmp_path / "tok"))

    model = tiny_hf(tmp_path / "hf")
    text = (model / "config.json").read_text()
    (model / "config.json").write_text(text.replace('"vocab_size"', '"vocab_size": 7,\n  "vocab_size"', 1))
    with pytest.raises(ValueError) as error:
        read_hf_config(model)
    line = (model / "config.json").read_text().split("\n").index('  "vocab_size": 7,') + 2  # the second one
    assert _one_line(error).startswith(f"{model}/config.json:{line}: the key 'vocab_size' {TWICE}")
    (model / "config.json").write_text(text)
    (model / "generation_config.json").write_text('{"eos_token_id": 1, "eos_token_id": 2}')
    with pytest.raises(ValueError, match=f"generation_config.json:1: the key 'eos_token_id' {TWICE}"):
        read_hf_config(model)

    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    (model / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00001.safetensors", "a": "model-00001-of-00001.safetensors"}}')
    with pytest.raises(ValueError, match=f"index.json:1: the key 'a' {TWICE}"):
        weight_files(model, "model.safetensors", "model.safetensors.index.json")

    raw = (model / "model-00001-of-00001.safetensors").read_bytes()  # the header names one tensor twice
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    name = next(k for k in header if k != "__metadata__")
    doubled = json.dumps(header)[:-1] + f', "{name}": ' + json.dumps(header[name]) + "}"
    doubled = doubled.encode().ljust(size, b" ") if len(doubled) <= size else doubled.encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(doubled)) + doubled + raw[8 + size:])
    with pytest.raises(ValueError, match=f"its header describes the tensor '{name}' twice"):
        weight_files(model, "model.safetensors", "model.safetensors.index.json")

    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(
        json.dumps(config)[:-1] + ', "padding_side": "left", "padding_side": "right"}')
    with pytest.raises(ValueError, match=f"tokenizer_config.json(:1)?: the key 'padding_side' {TWICE}"):
        load_pretrained_tokenizer(tmp_path / "tok")

    step = tmp_path / "step_00000001"
    step.mkdir()
    (step / "run.json").write_text('{"step": 1, "step": 5}')
    with pytest.raises(CheckpointError, match=f"run.json cannot be read .*the key 'step' {TWICE}"):
        read_run_info(step)
    (step / "manifest.json").write_text('{"format": 2, "files": {}, "sha256": {}, "files": {}}')
    assert f"manifest.json is unreadable (the key 'files' {TWICE}" in incomplete_reason(step)


def test_a_tensor_stored_in_two_shards_is_refused(tmp_path):
    """Two shards both holding a tensor: the loader kept whichever it read last, without a word."""
    from safetensors.torch import load_file, save_file

    from hybridpar.models.hf.weights import weight_files

    model = tiny_hf(tmp_path / "hf")
    tensors = load_file(model / "model.safetensors")
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[: len(names) // 2 + 1]}, model / "a.safetensors")
    save_file({n: tensors[n] for n in names[len(names) // 2:]}, model / "b.safetensors")
    (model / "model.safetensors").unlink()
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "a.safetensors" if i <= len(names) // 2 else "b.safetensors" for i, n in enumerate(names)}}))
    with pytest.raises(ValueError) as error:
        weight_files(model, "model.safetensors", "model.safetensors.index.json")
    assert _one_line(error).startswith(f"the tensor '{names[len(names) // 2]}' is stored in two shards, a.safetensors "
                                       "and b.safetensors")


# -- chat: a role that is not one is refused with the role it most likely is ------------------------------


@pytest.mark.parametrize("role, meant", [("asistant", "did you mean 'assistant'?"), ("User", "did you mean 'user'?"),
                                         ("", "fix the role"), ("gpt", "did you mean 'assistant'?")])
def test_a_chat_role_that_is_not_one_is_refused(tmp_path, role, meant):
    """``{"role": "asistant"}`` was rendered as a header of its own by ChatML (and dropped by other
    templates): its reply was never trained on, and nothing said so."""
    from hybridpar.data.chat import chat_documents, template_roles
    from hybridpar.data.tokenizers import load_pretrained_tokenizer
    from tests.data.bpe import train_tiny_bpe

    tokenizer = load_pretrained_tokenizer(train_tiny_bpe(tmp_path / "tok").source_dir)
    conversation = [{"role": "user", "content": "hi"}, {"role": role, "content": "hello"},
                    {"role": "assistant", "content": "ok"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": conversation}) + "\n")
    with pytest.raises(ValueError) as error:
        chat_documents(tmp_path / "chat.jsonl", tokenizer)
    message = _one_line(error)
    assert message.startswith(f"{tmp_path}/chat.jsonl:1: message 1 has role {role!r}, not a chat role") and meant in message
    assert "observation" in template_roles("{% if message['role'] == 'observation' %}")  # a template's own roles count


# -- environment: a variable that cannot be used is refused, one that is not used is said -----------------


def test_master_addr_and_port_with_nproc_per_node_are_said_to_be_unused(tmp_path, monkeypatch, capsys):
    """``MASTER_PORT=29999 hybridpar train --nproc-per-node 2`` used torchrun's own free port without a word."""
    from hybridpar.cli import main

    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert main(["train", "--config", DEFAULT, *TINY, f"output_dir={tmp_path}", "--nproc-per-node", "1", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert err.count("hybridpar: warning:") == 1, err  # not also the one-process run's "this run uses ... instead"
    assert "hybridpar: warning: MASTER_ADDR='10.1.2.3' and MASTER_PORT='29999' are not used: --nproc-per-node" in err
    assert main(["train", "--config", DEFAULT, *TINY, f"output_dir={tmp_path}", "--dry-run"]) == 0  # one process: used
    assert "not used" not in capsys.readouterr().err


@pytest.mark.parametrize("env, said", [
    ({"OMP_NUM_THREADS": "abc"}, "error: OMP_NUM_THREADS='abc' is not a thread count: it must be an integer >= 1"),
    ({"OMP_NUM_THREADS": "0"}, "error: OMP_NUM_THREADS='0' is not a thread count"),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "error: LOCAL_RANK and WORLD_SIZE are set, so this process takes itself for "
                                             "a torchrun worker, but RANK and MASTER_ADDR and MASTER_PORT are not"),
    ({"HYBRIDPAR_TRACEBACK": "maybe"}, "error: HYBRIDPAR_TRACEBACK='maybe' is invalid: it must be 1 (print the traceback"),
    ({"WORLD_SIZE": "4", "RANK": "2"}, "warning: RANK='2', WORLD_SIZE='4' are not used: without both LOCAL_RANK and "
                                       "WORLD_SIZE this is not a torchrun worker")])
def test_an_environment_variable_that_cannot_be_used_or_is_not_used_is_said(tmp_path, monkeypatch, capsys, env, said):
    """``OMP_NUM_THREADS=abc`` was libgomp's own line and its default; ``WORLD_SIZE=4`` without
    ``LOCAL_RANK`` ran one process silently; ``LOCAL_RANK`` and ``WORLD_SIZE`` without ``RANK`` was
    torch's "environment variable RANK expected" with no fix."""
    from hybridpar.cli import main

    for key in ("OMP_NUM_THREADS", "LOCAL_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
                "HYBRIDPAR_TRACEBACK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = main(["train", "--config", DEFAULT, *TINY, f"output_dir={tmp_path}", "--dry-run"])
    err = capsys.readouterr().err
    assert f"hybridpar: {said}" in err and len(err.splitlines()) == 1, err
    assert code == (2 if said.startswith("error") else 0)
    assert os.environ.get("OMP_NUM_THREADS") == env.get("OMP_NUM_THREADS")


# -- transformers' own output: a progress bar and a load report on stderr, besides our one line ----------


def test_loading_a_transformers_model_prints_nothing_of_transformers_own(tmp_path, capfd):
    """A checkpoint with an extra tensor printed transformers' progress bar and a "LOAD REPORT" table
    (9 lines) before hybridpar's one-line error; a good one printed the progress bar on every load."""
    from safetensors.torch import load_file, save_file

    from hybridpar.models.hf.causal_lm import load_causal_lm

    model = tiny_hf(tmp_path / "hf")
    load_causal_lm(model, "transformers")
    assert capfd.readouterr().err == ""
    tensors = load_file(model / "model.safetensors")
    save_file({**tensors, "model.bogus.weight": tensors[sorted(tensors)[0]][:1].clone()}, model / "model.safetensors")
    with pytest.raises(ValueError) as error:
        load_causal_lm(model, "transformers")
    assert "1 unexpected keys: model.bogus.weight" in _one_line(error)
    assert capfd.readouterr().err == ""


# -- config: an override key with an empty name, a config path that is not a regular file ----------------


def test_an_override_key_with_an_empty_name_and_a_config_that_is_a_device_say_so():
    """``train..steps=3`` was "unknown config key(s) ['train.']; did you mean train?"; ``--config
    /dev/null`` was "does not exist"."""
    from hybridpar.config import load_config

    for override in ("train..steps=3", ".train.steps=3", "train. steps=3"):
        with pytest.raises(ConfigError) as error:
            load_config(DEFAULT, [override])
        assert f"override {override!r} has an empty or spaced name in its key" in _one_line(error)
    with pytest.raises(ConfigError) as error:
        load_config("/dev/null", [])
    assert "config file '/dev/null' is not a regular file (a device, pipe or socket)" in _one_line(error)


def test_a_utf16_config_file_is_named_as_such(tmp_path):
    """A config saved as "Unicode" by a Windows editor was "not UTF-8 text (byte 0)"; a data file of the same
    kind was already named UTF-16 with the iconv line."""
    from hybridpar.config import load_config

    (tmp_path / "c.yaml").write_bytes("train:\n  steps: 3\n".encode("utf-16"))
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "c.yaml", [])
    assert "is UTF-16 text (its byte-order mark), not UTF-8; save it as UTF-8 YAML (e.g. iconv -f UTF-16" in _one_line(error)



def test_a_dotted_key_and_a_merge_key_in_a_yaml_file_say_what_to_write(tmp_path):
    """``train.steps: 3`` in a file was "unknown config key(s) ['train.steps']; did you mean
    train.steps?"; ``<<: *base`` was "could not determine a constructor for the tag ...merge"."""
    from hybridpar.config import load_config

    (tmp_path / "dotted.yaml").write_text("train.steps: 3\n")
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "dotted.yaml", [])
    assert "a dotted key is for command-line overrides: in a YAML file write it nested, 'train:' then '  steps: ...'" \
        in _one_line(error) and "did you mean" not in str(error.value)
    (tmp_path / "merge.yaml").write_text("base: &b\n  steps: 3\ntrain:\n  <<: *b\n")
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "merge.yaml", [])
    assert "at line 4, column 3: a merge key ('<<') is YAML 1.1 and is not read here" in _one_line(error)


@pytest.mark.parametrize("record, said", [
    ({"prompt": 5, "completion": "x"}, "prompt must be a string, got a int (5); write it as a JSON string"),
    ({"messages": {"role": "user", "content": "hi"}}, "'role': 'user'}; write it as [{\"role\""),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "x"}]},
     "hybridpar trains on text: join the text of the content parts into one string"),
    ({"messages": [{"from": "human", "value": "hi"}]}, "this is ShareGPT's {'from', 'value'}: convert each message")])
def test_a_sft_record_of_the_wrong_shape_says_the_fix(tmp_path, record, said):
    """"prompt must be a string, got int" named neither the value nor what to do; a multimodal
    content list was "every message needs string 'role' and 'content'"."""
    from hybridpar.data.chat import chat_documents, prompt_completion_documents
    from hybridpar.data.tokenizers import load_pretrained_tokenizer
    from tests.data.bpe import train_tiny_bpe

    tokenizer = load_pretrained_tokenizer(train_tiny_bpe(tmp_path / "tok").source_dir)
    (tmp_path / "r.jsonl").write_text(json.dumps(record) + "\n")
    read = prompt_completion_documents if "prompt" in record else chat_documents
    with pytest.raises(ValueError) as error:
        read(tmp_path / "r.jsonl", tokenizer)
    assert said in _one_line(error)


# -- hf_dataset: a file datasets cannot read is one line, without its progress bars ----------------------


@pytest.mark.parametrize("name, content, cause", [("bad.csv", 'text\n"unterminated\n', "ParserError: Error tokenizing data"),
                                                  ("bad.parquet", "PAR1garbage", "ArrowInvalid: Parquet magic bytes")])
def test_a_dataset_file_datasets_cannot_read_is_one_line(tmp_path, capfd, name, content, cause):
    """A CSV with an open quote was an 80-line DatasetGenerationError traceback (exit 1); a damaged
    parquet file printed datasets' own error line and then one without the file's name."""
    from hybridpar.data.hf_datasets import load_hf_dataset

    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError) as error:
        load_hf_dataset(tmp_path / name)
    assert _one_line(error).startswith(f"dataset {tmp_path / name} cannot be read ({cause}")
    assert capfd.readouterr().err == ""


# -- resume: a checkpoint folder renamed to another step is refused --------------------------------------


def test_a_checkpoint_renamed_to_another_step_is_refused(tmp_path):
    """``step_00000002`` renamed ``step_00000009`` was resumed (its run.json says step 2), and from then on
    resume=auto and retention, both by the name's step, took it for the newest: a later run went back
    to step 2 and retention could delete the true newest checkpoint."""
    from hybridpar.config import load_config
    from hybridpar.train.run.checkpoint import _write_manifest
    from hybridpar.train.run.resume import plan_resume

    folder = tmp_path / "checkpoints" / "step_00000009"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"step": 2, "run_id": "r"}))
    _write_manifest(folder)
    with pytest.raises(ValueError) as error:
        plan_resume(load_config(DEFAULT, [*TINY, f"output_dir={tmp_path}"]))
    assert _one_line(error).startswith(f"checkpoint '{folder}' is named for step 9 but holds step 2 (its run.json): it "
                                       "was renamed")
    assert "rename it back to step_00000002" in str(error.value)


def test_hybridpar_traceback_0_shows_no_traceback(monkeypatch, capsys):
    """Any non-empty ``HYBRIDPAR_TRACEBACK`` turned tracebacks on, ``=0`` and ``=false`` included."""
    from hybridpar.worker import error_message

    for value, shown in (("0", False), ("false", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("HYBRIDPAR_TRACEBACK", value)
        try:
            raise ValueError("bad input")
        except ValueError as error:
            assert error_message(error) == "bad input"
        assert ("Traceback" in capsys.readouterr().err) == shown, value
