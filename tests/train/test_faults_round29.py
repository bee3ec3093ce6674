"""Round 29: features in combination (docs/reliability.md, "Round 29").

Rounds 1-28 swept the features one at a time; this round swept the seams where two or three meet (activation
checkpointing x every CP strategy x packing, x TP+SP, compile x CP/TP/LoRA, LoRA x FSDP/HSDP x CP x resume on another
layout, SFT masking x CP x accumulation, tied embeddings x integer resharding, transformers hybrids x checkpointing x
CP) with ``hybridpar check`` and whole runs against one process in float64. What broke is held here, every case in one
2-rank launch (the module's fixture)."""

from __future__ import annotations

import contextlib
import io
import random

import pytest
import torch

from tests.distributed.harness import run_ranks

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
TINY = ["model.preset=tiny", "model.dtype=float64", "data.tokenizer=bytes", "data.pack_size=64", "data.packs_per_step=2",
        "train.warmup_steps=0", "train.eval_every=0", "tensorboard=false", "plot=false"]


def _text(root) -> str:
    rng = random.Random(0)
    path = root / "text.txt"
    path.write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(40)))
    return str(path)


def _fit(overrides: list[str]) -> str:
    """``Trainer.fit`` of ``TINY + overrides``; its stdout (or the error that ended it)."""
    from hybridpar.config import load_config
    from hybridpar.train.trainer import Trainer

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            Trainer(load_config(None, [*TINY, *overrides]), torch.device("cpu")).fit()
    except Exception as error:  # noqa: BLE001 (a case that fails fails its own test)
        return f"{out.getvalue()}\n{type(error).__name__}: {error}"
    return out.getvalue()


def _cases(rank, world_size, root):
    from pathlib import Path

    root = Path(root)
    text = _text(root) if rank == 0 else str(root / "text.txt")
    torch.distributed.barrier()
    results = {
        "lora_sample": _fit(["data.task=text", f"data.path={text}", "parallel.cp=2", "peft.method=lora",
                             "parallel.activation_checkpointing=selective", "train.steps=1",
                             "train.sample={prompt: 'alpha ', max_new_tokens: 4}", f"output_dir={root / 'lora_sample'}"]),
    }
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return run_ranks(2, _cases, str(tmp_path_factory.mktemp("round29")), timeout_s=300)[0]


def test_a_lora_run_prints_its_sample_from_the_adapted_model(cases):
    """``train.sample`` with ``peft.method=lora``: the run trained, saved its checkpoint, then ended in "canonical state
    does not match the model: ... unexpected 24 ['backbone.layers.0.mixer.in_proj.lora_A.weight', ...]" (exit 1):
    the sample's single-device model was the base alone. It is the base with the run's adapters now."""
    output = cases["lora_sample"]
    assert "Error" not in output and "sample (4 tokens, greedy):\nalpha " in output, output


def test_check_packing_says_it_runs_neither_checkpointing_nor_compile():
    """``check --packing parallel.compile=aot_eager parallel.activation_checkpointing=selective`` said "exact ...
    packed documents never meet" and nothing else: both of its runs are the eager model without checkpointing (a
    compiled block runs other kernels on CUDA), while the layout and mixed precision it ignores were said."""
    from hybridpar.config import load_config
    from hybridpar.train.proof.packing import _layout_note

    note = _layout_note(load_config(None, ["parallel.compile=aot_eager", "parallel.activation_checkpointing=selective"]))
    assert note == ("parallel.activation_checkpointing=selective, parallel.compile=aot_eager not used here: both runs are "
                    "the eager model without checkpointing; hybridpar check without --packing runs the layout with them")
    note = _layout_note(load_config(None, ["parallel.cp=2", "parallel.mixed_precision=bf16",
                                           "parallel.activation_checkpointing=full"]))
    assert note.startswith("layout: parallel.cp=2 not used here") and "; parallel.mixed_precision=bf16 not used" in note
    assert note.endswith("; parallel.activation_checkpointing=full not used here: both runs are the eager model without "
                         "checkpointing; hybridpar check without --packing runs the layout with them"), note
    assert _layout_note(load_config(None, [])) == ""


def _exported(model, folder, merge: bool) -> tuple[dict, dict]:
    """``(adapter_config.json or config.json, {tensor name: tensor})`` of ``export_lora(model, folder)``."""
    import json

    from safetensors.torch import load_file

    from hybridpar.models.hf.lora_export import export_lora
    from hybridpar.parallel.state import canonical_state_dict

    export_lora(model, folder, canonical_state_dict(model), merge=merge)
    config = json.loads((folder / ("config.json" if merge else "adapter_config.json")).read_text())
    return config, {name: t for f in sorted(folder.glob("*.safetensors")) for name, t in load_file(f).items()}


def test_a_lora_export_under_activation_checkpointing_names_modules_as_one_process_does(tmp_path):
    """``model.export_hf`` of a LoRA run with ``parallel.activation_checkpointing`` (full or selective): the adapter
    named the modules as the wrapped model does. A transformers model's ``adapter_config.json`` targeted
    ``model.layers.0._checkpoint_wrapped_module.self_attn.q_proj`` (no base has it: peft finds no module) and its
    expert factors were written under hybridpar's names, not peft's (``experts.lora_down_proj.lora_A.weight`` for
    ``experts.base_layer.lora_A.weight``: peft loads them as missing, the update lost); a merged export of expert
    adapters and a HybridLM's adapter export raised after training ("parameter 'backbone.layers.0.
    _checkpoint_wrapped_module.mixer.in_proj.weight' has no BambaForCausalLM name"). Every name is now the one
    process's."""
    from hybridpar.models.hf.lora_export import mamba_out_proj_targets
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.models.lora import add_lora
    from hybridpar.parallel.checkpointing import apply_activation_checkpointing
    from tests.distributed.tensor.hf_models import build_model

    model = build_model("qwen3_moe")
    add_lora(model, r=4, alpha=8, targets=["q_proj"], target_parameters=["mlp.experts.gate_up_proj",
                                                                         "mlp.experts.down_proj"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(generator=torch.Generator().manual_seed(len(name)))
    plain = {merge: _exported(model, tmp_path / f"plain_{merge}", merge) for merge in (False, True)}
    apply_activation_checkpointing(model, "full")
    for merge in (False, True):
        config, tensors = _exported(model, tmp_path / f"checkpointed_{merge}", merge)
        assert config == plain[merge][0]
        assert sorted(tensors) == sorted(plain[merge][1]) and all(torch.equal(t, plain[merge][1][n])
                                                                  for n, t in tensors.items())
    assert "model.layers.0.self_attn.q_proj" in plain[False][0]["target_modules"]
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight" in plain[False][1]
    hybrid = HybridLM(HybridConfig.from_preset("tiny"))
    add_lora(hybrid, r=4, alpha=8)  # the default targets hold the Mamba out_proj, whose adapter peft cannot load
    apply_activation_checkpointing(hybrid, "selective")
    assert mamba_out_proj_targets(hybrid) == ["backbone.layers.0.mixer.out_proj", "backbone.layers.3.mixer.out_proj"]
