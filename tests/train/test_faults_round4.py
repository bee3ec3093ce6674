"""Faults, round 4: cases found by probing bad inputs after round 3, one test per class."""

import json
import re
import subprocess
import sys

import pytest

from hybridpar.config import load_config
from hybridpar.train.run.checkpoint import CheckpointError
from hybridpar.train.run.resume import plan_resume
from tests.train.fault_probes import cli_in_child, limited_file_size
from tests.train.test_faults_round3 import DEFAULT, ROOT, TINY


@pytest.mark.parametrize("damage", ["shard_missing", "manifest_not_json", "manifest_a_list"])
def test_an_earlier_run_whose_every_checkpoint_is_damaged_says_so(tmp_path, damage):
    """checkpoint.resume=auto skips a damaged checkpoint; when none is left, the refusal to overwrite
    the earlier run said "resume it with checkpoint.resume=auto" (what the user had done) and
    dropped the reason. It now names the newest checkpoint and what is wrong with it."""
    step = tmp_path / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    manifest = {"shard_missing": json.dumps({"format": 2, "files": {"__0_0.distcp": 10}, "sha256": {"__0_0.distcp": "0"}}),
                "manifest_not_json": "{oops", "manifest_a_list": "[1, 2]"}[damage]
    (step / "manifest.json").write_text(manifest)
    config = load_config(DEFAULT, [*TINY, f"output_dir={tmp_path}", "checkpoint.resume=auto"])
    with pytest.raises(CheckpointError) as error:
        plan_resume(config)
    message = str(error.value)
    assert message.startswith(f"output_dir '{tmp_path}' holds an earlier run, but none of its 1 checkpoint(s) can be "
                              f"resumed (newest: {step}: "), message
    assert "checkpoint.if_exists=overwrite" in message and "\n" not in message and len(message) < 800
    assert "resume it with checkpoint.resume=auto" not in message
    fresh = plan_resume(load_config(DEFAULT, [*TINY, f"output_dir={tmp_path}", "checkpoint.if_exists=overwrite"]))
    assert fresh.checkpoint is None and str(step) in " ".join(fresh.remove)


@pytest.mark.parametrize("what", ["checkpoint", "export"])
def test_an_output_that_cannot_be_written_stops_the_run_in_one_line_saying_what_is_intact(tmp_path, what):
    """A checkpoint or export that fails to write (here: a file-size limit, as a full disk fails it)
    was a DCP or safetensors traceback ("unexpected pos 704 vs 598"), and a failed export lost the
    trained weights without a word; at two ranks the launcher named the rank it had stopped. Now:
    exit 1, one line naming the step or path, the cause and the free space, and what is intact; no
    staging folder is left behind. The two-rank case is a real launch (a subprocess); the one-process
    export runs the command line in a harness child under the same limit."""
    run = ["train", "--config", DEFAULT, *TINY, "data.task_options={}", f"output_dir={tmp_path / 'run'}",
           "train.steps=2", "model.overrides={rotary_fraction: 0.0}"]
    if what == "checkpoint":  # two ranks: one reports, the launcher stops the other (that SIGTERM was named instead)
        run = ["train", "--nproc-per-node", "2", *run[1:], "parallel.cp=2"]
    if what == "export":
        run += ["checkpoint.every=-1", f"model.export_hf={tmp_path / 'export'}",
                "model.export_architecture=NemotronHForCausalLM"]
    if what == "checkpoint":
        result = subprocess.run([sys.executable, "-m", "hybridpar", *run], capture_output=True, text=True, timeout=240,
                                cwd=ROOT, preexec_fn=limited_file_size(200_000))
    else:
        result = cli_in_child(*run, file_size_limit=200_000)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("hybridpar: error")]
    assert len(errors) == 1 and "Traceback" not in result.stderr and len(errors[0]) < 800, result.stderr[-3000:]
    assert "MiB free there" in errors[0], errors[0]  # the cause: EFBIG, or torch.save's "unexpected pos"
    if what == "checkpoint":
        assert "saving the checkpoint of step 2 in" in errors[0] and "(none) is intact" in errors[0], errors[0]
        assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp"))
    else:
        assert f"model.export_hf='{tmp_path / 'export'}' could not be written" in errors[0], errors[0]
        assert "no checkpoint holds the trained weights (checkpoint.every=-1)" in errors[0], errors[0]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging folder left


def test_any_other_refused_write_is_one_line_and_exit_1(tmp_path):
    """metrics.jsonl (here) or any other file the system refuses to grow: one line, no traceback."""
    run = ["train", "--config", DEFAULT, *TINY, "data.task_options={}", f"output_dir={tmp_path / 'run'}",
           "train.steps=3", "train.log_every=1", "checkpoint.every=-1"]
    result = cli_in_child(*run, file_size_limit=300)  # one process: the command line in a harness child
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == ("hybridpar: error: writing failed (File too large); the run "
                                                      "stopped. Free space, then resume with checkpoint.resume=auto.")


def _leaf_keys(cls, prefix=""):
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            yield from _leaf_keys(hints[field.name], f"{prefix}{field.name}.")
        else:
            yield prefix + field.name, hints[field.name]


def test_a_value_of_the_wrong_type_is_told_the_type_its_key_takes():
    """``peft.target_modules=lm_head`` said "it must be a list of 2 numbers": the text of
    ``train.betas``' type. Every key given a value of a type it does not take names its own."""
    import types
    import typing

    from hybridpar.config import ConfigError, RunConfig

    checked = 0
    for key, hint in _leaf_keys(RunConfig):
        union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        options = typing.get_args(hint) if union else (hint,)
        if any((typing.get_origin(o) or o) in (dict, str) for o in options):
            continue  # a mapping or a string takes the probe value below
        with pytest.raises(ConfigError) as error:
            load_config(DEFAULT, [f"{key}=somename"])
        message = str(error.value)
        assert message.startswith(f"{key}='somename' is invalid: it must be ") and "(got str)" in message, message
        lists = [typing.get_args(o) for o in options if typing.get_origin(o) is tuple]
        if lists and Ellipsis in lists[0]:
            assert "a list of strings" in message, message
        elif lists:
            assert f"a list of {len(lists[0])} numbers" in message, message
        else:
            assert "list" not in message.split("(got")[0], message
        checked += 1
    assert checked > 30


def test_positions_past_a_learned_position_table_are_refused_before_step_1(tmp_path):
    """GPT-2 and OPT learn one embedding per position; a pack longer than the table (a row's
    positions reach pack_size - 1) or a prompt plus new tokens past it was an IndexError traceback
    in the first step or in generate. RoPE models have no table and no such limit."""
    import torch
    import transformers as hf

    from hybridpar.config import ConfigError
    from hybridpar.models.hf.causal_lm import generate_causal_lm
    from hybridpar.models.hf.positions import learned_positions
    from hybridpar.train.hf_model import build_hf_model

    models = {"gpt2": hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=260, n_positions=64)),
              "opt": hf.OPTForCausalLM(hf.OPTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                    ffn_dim=64, vocab_size=260, max_position_embeddings=64,
                                                    word_embed_proj_dim=32)),
              "llama": hf.LlamaForCausalLM(hf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                          num_attention_heads=4, vocab_size=260,
                                                          max_position_embeddings=64))}
    tables = {"gpt2": ("transformer.wpe", 64), "opt": ("model.decoder.embed_positions", 64), "llama": None}
    for name, model in models.items():
        assert learned_positions(model) == tables[name], name
        model.save_pretrained(tmp_path / name)
        config = load_config(DEFAULT, [*TINY, f"model.hf_path={tmp_path / name}", "data.pack_size=128"])
        if tables[name] is None:
            build_hf_model(config, torch.float32)
            continue
        with pytest.raises(ConfigError, match=rf"data.pack_size=128 is longer than the 64 positions .* learned "
                                              rf"\({tables[name][0]}\).*Use data.pack_size <= 64"):
            build_hf_model(config, torch.float32)
        with pytest.raises(ValueError, match=r"the prompt \(60 tokens\) plus --max-new-tokens 5 needs 65 positions"):
            generate_causal_lm(model, torch.zeros(1, 60, dtype=torch.long), 5)
        assert generate_causal_lm(model, torch.zeros(1, 60, dtype=torch.long), 4).shape[-1] <= 64


def test_a_lora_resume_with_other_adapters_is_refused_naming_both(tmp_path):
    """A LoRA checkpoint loads non-strictly (the frozen base is not in it), so resuming with other
    peft.target_modules dropped the adapters of the other modules without a word, and another
    peft.alpha changed the model's function: both resumed silently. Now refused, naming both."""
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.models.lora import add_lora
    from hybridpar.train.run.adapters import adapter_layout, check_same_base

    def layout(**settings):
        model = HybridLM(HybridConfig.from_preset("tiny"))
        add_lora(model, **settings)
        return adapter_layout(model)

    base = {"path": "preset tiny (seed 0)", "sha256": "0" * 64}
    saved = layout(r=8, alpha=16.0)
    (tmp_path / "run.json").write_text(json.dumps({"step": 2, "lora_base": {**base, "adapters": saved}}))
    check_same_base(tmp_path, {**base, "adapters": layout(r=8, alpha=16.0)})
    assert adapter_layout(HybridLM(HybridConfig.from_preset("tiny"))) is None
    for changed, shown in ((dict(r=4, alpha=16.0), "r=4, alpha=16 on 12 modules"),
                           (dict(r=8, alpha=32.0), "r=8, alpha=32 on 12 modules"),
                           (dict(r=8, alpha=16.0, targets=("q_proj",)), "r=8, alpha=16 on 1 modules (q_proj)")):
        with pytest.raises(CheckpointError, match=rf"holds adapters with r=8, alpha=16 on 12 modules \(down_proj, .*\), "
                                                  rf"but this run builds {re.escape(shown)}"):
            check_same_base(tmp_path, {**base, "adapters": layout(**changed)})


@pytest.mark.parametrize("template, error", [("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
                                             ('{{ raise_exception("only user turns") }}', "TemplateError: only user turns")])
def test_a_chat_template_that_fails_is_one_line_naming_the_record(tmp_path, template, error):
    """A chat template with a syntax error, or one that raises on the conversation, was a jinja2 traceback."""
    from hybridpar.data.chat import chat_documents
    from hybridpar.data.tokenizers import load_pretrained_tokenizer
    from tests.data.bpe import train_tiny_bpe

    train_tiny_bpe(tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").write_text(template)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": "hello"}]}) + "\n")
    with pytest.raises(ValueError) as raised:
        chat_documents([tmp_path / "chat.jsonl"], load_pretrained_tokenizer(tmp_path / "tok"))
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'chat.jsonl'}:1: the chat template of tokenizer ") and error in message
    assert "\n" not in message and len(message) < 600


def test_a_warmup_longer_than_the_run_is_said(tmp_path, capsys):
    """train.warmup_steps > train.steps ran without a word, its learning rate never reaching train.lr."""
    from hybridpar.train.preflight import validate_run

    validate_run(load_config(DEFAULT, [*TINY, f"output_dir={tmp_path}", "train.steps=2", "train.warmup_steps=10",
                                       "train.lr=0.003"]), "train")
    assert ("train.warmup_steps=10 is more than train.steps=2: the learning rate rises for the whole run and ends at "
            "0.0006, below train.lr=0.003") in capsys.readouterr().err
    validate_run(load_config(DEFAULT, [*TINY, f"output_dir={tmp_path}", "train.steps=20", "train.warmup_steps=10"]),
                 "train")
    assert "warmup_steps" not in capsys.readouterr().err
