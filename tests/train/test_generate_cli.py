"""``hybridpar generate``: the command's greedy tokens against transformers' own ``generate``.

Exported Mamba2 and NemotronH checkpoints (the shapes of ``tests/models/test_generation.py``,
which keep dt inside ``time_step_limit``: transformers 5.23's decode step drops the dt clamp its
full forward applies, so only there do the two agree) generate, through the command, the tokens
transformers generates on the same checkpoint. A training checkpoint (``--checkpoint``) generates
what its run's export does.
"""

import contextlib
import io
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from hybridpar.models.hybrid import HybridConfig, HybridLM
from hybridpar.models.hf.checkpoint import save_hf
from tests.distributed.harness import run_ranks
from tests.models.test_generation import HF_SHAPES, NEW_TOKENS

PROMPT = "hello wor"


def generate(*args: str) -> tuple[int, str]:
    from hybridpar.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["generate", *args])
    return code, out.getvalue() + err.getvalue()


@pytest.mark.parametrize("architecture", sorted(HF_SHAPES))
def test_generate_equals_transformers_generate_on_the_exported_checkpoint(architecture, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny", dtype=torch.float64, chunk_size=4, **HF_SHAPES[architecture]))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
        model.lm_head.weight.mul_(20.0)  # sharp logits: no near ties for greedy to break differently
    save_hf(model, tmp_path, architecture=architecture)

    code, output = generate("--hf-path", str(tmp_path), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--json")
    assert code == 0, output
    ours = json.loads(output.strip().splitlines()[-1])
    assert ours["prompt_ids"] == list(PROMPT.encode())  # bytes (no tokenizer shipped), no end token
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, local_files_only=True).eval()
    expected = theirs.generate(torch.tensor([ours["prompt_ids"]]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=3, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours["new_ids"] == expected and len(expected) > 8


def _train(rank, world_size, argv):
    from hybridpar.cli import main

    return main(argv)


def test_generate_from_a_training_checkpoint_equals_its_export(tmp_path):
    run = ["train", "--config", str(Path(__file__).resolve().parents[2] / "configs" / "tiny-hybrid.yaml"),
           "model.preset=tiny", "data.pack_size=256", "model.overrides={rotary_fraction: 0.0}", "parallel.cp=1",
           "parallel.tp=1", "parallel.sequence_parallel=false", "train.steps=2", "train.eval_every=0", "checkpoint.every=2",
           f"output_dir={tmp_path / 'run'}", f"model.export_hf={tmp_path / 'export'}",
           "model.export_architecture=NemotronHForCausalLM", "tensorboard=false", "plot=false"]
    assert run_ranks(1, _train, run, timeout_s=300) == [0]
    sample = ["--prompt", PROMPT, "--max-new-tokens", "12", "--json", "--temperature", "0.9", "--seed", "3"]
    from_checkpoint = generate("--checkpoint", str(tmp_path / "run"), *sample)
    from_export = generate("--hf-path", str(tmp_path / "export"), *sample)
    assert from_checkpoint[0] == 0 and from_export[0] == 0, from_checkpoint[1] + from_export[1]
    assert json.loads(from_checkpoint[1].splitlines()[-1]) == json.loads(from_export[1].splitlines()[-1])
    code, output = generate("--hf-path", str(tmp_path / "export"), "--prompt", "x")
    assert code == 2 and "needs --max-new-tokens" in output
    code, output = generate("--checkpoint", str(tmp_path), "--prompt", "x", "--max-new-tokens", "2")
    assert code == 2 and "holds no complete training checkpoint" in output
    # A checkpoint whose names or shapes are not its recorded model's (as an older hybridpar's
    # layout-dependent names would be): one line naming DCP's own reason, no traceback.
    from hybridpar.train.run.checkpoint import _write_manifest

    step = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    info = json.loads((step / "run.json").read_text())
    info["config"]["model"]["overrides"]["intermediate_size"] = 40
    (step / "run.json").write_text(json.dumps(info))
    _write_manifest(step)
    code, output = generate("--checkpoint", str(step), "--prompt", "x", "--max-new-tokens", "2")
    errors = [line for line in output.splitlines() if line.startswith("hybridpar: error")]
    assert code == 2 and "Traceback" not in output and len(errors) == 1, output[-3000:]
    assert "could not be loaded (ValueError: Size mismatch" in errors[0] and len(errors[0]) < 600, errors
