"""LoRA exports in the PEFT format against peft itself (one process, float64).

A tiny transformers Llama is saved as the base; hybridpar adds adapters (B perturbed so the
update is not zero) and exports them with ``export_lora``. ``peft.PeftModel.from_pretrained``
on the saved base gives the same logits as hybridpar's model (1e-10), and so does the merged
export (``merge=True``: our merge, equal to peft's ``merge_and_unload``) loaded as a plain transformers model. A
``HybridLM`` exported as NemotronH (Mamba in/out_proj, attention, MLP adapters) loads in peft with
every adapter tensor placed and its logits equal to the merged export's; with the default targets
(Mamba ``out_proj`` included, which peft refuses for Mamba models) the adapter export is refused and
the merged export is the way out.
"""

from __future__ import annotations

import copy
import json
import warnings

import torch

from hybridpar.models.lora import add_lora
from hybridpar.parallel.state import canonical_state_dict
from hybridpar.models.hf.lora_export import export_lora

TOL = 1e-10


def _perturbed_lora(model, seed=2):
    add_lora(model, r=4, alpha=8.0, seed=1)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model


def _relative(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_llama_adapter_loads_in_peft_with_the_same_logits_and_merges(tmp_path):
    import transformers as hf
    from peft import PeftModel

    from tests.distributed.tensor.hf_models import COMMON

    torch.manual_seed(0)
    base = hf.LlamaForCausalLM(hf.LlamaConfig(**COMMON)).to(torch.float64)
    with torch.no_grad():
        for param in base.parameters():
            param.add_(0.05 * torch.randn_like(param))
    base.save_pretrained(tmp_path / "base")
    ours = _perturbed_lora(copy.deepcopy(base))
    ids = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))
    want = ours(input_ids=ids).logits.detach()

    state = canonical_state_dict(ours)
    export_lora(ours, tmp_path / "adapter", state, base_path=tmp_path / "base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(
            hf.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float64), tmp_path / "adapter")
    placed = {n.replace(".default", "") for n, _ in loaded.named_parameters() if "lora_" in n}
    assert placed == {"base_model.model." + n for n in state if "lora_" in n}
    assert _relative(loaded(input_ids=ids).logits, want) < TOL
    assert _relative(base(input_ids=ids).logits, want) > 1e-4  # the adapter matters

    export_lora(ours, tmp_path / "merged", state, merge=True)
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = hf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64)
    assert _relative(merged(input_ids=ids).logits, want) < TOL
    peft_merged = loaded.merge_and_unload().state_dict()  # our merge equals peft's
    assert max(_relative(t, peft_merged[n]) for n, t in merged.state_dict().items()) < TOL


def test_hybrid_lm_adapter_exports_with_checkpoint_names(tmp_path):
    import pytest
    import transformers as hf
    from peft import PeftModel

    from hybridpar.models.hf.causal_lm import export_causal_lm
    from hybridpar.models.hf.lora_export import read_peft_adapter, split_lora_state
    from tests.distributed.context.test_model import build_model

    nemotron = dict(rotary_fraction=0.0, attention_bias=False, mlp_gated=False)  # what NemotronH can represent
    arch = "NemotronHForCausalLM"
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(5))

    refused = _perturbed_lora(build_model(**nemotron))  # default targets: Mamba out_proj included
    with pytest.raises(ValueError, match=r"Mamba mixer's out_proj.*peft\.merge=true"):
        export_lora(refused, tmp_path / "refused", canonical_state_dict(refused), architecture=arch)

    ours = build_model(**nemotron)
    add_lora(ours, r=4, alpha=8.0, seed=1, targets=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj",
                                                    "in_proj"])
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if name.endswith("lora_B.weight"):
                param.normal_(0, 0.1)
    state = canonical_state_dict(ours)
    base, adapters = split_lora_state(state)
    export_causal_lm(ours, tmp_path / "base", state_dict=base, architecture=arch)
    export_lora(ours, tmp_path / "adapter", state, base_path=tmp_path / "base", architecture=arch)
    export_lora(ours, tmp_path / "merged", state, merge=True, architecture=arch)
    _, tensors = read_peft_adapter(tmp_path / "adapter")
    assert len(tensors) == len(adapters) and "model.layers.0.mixer.in_proj.lora_B.weight" in tensors

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(
            hf.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float64), tmp_path / "adapter")
        merged = hf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64)
    placed = {n.replace(".default", "") for n, _ in loaded.named_parameters() if "lora_" in n}
    assert placed == {"base_model.model." + n for n in tensors}
    got = loaded(input_ids=ids).logits
    assert _relative(got, merged(input_ids=ids).logits) < TOL  # peft's adapter path == our merge
    print("HybridLM vs transformers NemotronH + peft:", _relative(got, ours(ids)))


def test_generate_loads_base_plus_adapter(tmp_path):
    """``hybridpar generate --hf-path ADAPTER`` (base from adapter_config.json, adapter merged) gives
    the tokens of the merged export."""
    from hybridpar.models.hf.checkpoint import save_hf
    from hybridpar.models.hf.lora_export import split_lora_state
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from tests.models.test_generation import HF_SHAPES
    from tests.train.test_generate_cli import PROMPT, generate

    architecture = "Mamba2ForCausalLM"
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("tiny", dtype=torch.float64, chunk_size=4, **HF_SHAPES[architecture]))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
        model.lm_head.weight.mul_(20.0)
    add_lora(model, r=4, alpha=8.0, seed=1, targets=["in_proj"])  # peft loads in_proj adapters on Mamba models
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                param.normal_(0, 0.5)
    state = canonical_state_dict(model)
    save_hf_base = HybridLM(model.config)
    save_hf_base.load_state_dict(split_lora_state(state)[0])
    save_hf(save_hf_base, tmp_path / "base", architecture=architecture)
    export_lora(model, tmp_path / "adapter", state, base_path=tmp_path / "base", architecture=architecture)
    export_lora(model, tmp_path / "merged", state, merge=True, architecture=architecture)

    runs = {}
    for name in ("adapter", "merged", "base"):
        code, output = generate("--hf-path", str(tmp_path / name), "--prompt", PROMPT, "--max-new-tokens", "6", "--json")
        assert code == 0, output
        runs[name] = json.loads(output.strip().splitlines()[-1])["new_ids"]
    assert runs["adapter"] == runs["merged"] and runs["adapter"] != runs["base"]
