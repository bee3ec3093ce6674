"""Round 13 of fault hunting, LoRA exports (docs/reliability.md, "Round 13"): each test holds one class of fault.

An adapter is checked the way its users load it: ``peft.PeftModel.from_pretrained(base, adapter,
is_trainable=True)`` must adapt exactly the modules (and stacked parameters) that were trained.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from hybridpar.models.hf.lora_export import export_lora, read_peft_adapter, split_lora_state
from hybridpar.models.lora import add_lora
from hybridpar.parallel.state import canonical_state_dict
from tests.train.fault_probes import cli

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = str(ROOT / "configs" / "tiny-hybrid.yaml")
TINY = ["parallel.cp=1", "parallel.tp=1", "data.pack_size=128", "train.eval_every=0", "plot=false", "tensorboard=false",
        "model.preset=tiny", "train.steps=1"]


def _peft_adapted(base_dir: Path, adapter_dir: Path, **load) -> tuple[set[str], int]:
    """``(names of the tensors peft trains, their element count)`` when peft loads ``adapter_dir`` on ``base_dir``."""
    import transformers as hf
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = hf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64, **load)
        loaded = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    trained = {n.removeprefix("base_model.model.").replace(".default", ""): p.numel()
               for n, p in loaded.named_parameters() if p.requires_grad}
    return set(trained), sum(trained.values())


def _export_and_compare(model, tmp_path: Path, name: str, save_base, **load) -> None:
    """Export ``model``'s adapter; peft must adapt exactly what it holds (names and parameter count)."""
    state = canonical_state_dict(model)
    base, adapters = split_lora_state(state)
    save_base(tmp_path / f"{name}-base", base)
    export_lora(model, tmp_path / name, state, base_path=tmp_path / f"{name}-base",
                architecture=load.pop("architecture", None))
    _, exported = read_peft_adapter(tmp_path / name)
    names, count = _peft_adapted(tmp_path / f"{name}-base", tmp_path / name, **load)
    assert len(exported) == len(adapters)
    assert names == set(exported), (name, sorted(names ^ set(exported)))
    assert count == sum(t.numel() for t in adapters.values())


def test_an_unmerged_adapter_of_a_preset_base_is_refused_before_training(tmp_path):
    """A preset run (random base, no model.hf_path) exported its adapter with ``base_model_name_or_path: null`` and
    saved the base nowhere: exit 0, an adapter nothing can load. Now refused before training (exit 2, one line
    naming both fixes); the merged export of the same run is accepted."""
    from hybridpar.config import load_config
    from hybridpar.train.preflight import model_config
    from hybridpar.train.run.export import validate_export

    run = ["train", "--config", DEFAULT, *TINY, "peft.method=lora", "peft.target_modules=[q_proj,in_proj]",
           f"model.export_hf={tmp_path / 'export'}", "model.export_architecture=NemotronHForCausalLM",
           "model.overrides={rotary_fraction: 0.0}", f"output_dir={tmp_path / 'run'}"]
    code, output = cli(*run)
    assert code == 2, output[-2000:]
    [line] = [line for line in output.splitlines() if "error:" in line]
    assert "would write a LoRA adapter whose base (model.preset='tiny', random weights) is saved nowhere" in line
    assert "peft.merge=true" in line and "model.hf_path" in line
    assert not (tmp_path / "run").exists() and not (tmp_path / "export").exists()
    merged = load_config(DEFAULT, [*run[3:], "peft.merge=true"])
    validate_export(merged, model_config(merged))


@pytest.mark.parametrize("named, said", [(None, "null"), ("", '""'), ("  ", '"  "')])
def test_generate_says_an_adapter_names_no_base(tmp_path, named, said):
    """``generate --hf-path`` on an adapter whose ``base_model_name_or_path`` is null said it "names base '.'"."""
    from safetensors.torch import save_file

    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": named, "peft_type": "LORA",
                                                              "r": 2, "lora_alpha": 4}))
    save_file({"base_model.model.x.lora_A.weight": torch.zeros(2, 4)}, str(tmp_path / "adapter_model.safetensors"))
    code, output = cli("generate", "--hf-path", str(tmp_path), "--prompt", "k", "--max-new-tokens", "2")
    assert code == 2 and "names base '.'" not in output, output
    assert f"names no base model (base_model_name_or_path is {said} in its adapter_config.json)" in output, output


def test_a_transformers_adapter_loads_on_exactly_the_trained_modules(tmp_path):
    """``target_modules`` was cut to leaf names: an adapter trained on layer 0's q_proj said ["q_proj"], and peft
    adapted every layer's q_proj (twice the parameters, half of them never trained). A partial list and the
    default list (every layer) load on exactly the trained modules."""
    import transformers as hf

    from tests.distributed.tensor.hf_models import COMMON

    for name, targets in (("partial", ["layers.0.self_attn.q_proj", "layers.1.mlp.down_proj"]), ("default", None)):
        torch.manual_seed(0)
        model = hf.LlamaForCausalLM(hf.LlamaConfig(**COMMON)).double()
        add_lora(model, r=2, alpha=4.0, targets=targets, seed=1)

        def save_base(folder, base, model=model):
            plain = hf.LlamaForCausalLM(model.config).double()
            plain.load_state_dict(base)
            plain.save_pretrained(folder)
        _export_and_compare(model, tmp_path, name, save_base)


@pytest.mark.parametrize("architecture", ["NemotronHForCausalLM", "Mamba2ForCausalLM"])
def test_a_hybrid_lm_adapter_loads_on_exactly_the_trained_modules(tmp_path, architecture):
    """The same for a HybridLM exported as a transformers Mamba/NemotronH model (its names mapped to the
    checkpoint's): one layer's in_proj, and every loadable target of every layer."""
    from hybridpar.models.hf.checkpoint import save_hf
    from hybridpar.models.hybrid import HybridLM
    from tests.distributed.context.test_model import build_model
    from tests.models.test_generation import HF_SHAPES

    if architecture == "NemotronHForCausalLM":
        shape = dict(rotary_fraction=0.0, attention_bias=False, mlp_gated=False)
        every = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "in_proj"]
    else:
        shape, every = dict(HF_SHAPES[architecture], pattern="MM"), ["in_proj"]
    for name, targets in (("partial", ["layers.0.mixer.in_proj"]), ("every", every)):
        model = build_model(**shape)
        add_lora(model, r=2, alpha=4.0, targets=targets, seed=1)

        def save_base(folder, base, model=model):
            plain = HybridLM(model.config)
            plain.load_state_dict(base)
            save_hf(plain, folder, architecture=architecture)
        _export_and_compare(model, tmp_path, name, save_base, architecture=architecture)


def test_expert_adapters_load_on_exactly_the_trained_stacked_weights(tmp_path):
    """``target_parameters`` was cut the same way (``experts.gate_up_proj``): an adapter trained on layer 0's experts
    loaded on every layer's. A partial list and the leaf names (every layer) load on exactly the trained ones."""
    from tests.models.test_lora_experts import _base

    for name, targets in (("partial", ["model.layers.0.mlp.experts.gate_up_proj"]),
                          ("every", ["experts.gate_up_proj", "experts.down_proj"])):
        model = _base()
        add_lora(model, r=2, alpha=4.0, targets=["layers.1.self_attn.q_proj"], target_parameters=targets, seed=1)

        def save_base(folder, base, model=model):
            plain = _base()
            plain.load_state_dict(base)
            plain.save_pretrained(folder)
        _export_and_compare(model, tmp_path, name, save_base, experts_implementation="eager")
