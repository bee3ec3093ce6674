"""Round 14 of fault hunting (docs/reliability.md, "Round 14"): a model field changed at resume, a training
checkpoint whose ``model.hf_path`` base moved, an empty ``--config``. Runs train in harness children; the dry
runs and generate run in this process."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.train.fault_probes import cli, cli_in_child, cli_streams

TINY = ["--config", "configs/tiny-hybrid.yaml", "model.preset=tiny", "parallel.cp=1", "parallel.tp=1",
        "data.pack_size=64", "train.steps=2", "train.eval_every=0", "train.warmup_steps=0", "plot=false",
        "tensorboard=false"]


@pytest.mark.parametrize("text, said", [("", "0 bytes"), ("# train:\n#   steps: 5\n\n", "only comments or blank lines")])
def test_an_empty_config_file_is_refused(tmp_path, text, said):
    """An empty (or comments-only) ``--config`` ran on the defaults without a word: a truncated or wrong file."""
    (tmp_path / "run.yaml").write_text(text)
    code, output = cli("train", "--config", str(tmp_path / "run.yaml"), "--dry-run")
    assert code == 2 and f"config file '{tmp_path}/run.yaml' is empty (no sections, {said}); put the run's sections" \
        in output and len(output.strip().splitlines()) == 1, output
    (tmp_path / "run.yaml").write_text("{}\n")  # an explicit empty mapping is a choice: the defaults
    assert cli("train", "--config", str(tmp_path / "run.yaml"), f"output_dir={tmp_path / 'out'}", "--dry-run")[0] == 0


def test_a_resume_that_changes_chunk_size_warns_and_continues(tmp_path):
    """``model.overrides={chunk_size: 8}`` at resume was "another model shape ... would load only part of it",
    though every parameter is the same: the checkpoint loads whole and only the rounding changes."""
    run = [*TINY, f"output_dir={tmp_path}", "checkpoint.every=2"]
    assert cli_in_child("train", *run).returncode == 0
    resumed = cli_in_child("train", *run, "train.steps=3", "model.overrides={chunk_size: 8}")
    assert resumed.returncode == 0, resumed.stderr
    assert ("was trained with model.chunk_size=16; resuming with 8 loads every parameter, but the model rounds "
            "otherwise (the same function, summed in other chunks)") in resumed.stderr, resumed.stderr
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3
    refused = cli_in_child("train", *run, "train.steps=3", "model.overrides={conv_kernel: 3}")
    assert refused.returncode == 2 and "another model shape (chunk_size 8 -> 16; conv_kernel 4 -> 3;" in refused.stderr, refused.stderr


def _tiny_llama(folder, theta: float = 10000.0) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": theta})
    LlamaForCausalLM(config).save_pretrained(folder)


def test_generate_from_a_checkpoint_whose_base_moved_takes_base(tmp_path):
    """``generate --checkpoint`` of a ``model.hf_path`` run whose base folder moved said "model.hf_path ... is not a
    directory", a key generate cannot set. ``--base DIR`` now says where it is, and must hold the recorded model."""
    base, run = tmp_path / "base", tmp_path / "run"
    _tiny_llama(base)
    assert cli_in_child("train", *TINY, f"model.hf_path={base}", f"output_dir={run}").returncode == 0
    ask = ["generate", "--checkpoint", str(run), "--prompt", "k", "--max-new-tokens", "4", "--json"]
    code, before, err = cli_streams(*ask)
    assert code == 0, err
    base.rename(tmp_path / "moved")
    code, output = cli(*ask)
    assert code == 2 and (f"the run's model.hf_path '{base}' (recorded in {run}/checkpoints/step_00000002/run.json) "
                          "is gone (moved or deleted); pass --base DIR") in output, output
    code, after, err = cli_streams(*ask, "--base", str(tmp_path / "moved"))
    assert code == 0 and json.loads(after) == json.loads(before), err
    _tiny_llama(tmp_path / "other", theta=500000.0)  # same parameters, another function: refused
    code, output = cli(*ask, "--base", str(tmp_path / "other"))
    assert code == 2 and f"--base '{tmp_path}/other' holds another model than checkpoint" in output \
        and "rope_parameters" in output, output
    code, output = cli("generate", "--hf-path", str(tmp_path / "moved"), "--base", str(base), "--prompt", "k",
                       "--max-new-tokens", "2", "--dry-run")
    assert code == 2 and "--base is not used without --checkpoint" in output, output
    shutil.rmtree(tmp_path / "other")


def test_peft_merge_without_an_export_is_said_to_be_unused():
    """``peft.merge=true`` without ``model.export_hf`` changed nothing, without a word."""
    from hybridpar.config import load_config
    from hybridpar.train.unused_keys import unused_key_notices

    notes = unused_key_notices(load_config(None, ["peft.method=lora", "peft.merge=true"]))
    assert notes == ["peft.merge=true is not used: it chooses how model.export_hf writes the adapters, and nothing is "
                     "exported without model.export_hf (set it to a new directory)"], notes
    assert unused_key_notices(load_config(None, ["peft.method=lora", "peft.merge=true", "model.export_hf=/tmp/x"])) == []
