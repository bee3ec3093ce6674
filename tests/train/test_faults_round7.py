"""Faults, round 7: inputs that ran to a silently wrong end (a damaged generation_config.json, a
generate call asked for no tokens, documents with nothing to learn, a plan printed as zero), one
test per class, in-process on real files."""

import json
import warnings

import pytest

from pathlib import Path

from tests.train.test_faults_round3 import tiny_hf
from tests.train.fault_probes import cli as _cli, one_line as _one_line

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-hybrid.yaml")


def test_a_generation_config_that_is_not_json_or_names_an_id_outside_the_vocabulary_is_refused(tmp_path):
    """transformers ignored a damaged generation_config.json, and an eos_token_id outside the
    vocabulary never stops generation: both ran to --max-new-tokens without a word. ``generate``
    refuses both; ``train`` refuses the damaged file and says the id in one notice."""
    from hybridpar.models.hf.config import read_hf_config
    from hybridpar.models.hf.generation_config import check_generation_config, generation_id_problem

    model = tiny_hf(tmp_path / "hf")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    read_hf_config(model)  # no generation_config.json: transformers' defaults
    for text, expected in [("{not json", "is not valid JSON at line 1"), ("[1, 2]", "holds a JSON list")]:
        (model / "generation_config.json").write_text(text)
        with pytest.raises(ValueError) as error:
            read_hf_config(model)
        assert expected in _one_line(error) and "generation_config.json" in str(error.value)
    cases = [({"eos_token_id": vocab}, f"eos_token_id={vocab} must be an integer in [0, {vocab})"),
             ({"eos_token_id": [1, 10**6]}, "eos_token_id=[1, 1000000] must be"),
             ({"pad_token_id": -1}, "pad_token_id=-1 must be"), ({"bos_token_id": "1"}, "bos_token_id='1' must be"),
             ({"eos_token_id": True}, "eos_token_id=True must be"), ({"eos_token_id": []}, "eos_token_id=[] must be")]
    for fields, expected in cases:
        (model / "generation_config.json").write_text(json.dumps(fields))
        with pytest.raises(ValueError) as error:
            check_generation_config(model, vocab)
        assert expected in _one_line(error)
        read_hf_config(model)  # training reads the model: the ids are said once, by the preflight
        assert expected in generation_id_problem(model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2], "pad_token_id": None}))
    check_generation_config(model, vocab)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab}))
    code, output = _cli("generate", "--hf-path", str(model), "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2 and "eos_token_id" in output and output.count("\n") == 1, output
    code, output = _cli("train", "--dry-run", "--config", CONFIG, "model.preset=tiny", "parallel.cp=1",
                        f"model.hf_path={model}", f"output_dir={tmp_path / 'run'}")
    assert code == 0 and output.count(f"warning: {model}/generation_config.json: eos_token_id=") == 1, output


def test_generate_with_max_new_tokens_0_is_refused():
    """--max-new-tokens 0 printed the prompt alone, as if it were the model's answer."""
    from argparse import Namespace

    from hybridpar.generate import check_generate_arguments

    args = Namespace(max_new_tokens=0, temperature=0.0, top_p=1.0, seed=None, hf_path="x", checkpoint=None,
                     tokenizer="auto", prompt="hi", backend="auto", dtype=None, json=False)
    with pytest.raises(ValueError) as error:
        check_generate_arguments(args)
    assert _one_line(error).startswith("--max-new-tokens 0 generates nothing") and ">= 1" in str(error.value)
    with pytest.raises(ValueError, match=r"--max-new-tokens -3 must be an integer in \[1, 2\*\*31-1\]"):
        check_generate_arguments(Namespace(**{**vars(args), "max_new_tokens": -3}))
    code, output = _cli("generate", "--hf-path", "nowhere", "--prompt", "hi", "--max-new-tokens", "0")
    assert code == 2 and "--max-new-tokens >= 1" in output


def test_documents_with_nothing_to_learn_are_skipped_with_a_notice_or_refused_when_all_are(tmp_path):
    """{"text": ""}, an empty completion and an assistant turn with empty content trained on special
    tokens only (the model learns to end documents at once), without a word."""
    from hybridpar.data.documents import file_documents
    from tests.data.bpe import train_tiny_bpe

    (tmp_path / "some.jsonl").write_text('{"text": ""}\n{"text": "hello"}\n{"text": ""}\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert file_documents("jsonl", tmp_path / "some.jsonl", None) == [list(b"hello") + [3]]
    assert len(caught) == 1 and "2 of 3 documents" in str(caught[0].message) and "document 1" in str(caught[0].message)

    tokenizer = train_tiny_bpe(tmp_path / "tok")
    files = {"jsonl": '{"text": ""}\n', "prompt_completion": '{"prompt": "q", "completion": ""}\n',
             "chat": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}\n'}
    for task, text in files.items():
        (tmp_path / f"{task}.jsonl").write_text(text * 2)
        with pytest.raises(ValueError) as error:
            file_documents(task, tmp_path / f"{task}.jsonl", tokenizer)
        assert _one_line(error).startswith("every one of the 2 documents of data.path="), task
        assert "special tokens only" in str(error.value)


def test_plan_shows_a_small_model_in_microseconds_and_gigaflops_not_zero():
    """``plan`` on the tiny config printed "0.0 ms per step ... (0.0 TFLOP per rank)"."""
    import re

    code, output = _cli("plan", "--config", CONFIG)
    line = next(line for line in output.splitlines() if line.startswith("time (ESTIMATE"))
    assert code == 0 and " 0.0 " not in line and "(0.0" not in line, line
    assert re.search(r"\d µs per step", line) and re.search(r"\(\d[\d.,]* [GMk]?FLOP per rank[,)]", line), line
    code, output = _cli("plan", "--config", CONFIG, "--fit", "80")
    assert code == 0 and " 0.0 ms/step" not in output and "µs/step" in output, output
    from hybridpar.plan.report import duration, time_and_flops

    assert duration(2.7375) == "2,737.5 ms" and duration(3e-8) == "30.0 ns" and duration(0.0) == "0.0 ms"
    assert time_and_flops(1.0, 1.0197e15)[1] == "1,019.7 TFLOP" and time_and_flops(1.0, 5e3)[1] == "5.0 kFLOP"


def test_a_synthetic_task_option_of_the_wrong_kind_is_refused_naming_it():
    """min_len=16.5 trained silently (a float length), num_kv_pairs=[1, 2, 3] read its first two
    values, vocab_size=true was read as 1 ("leaves -1 distinct keys") and num_kv_pairs='x' was
    Python's "invalid literal for int()"."""
    from hybridpar.config import DataConfig
    from hybridpar.train.batches import DataError, make_task

    cases = {"mqar": [("min_len", 16.5, "an integer;"), ("vocab_size", True, "an integer;"),
                      ("num_kv_pairs", [1, 2, 3], "a range [low, high] of two integers"),
                      ("num_kv_pairs", "x", "a range"), ("num_queries", 1.0, "an integer or null"),
                      ("filler", 1, "a string")],
             "selective_copy": [("max_len", 99.9, "an integer;"), ("num_tokens", [2.0, 4], "a range")]}
    for task, options in cases.items():
        for name, value, rule in options:
            with pytest.raises(DataError) as error:
                make_task(DataConfig(task=task, task_options={name: value}), 256)
            assert _one_line(error).startswith(f"data.task_options.{name}=") and rule in str(error.value), error.value
    make_task(DataConfig(task="mqar", task_options={"num_kv_pairs": [2, 3], "num_queries": None, "min_len": 16,
                                                    "max_len": 48, "vocab_size": 16}), 256)


def test_a_lora_rank_above_a_target_layers_smaller_side_is_refused_before_any_allocation():
    """peft.r=65 on a layer 32 wide trained silently at rank 32 for the memory of 65, and
    peft.r=100000000 was an out-of-memory traceback from the adapter's allocation."""
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.models.lora import add_lora, lora_modules

    for r in (33, 10**8):
        model = HybridLM(HybridConfig.from_preset("tiny"))
        with pytest.raises(ValueError) as error:
            add_lora(model, r=r)
        assert _one_line(error).startswith(f"peft.r={r} is larger than the smaller side of the target layer ")
        assert "use peft.r <= 32" in str(error.value) and not lora_modules(model)
    assert add_lora(HybridLM(HybridConfig.from_preset("tiny")), r=32)
    code, output = _cli("train", "--dry-run", "--config", CONFIG, "model.preset=tiny", "parallel.cp=1",
                        "peft.method=lora", "peft.r=1000", "output_dir=/nonexistent/never-written")
    assert code == 2 and "peft.r=1000 is larger" in output, output


def test_a_sample_prompt_the_tokenizer_refuses_is_found_before_training(tmp_path):
    """train.sample={prompt: "a\\x02b"} (a reserved byte) trained the whole run, saved it, and only then
    failed at the sample."""
    (tmp_path / "t.txt").write_text("hello world\n\nsecond paragraph\n")
    (tmp_path / "s.yaml").write_text('train:\n  sample: {prompt: "a\\x02b", max_new_tokens: 3}\n')
    code, output = _cli("train", "--dry-run", "--config", str(tmp_path / "s.yaml"), "model.preset=tiny", "parallel.cp=1",
                        "data.pack_size=128", "data.task=text", f"data.path={tmp_path / 't.txt'}", "data.task_options={}",
                        f"output_dir={tmp_path / 'run'}")
    assert code == 2 and "train.sample's prompt 'a\\x02b' cannot be encoded" in output, output
    assert not (tmp_path / "run").exists()


def test_model_preset_beside_model_hf_path_is_said_to_be_unused():
    """model.preset=small with model.hf_path trained the checkpoint's model without a word."""
    from hybridpar.config import load_config
    from hybridpar.train.unused_keys import unused_key_notices

    notes = unused_key_notices(load_config(None, ["model.hf_path=/some/model", "model.preset=small"]))
    assert notes == ["model.preset='small' is not used: model.hf_path loads the checkpoint's own config (drop "
                     "model.preset, or model.hf_path to train the preset)"]
    assert unused_key_notices(load_config(None, ["model.hf_path=/some/model"])) == []
