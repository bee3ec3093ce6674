"""Round 13 of fault hunting (docs/reliability.md, "Round 13"): the files read from a checkpoint or
tokenizer directory. Each test holds one class of fault; a read without end runs in a child with a
memory limit and a timeout, so a regression fails fast instead of eating the machine's memory."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.train.fault_probes import one_line, one_process_cli

HEADROOM = 3 * 2**30  # address space a child may add to what it holds at the fork: a dry run needs far less


def _bounded_cli(rank, world_size, runs, headroom):
    """``one_process_cli`` with this process's address space capped ``headroom`` bytes above its size now."""
    import resource

    size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + headroom, resource.RLIM_INFINITY))
    return one_process_cli(rank, world_size, runs)


def refused_in_bounded_child(said: str, *runs: list[str]) -> None:
    """Each argv of ``runs`` in one harness child whose memory is capped ends in exit 2 and one error line,
    its last, that says ``said`` (no traceback)."""
    [results] = run_ranks(1, _bounded_cli, [list(argv) for argv in runs], HEADROOM, timeout_s=60)
    for code, out, err in results:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        assert code == 2 and last.startswith("hybridpar: error: ") and said in last and "Traceback" not in err, err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama with its BPE tokenizer (chat template, generation_config.json) and chat data."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.data.bpe import train_tiny_bpe

    folder = tmp_path_factory.mktemp("round13")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(folder / "model")
    train_tiny_bpe(folder / "model")
    turn = {"messages": [{"role": "user", "content": "hello, how are you?"},
                         {"role": "assistant", "content": "fine, the quick brown fox."}]}
    (folder / "chat.jsonl").write_text("".join(json.dumps(turn) + "\n" for _ in range(16)))
    return folder


def _with(checkpoint, tmp_path, name: str, kind: str):
    """A copy of the checkpoint whose ``name`` is ``kind``: "zero" (a link to /dev/zero), "fifo", "dir"."""
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint / "model", copy)
    (copy / name).unlink()
    {"zero": lambda f: f.symlink_to("/dev/zero"), "fifo": os.mkfifo, "dir": os.mkdir}[kind](copy / name)
    return copy


KINDS = {"zero": "is a character device (a link to /dev/zero), not a regular file", "fifo": "is a FIFO (named pipe), "
         "not a regular file", "dir": "is a directory, not a regular file"}


def _train(model, checkpoint, *extra):
    return ["train", f"model.hf_path={model}", "data.task=chat", f"data.path={checkpoint / 'chat.jsonl'}",
            f"output_dir={model.parent / 'run'}", "plot=false", "tensorboard=false", *extra]


@pytest.mark.parametrize("name, kind", [("tokenizer_config.json", "zero"), ("tokenizer.json", "zero"),
                                        ("tokenizer.json", "fifo")])
def test_a_tokenizer_file_that_is_a_device_or_pipe_is_refused_before_it_is_read(checkpoint, tmp_path, name, kind):
    """A tokenizer file linked to /dev/zero was read without end (memory 0.3 -> 17 GB in 30 s, until killed); a
    FIFO blocked for ever. Now one line naming the file and what it is, for train, data.tokenizer and generate."""
    model = _with(checkpoint, tmp_path, name, kind)
    said = f"{model / name} {KINDS[kind]}"
    runs = [_train(model, checkpoint, "--dry-run"),
            _train(checkpoint / "model", checkpoint, f"data.tokenizer={model}", "--dry-run"),
            ["generate", "--hf-path", str(checkpoint / "model"), "--tokenizer", str(model), "--prompt", "hi",
             "--max-new-tokens", "2"]]
    refused_in_bounded_child(said, *runs)


def test_generation_config_linked_to_a_device_is_refused_by_train_and_generate(checkpoint, tmp_path):
    """generation_config.json linked to /dev/zero passed ``--dry-run``, a run and ``generate --hf-path`` (skipped
    as missing, by transformers too): its end and padding ids were dropped without a word."""
    model = _with(checkpoint, tmp_path, "generation_config.json", "zero")
    said = f"{model / 'generation_config.json'} {KINDS['zero']}"
    runs = [_train(model, checkpoint, "--dry-run"), _train(model, checkpoint, "train.steps=1", "train.eval_every=0"),
            ["generate", "--hf-path", str(model), "--prompt", "hi", "--max-new-tokens", "2"]]
    refused_in_bounded_child(said, *runs)


@pytest.mark.parametrize("kind", ["fifo", "zero", "dir"])
def test_config_json_that_is_not_a_regular_file_is_named_as_such(checkpoint, tmp_path, kind):
    """config.json as a FIFO or a link to /dev/zero was "config.json not found; ... holds a tokenizer only, no
    model (no config.json)": the wrong fault and the wrong fix."""
    from hybridpar.models.hf.config import read_hf_config

    model = _with(checkpoint, tmp_path, "config.json", kind)
    with pytest.raises(ValueError) as error:
        read_hf_config(model)
    assert one_line(error).startswith(f"{model / 'config.json'} {KINDS[kind]}"), one_line(error)
    assert "not found" not in one_line(error) and "tokenizer only" not in one_line(error)


def test_weights_and_shards_that_are_not_regular_files_are_named_as_such(checkpoint, tmp_path):
    """model.safetensors or a shard the index lists as a FIFO was "not found" (the file is there)."""
    from hybridpar.models.hf.weights import weight_files

    model = _with(checkpoint, tmp_path, "model.safetensors", "fifo")
    with pytest.raises(ValueError) as error:
        weight_files(model, "model.safetensors", "model.safetensors.index.json")
    assert one_line(error).startswith(f"{model / 'model.safetensors'} {KINDS['fifo']}")
    os.unlink(model / "model.safetensors")
    os.mkdir(model / "shards")
    os.mkfifo(model / "shards" / "a.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "shards/a.safetensors"}}))
    with pytest.raises(ValueError) as error:
        weight_files(model, "model.safetensors", "model.safetensors.index.json")
    assert one_line(error).startswith(f"{model / 'shards' / 'a.safetensors'} {KINDS['fifo']}")


def test_an_export_refuses_a_tokenizer_file_it_would_have_skipped(checkpoint, tmp_path):
    """An export copied the tokenizer files that are regular files and skipped a FIFO or device link without a
    word: the exported model had no tokenizer.json."""
    from hybridpar.models.hf.files import copy_tokenizer_files

    model = _with(checkpoint, tmp_path, "tokenizer.json", "fifo")
    with pytest.raises(ValueError) as error:
        copy_tokenizer_files(model, tmp_path / "out")
    assert one_line(error).startswith(f"{model / 'tokenizer.json'} {KINDS['fifo']}")
    assert not (tmp_path / "out").exists()


def test_a_metadata_file_past_its_cap_is_refused_before_it_is_read(checkpoint, tmp_path):
    """A config.json of 64 MiB and more (a data file put there) was read whole and parsed; now its size is
    named before a byte is read. The file here is sparse: nothing is written."""
    from hybridpar.models.hf.config import read_hf_config

    model = tmp_path / "copy"
    shutil.copytree(checkpoint / "model", model)
    with open(model / "config.json", "r+b") as handle:
        handle.truncate(64 * 2**20 + 1)
    with pytest.raises(ValueError) as error:
        read_hf_config(model)
    assert one_line(error).startswith(f"{model / 'config.json'} has 67,108,865 bytes, more than the 67,108,864 bytes")


def test_links_to_regular_files_stay_allowed(checkpoint, tmp_path):
    """Every file a link to the real one (as a Hugging Face cache lays them out): read as before."""
    from hybridpar.data.tokenizers import load_pretrained_tokenizer
    from hybridpar.models.hf.config import read_hf_config

    model = tmp_path / "links"
    model.mkdir()
    for file in (checkpoint / "model").iterdir():
        (model / file.name).symlink_to(file)
    assert read_hf_config(model)["vocab_size"] == 320
    assert load_pretrained_tokenizer(model).encode("hello") == load_pretrained_tokenizer(checkpoint / "model").encode("hello")


def test_a_transformers_export_prints_no_progress_bar(checkpoint, tmp_path, capfd):
    """The export of a transformers model printed transformers' "Writing model shards" bar on stderr (loading
    already held its bars back)."""
    from hybridpar.models.hf.causal_lm import export_causal_lm, load_causal_lm

    model = load_causal_lm(checkpoint / "model", "transformers")
    capfd.readouterr()
    export_causal_lm(model, tmp_path / "out", tokenizer_dir=checkpoint / "model")
    out, err = capfd.readouterr()
    assert "Writing" not in err and "%|" not in err and out + err == "", (out, err)
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()


def test_an_adapter_whose_weights_are_a_pipe_is_named_as_such(tmp_path):
    """Before: a FIFO adapter_model.safetensors was "has adapter_config.json but no adapter_model.safetensors"."""
    from hybridpar.models.hf.lora_export import read_peft_adapter

    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    os.mkfifo(tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"adapter_model.safetensors is a FIFO \(named pipe\), not a regular file"):
        read_peft_adapter(tmp_path)
