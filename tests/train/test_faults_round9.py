"""Round 9 of fault hunting (docs/reliability.md, "Round 9"): each test holds one class of fault."""

from __future__ import annotations

import json

import pytest
import torch

from tests.train.fault_probes import cli, one_line


def _llama(path, **fields):
    """A tiny Llama checkpoint saved by transformers (RoPE, 16 positions, vocab 300)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                         bos_token_id=1, eos_token_id=2, **fields)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _edit_config(path, **fields):
    file = path / "config.json"
    config = json.loads(file.read_text())
    config.update(fields)
    file.write_text(json.dumps(config))
    (path / "generation_config.json").unlink(missing_ok=True)  # transformers then takes the ids from config.json


def test_rope_past_max_positions_is_said_in_our_words_and_not_for_dynamic_scaling(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridpar.models.hf.positions import position_note

    code, output = cli("generate", "--hf-path", str(_llama(tmp_path / "m")), "--prompt", "hello world",
                       "--max-new-tokens", "8", "--tokenizer", "bytes")
    assert code == 0, output
    assert "need 19 positions, past the model's max_position_embeddings=16" in output, output
    assert "friendly reminder" not in output and "[transformers]" not in output, output
    small = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                 max_position_embeddings=16)
    with torch.device("meta"):
        plain = LlamaForCausalLM(LlamaConfig(**small))
        dynamic = LlamaForCausalLM(LlamaConfig(**small, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert position_note(plain, 16) is None and "past" in position_note(plain, 17)
    assert position_note(dynamic, 64) is None  # dynamic NTK stretches RoPE by design


def test_a_hybrid_generation_larger_than_memory_is_refused_before_it_starts():
    from hybridpar.models.generation import check_generation_memory, generation_bytes
    from hybridpar.models.hybrid import HybridConfig, HybridLM

    model = HybridLM(HybridConfig.from_preset("tiny"))
    assert generation_bytes(model, 1, 10_000, 10) > generation_bytes(model, 1, 100, 10)  # the prompt's logits
    with pytest.raises(ValueError) as error:
        check_generation_memory(model, 1, 5, 2**31 - 1, free=2**30)
    message = one_line(error)
    assert "generating 2147483647 tokens after a 5-token prompt needs about" in message and "ask for at most" in message
    with pytest.raises(ValueError) as error:
        check_generation_memory(model, 1, 10**7, 1, free=2**30)
    assert "shorten the prompt" in one_line(error)
    check_generation_memory(model, 1, 5, 64, free=2**30)  # a small request passes


def test_config_vocab_size_below_one_is_one_line(tmp_path):
    from hybridpar.models.hf.config import read_hf_config

    path = _llama(tmp_path / "m")
    for bad in (0, -5, "300", 2.5):
        _edit_config(path, vocab_size=bad)
        with pytest.raises(ValueError) as error:
            read_hf_config(path)
        assert f"vocab_size={json.dumps(bad) if isinstance(bad, str) else bad}".replace('"', "'") in one_line(error)


def test_config_token_ids_outside_the_vocabulary_are_said_once_in_our_words(tmp_path):
    from hybridpar.models.hf.generation_config import generation_id_problem

    path = _llama(tmp_path / "m")
    _edit_config(path, bos_token_id=5000, eos_token_id=-3)
    assert "eos_token_id=-3 must be an integer in [0, 300)" in generation_id_problem(path)
    code, output = cli("generate", "--hf-path", str(path), "--prompt", "hi", "--max-new-tokens", "2",
                       "--tokenizer", "bytes")
    assert code == 0 and "hybridpar: warning:" in output and "generation runs to --max-new-tokens" in output, output
    assert "[transformers]" not in output and "positive integers" not in output, output
    _edit_config(path, bos_token_id=1, eos_token_id=2)
    assert generation_id_problem(path) is None


def test_byte_ids_past_the_byte_range_decode_as_replacement_characters():
    from hybridpar.data.tokenizers import ByteTokenizer

    tokenizer = ByteTokenizer()
    assert tokenizer.decode([104, 105, 299, 33]) == "hi\ufffd!"
    assert tokenizer.decode([0xC3, 0xA9, 256]) == "é\ufffd"
    assert tokenizer.decode([3, 104]) == "h"  # specials still skipped


def test_a_compound_rule_names_the_part_that_is_wrong():
    from hybridpar.config import ConfigError, config_from_dict

    for sample, part in (({"prompt": ""}, "prompt must be a non-empty string"), ({"prompt": "a", "top_p": 0},
                                                                                  "top_p must be in (0, 1]")):
        with pytest.raises(ConfigError) as error:
            config_from_dict({"train": {"sample": sample}})
        assert f"this one: {part}" in one_line(error)


def test_a_generate_prompt_the_tokenizer_refuses_names_the_prompt_not_the_api():
    from hybridpar.data.tokenizers import ByteTokenizer
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.train.sample import continue_prompt

    with pytest.raises(ValueError) as error:
        continue_prompt(HybridLM(HybridConfig.from_preset("tiny")), ByteTokenizer(), "a\x02b", 2)
    message = one_line(error)
    assert "the prompt 'a\\x02b' cannot be encoded by tokenizer bytes" in message and "errors='drop'" not in message


def test_an_adapter_folder_with_a_bad_rank_or_no_weights_is_one_line(tmp_path):
    from hybridpar.models.hf.lora_export import read_peft_adapter

    fields = {"base_model_name_or_path": str(tmp_path), "peft_type": "LORA", "r": 4, "lora_alpha": 8}
    for change, expected in (({"r": 0}, "r=0 must be an integer >= 1"), ({"lora_alpha": None}, "lora_alpha=None must"),
                             ({}, "but no adapter_model.safetensors")):
        (tmp_path / "adapter_config.json").write_text(json.dumps({**fields, **change}))
        with pytest.raises(ValueError) as error:
            read_peft_adapter(tmp_path)
        assert expected in one_line(error)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError) as error:
        read_peft_adapter(tmp_path)
    assert "is damaged or truncated" in one_line(error)


RESTORE = {"num_hidden_layers": 1, "head_dim": 8, "max_position_embeddings": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def test_a_zero_size_or_rope_base_in_config_json_is_one_line_not_a_crash_or_nan(tmp_path):
    from hybridpar.models.hf.config import read_hf_config

    path = _llama(tmp_path / "m")
    for field, value, rule in (("num_hidden_layers", 0, "an integer >= 1"), ("head_dim", 0, "an integer >= 1"),
                               ("max_position_embeddings", -1, "an integer >= 1"), ("rope_theta", 0, "> 0"),
                               ("rms_norm_eps", float("nan"), "> 0")):
        _edit_config(path, **{field: value})
        with pytest.raises(ValueError) as error:
            read_hf_config(path)
        message = one_line(error)
        assert f"{field}=" in message and rule in message, message
        _edit_config(path, **{field: RESTORE[field]})
    read_hf_config(path)  # restored: fine
    _edit_config(path, n_groups=0)  # a Mamba count (transformers' mixer divided by it)
    with pytest.raises(ValueError) as error:
        read_hf_config(path)
    assert "n_groups=0 must be an integer >= 1" in one_line(error)


def test_a_transformers_generation_larger_than_memory_is_refused_too():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridpar.models.generation import check_generation_memory, transformers_generation_bytes

    small = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_attention_heads=1)
    with torch.device("meta"):
        one, four = (LlamaForCausalLM(LlamaConfig(**small, num_hidden_layers=n)) for n in (1, 4))
    assert transformers_generation_bytes(four, 1, 10, 10**6) > transformers_generation_bytes(one, 1, 10, 10**6)
    with pytest.raises(ValueError) as error:
        check_generation_memory(one, 1, 5, 2**31 - 1, free=2**30, estimate=transformers_generation_bytes)
    assert "ask for at most" in one_line(error)


@pytest.mark.parametrize("value", ["loud", "ERROR", ""])
def test_a_transformers_log_level_it_does_not_know_is_one_line(value, monkeypatch):
    from hybridpar.config import ConfigError
    from hybridpar.environment import check_environment

    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", value)
    with pytest.raises(ConfigError) as error:
        check_environment()
    assert f"TRANSFORMERS_VERBOSITY='{value}' is not a transformers log level" in one_line(error)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    check_environment()
