"""Round 10 of fault hunting (docs/reliability.md, "Round 10"): each test holds one class of fault."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from tests.train.fault_probes import cli, one_line


def _write_config(path, **fields):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 16, **fields}))
    return path


def test_a_fixed_range_rope_scaling_covers_factor_times_its_original_length():
    from hybridpar.models.hf.positions import rope_position_limit

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    assert rope_position_limit({"max_position_embeddings": 16, "rope_parameters": yarn}) == (64, "yarn")
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}  # stated limit is larger
    assert rope_position_limit({"max_position_embeddings": 131072, "rope_scaling": llama3}) == (131072, "llama3")
    linear = {"rope_type": "linear", "factor": 4.0}  # no original length stated: the stated limit holds
    assert rope_position_limit({"max_position_embeddings": 16, "rope_parameters": linear}) == (16, "linear")
    assert rope_position_limit({"max_position_embeddings": 16, "rope_parameters": {"rope_type": "dynamic"}}) is None


def test_a_pack_past_the_rope_positions_is_warned_in_our_words(tmp_path):
    from hybridpar.config import config_from_dict
    from hybridpar.train.hf_model import pack_position_note

    def note(pack_size, **fields):
        path = _write_config(tmp_path / str(len(fields)), **fields)
        return pack_position_note(config_from_dict({"model": {"hf_path": str(path)}, "data": {"pack_size": pack_size}}))

    message = note(64)
    assert "data.pack_size=64: a packed row needs 64 positions, past the model's max_position_embeddings=16" in message
    assert "use a data.pack_size <= 16" in message
    assert note(16) is None
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    assert note(64, rope_parameters=yarn) is None and "past the 64 its RoPE 'yarn' scaling covers" in note(66, rope_parameters=yarn)
    assert note(10**6, rope_parameters={"rope_type": "dynamic", "factor": 2.0}) is None


def test_a_transformers_hybrids_generation_memory_counts_its_attention_layers():
    from transformers import BambaConfig, BambaForCausalLM

    from hybridpar.models.generation import transformers_generation_bytes

    with torch.device("meta"):
        model = BambaForCausalLM(BambaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                             num_attention_heads=2, num_key_value_heads=2, attn_layer_indices=[1, 3],
                                             mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1))
    total = 10 + 10**6
    assert transformers_generation_bytes(model, 1, 10, 10**6) >= 2 * total * (32 + 32) * 4  # 2 layers' K and V
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):  # a fused c_attn: no k_proj to read, every layer counted from the config
        gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64))
    assert transformers_generation_bytes(gpt2, 1, 10, 10**6) >= 2 * total * (32 + 32) * 4


def test_a_plan_fit_at_or_below_the_baseline_is_refused():
    code, output = cli("plan", "--fit", "0.5")
    assert code == 2 and "--fit 0.5 is invalid: it must be more than the 1.00 GiB every rank holds" in output, output


def test_a_dataset_file_with_no_rows_is_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridpar.data.hf_datasets import hf_dataset_documents
    from hybridpar.data.tokenizers import ByteTokenizer

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    (tmp_path / "header.csv").write_text("text\n")
    for name in ("empty.parquet", "header.csv"):
        with pytest.raises(ValueError) as error:
            hf_dataset_documents(tmp_path / name, ByteTokenizer())
        assert f"dataset {tmp_path / name} holds no rows" in one_line(error)


def test_a_resume_path_of_another_kind_is_named_as_such(tmp_path):
    from hybridpar.config import config_from_dict
    from hybridpar.train.run.resume import plan_resume

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    for resume, said in ((run, "it is a run's output_dir, not one checkpoint"),
                         (run / "checkpoints", "it is a run's checkpoints folder, not one checkpoint"),
                         (tmp_path / "other", "it holds no hybridpar checkpoint")):
        config = config_from_dict({"checkpoint": {"resume": str(resume)}, "output_dir": str(tmp_path / "out")})
        with pytest.raises(ValueError) as error:
            plan_resume(config)
        message = one_line(error)
        assert said in message and "did not finish" not in message, message


def test_a_resume_with_another_peft_layout_is_refused_before_any_process(tmp_path):
    from hybridpar.config import config_from_dict
    from hybridpar.train.run.resume import _check_peft

    lora = {"method": "lora", "r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": None, "target_parameters": None}
    for recorded, now, said in ((lora, {"method": "none"}, "is from a LoRA run, but this run has peft.method=none"),
                                ({**lora, "method": "none"}, {"method": "lora"}, "is from a full fine-tune"),
                                (lora, {"method": "lora", "r": 4}, "peft.r 8 -> 4")):
        with pytest.raises(ValueError) as error:
            _check_peft(tmp_path, {"config": {"peft": recorded}}, config_from_dict({"peft": now}))
        assert said in one_line(error)
    _check_peft(tmp_path, {"config": {"peft": lora}}, config_from_dict({"peft": {"method": "lora", "dropout": 0.1}}))


def test_api_inputs_of_the_wrong_kind_are_one_line():
    from hybridpar.data.packing import pack_documents
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.models.lora import add_lora

    for fields, said in ((dict(hidden_size="64"), "hidden_size='64' must be a positive integer (a number, not a string)"),
                         (dict(num_key_value_heads=0), "num_key_value_heads=0 must be a positive integer"),
                         (dict(mamba_n_groups=0), "mamba_n_groups=0 must be a positive integer")):
        with pytest.raises(ValueError) as error:
            HybridConfig(**fields)
        assert said in one_line(error)
    model = HybridLM(HybridConfig.from_preset("tiny"))
    for settings, said in ((dict(alpha=-1.0), "peft.alpha=-1.0 is invalid"), (dict(alpha=float("nan")), "peft.alpha=nan"),
                           (dict(targets="q_proj"), "peft.target_modules='q_proj' is a string")):
        with pytest.raises(ValueError) as error:
            add_lora(model, r=4, **settings)
        assert said in one_line(error)
    for doc, said in (("abc", "a document is token ids, not text"), ([1.5, 2, 3], "token ids are float32, not integers"),
                      ([1, -2, 3], "the negative token id -2")):
        with pytest.raises(ValueError) as error:
            pack_documents([doc], 8)
        assert said in one_line(error)
    assert pack_documents([[1, 2, 3]], 8)[0]["input_ids"].tolist()[:3] == [1, 2, 3]


def test_omp_num_threads_far_above_the_cores_is_refused(monkeypatch):
    from hybridpar.config import ConfigError
    from hybridpar.environment import check_environment

    for value in ("100000", "4," + "9" * 50):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        with pytest.raises(ConfigError) as error:
            check_environment()
        assert "asks for more threads than a process here can use" in one_line(error)
    monkeypatch.setenv("OMP_NUM_THREADS", "16")  # oversubscribed a little: allowed
    check_environment()


def test_a_long_value_of_a_key_that_is_no_path_is_not_called_a_path():
    from hybridpar.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as error:
        config_from_dict({"model": {"preset": "x" * 300}})
    message = one_line(error)
    assert "must be one of" in message and "cannot look it up" not in message and "(300 characters)" in message


def test_auto_reading_bytes_for_a_large_vocabulary_is_warned(tmp_path):
    from hybridpar.config_rules import Notice
    from hybridpar.data.tokenizers import ByteTokenizer, resolve_tokenizer

    for vocab, warned in ((4000, True), (300, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert isinstance(resolve_tokenizer("auto", model_path=tmp_path, vocab_size=vocab), ByteTokenizer)
        said = [str(w.message) for w in caught if issubclass(w.category, Notice)]
        assert bool(said) == warned and all("ships no tokenizer" in s and "4,000 ids" in s for s in said), said


def test_a_number_in_quotes_is_told_to_lose_its_quotes(tmp_path):
    from hybridpar.config import ConfigError, load_config

    for text, said in (('train:\n  steps: "5"\n', "write it without them, train.steps=5"),
                       ("parallel:\n  tf32: 'false'\n", "write it without them, parallel.tf32=false")):
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(ConfigError) as error:
            load_config(tmp_path / "c.yaml")
        assert said in one_line(error)
    with pytest.raises(ConfigError) as error:
        load_config(None, ["train.steps=abc"])
    assert "without them" not in one_line(error)


def test_a_check_tolerance_that_would_pass_any_layout_is_refused():
    code, output = cli("check", "--tolerance", "1e300", "--dry-run")
    assert code == 2 and "--tolerance 1e+300 is invalid: it must be at most 1" in output, output


def test_eval_packs_far_beyond_the_held_out_documents_is_said(tmp_path):
    from hybridpar.config import DataConfig
    from hybridpar.data.tokenizers import ByteTokenizer
    from hybridpar.train.batches import PackStream, eval_repeat_note

    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(8)))

    def stream(packs):
        data = DataConfig(task="jsonl", path=str(tmp_path / "d.jsonl"), pack_size=64, packs_per_step=packs)
        return PackStream(data, 1, 256, tokenizer=ByteTokenizer())

    assert "train.eval_packs=1000 asks for 1000 packs per evaluation, but the held-out documents fill 2" in \
        eval_repeat_note(stream(1000))
    assert eval_repeat_note(stream(8)) is None  # the default is never said


def test_a_resume_into_another_kind_of_model_names_both_not_every_field(tmp_path):
    from hybridpar.config import RunConfig
    from hybridpar.train.run.resume import _check_compatible

    hybrid = {"hidden_size": 64, "pattern": "M*-M-", "vocab_size": 256, "dtype": "float32"}
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "id2label": {"0": "LABEL_0"}, "dtype": "float32"}
    with pytest.raises(ValueError) as error:
        _check_compatible(tmp_path, {"model": hybrid}, RunConfig(), llama, 1)
    message = one_line(error)
    assert "a HybridLM -> LlamaForCausalLM (transformers), 5 fields differ" in message and "id2label" not in message


def test_an_export_to_a_file_is_refused_not_skipped(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridpar.models.hf.causal_lm import export_causal_lm
    from hybridpar.models.hf.checkpoint import save_hf
    from hybridpar.models.hybrid import HybridConfig, HybridLM

    target = tmp_path / "model.bin"
    target.write_text("keep")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=1))
    for export in (lambda: export_causal_lm(model, target),  # transformers logged it and wrote nothing
                   lambda: save_hf(HybridLM(HybridConfig.from_preset("tiny")), target, architecture="BambaForCausalLM")):
        with pytest.raises(ValueError) as error:
            export()
        assert "is a file, not a directory" in one_line(error)
    assert target.read_text() == "keep"
