"""Transformers hybrids under LoRA export and generation (round 15h, ``docs/reliability.md``).

Generation: with hybridpar's Mamba2 mixers switched in, ``generate_causal_lm`` (transformers' cache path)
gives transformers' own greedy tokens and a no-cache full forward's. LoRA: an adapter on the Mamba
``in_proj`` and attention q/v loads in peft with the logits of hybridpar's model (float64, RMSNorms in
float64 on both sides). Zamba2's shared block used by two layers holds one tied weight but trains one
adapter per use: a merged export folded only the first use's (a ``KeyError`` traceback); now refused.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from hybridpar.models.hf.causal_lm import generate_causal_lm
from hybridpar.models.hf.lora_export import export_lora
from hybridpar.models.lora import add_lora
from hybridpar.parallel.state import canonical_state_dict
from hybridpar.train.hf_model import install_cores
from tests.distributed.tensor.hf_models import exact_norm
from tests.models.hf.hybrid_models import build_hybrid

TARGETS = ["in_proj", "q_proj", "v_proj"]


def _ids(seed=5, length=9):
    return torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["granite_moe", "nemotron_h_moe", "zamba2_shared"])
def test_generation_equals_transformers_and_no_cache(name):
    ref = build_hybrid(name).eval()
    ours = copy.deepcopy(ref)
    install_cores(ours)
    ids = _ids()
    with torch.no_grad():
        got = generate_causal_lm(ours, ids, 6)
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
        seq = ids
        for _ in range(6):
            seq = torch.cat([seq, ours(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, want) and torch.equal(got, seq)


def _adapted(name, tmp_path):
    base = build_hybrid(name).eval()
    base.save_pretrained(tmp_path / "base")
    ours = copy.deepcopy(base)
    add_lora(ours, r=4, alpha=8.0, seed=1, targets=TARGETS)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if n.endswith("lora_B.weight"):
                p.normal_(0, 0.1)
    return ours


@pytest.mark.parametrize("name", ["bamba", "granite_moe"])
def test_adapter_loads_in_peft_with_the_same_logits(name, tmp_path):
    import transformers as hf
    from peft import PeftModel

    torch.manual_seed(0)
    ours = _adapted(name, tmp_path)
    want = ours(input_ids=_ids(length=12)).logits.detach()
    export_lora(ours, tmp_path / "adapter", canonical_state_dict(ours), base_path=tmp_path / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(
            hf.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float64, experts_implementation="eager"), tmp_path / "adapter").eval()
    for module in loaded.modules():
        if type(module).__name__.endswith("RMSNorm"):
            exact_norm(module)
    got = loaded(input_ids=_ids(length=12)).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-10


def test_zamba2_shared_block_merge_is_refused(tmp_path):
    torch.manual_seed(0)
    ours = _adapted("zamba2_shared", tmp_path)
    with pytest.raises(ValueError, match=r"layers\.1\.shared_transformer.*layers\.3\.shared_transformer.*peft\.merge=false"):
        export_lora(ours, tmp_path / "merged", canonical_state_dict(ours), merge=True)
