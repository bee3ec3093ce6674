"""FSDP's unit in the plan of a transformers twin: a whole decoder layer, as ``apply_fsdp`` shards it.

``parallel/data/fsdp.apply_fsdp`` makes every block of ``checkpointing.find_blocks`` (a transformers
model's decoder layers) one ``fully_shard`` unit. A paired twin prices a layer as two blocks (a mixer
then its MLP/MoE block: Llama's attention + MLP, Granite's mixer + MoE, Falcon-H1's ``P`` + MLP,
Bamba's mixer + MLP), so the plan's gathered parameters and unsharded gradients per unit must sum
both (``plan/memory.fsdp_layers``); per twin block, Granite with 32 experts under FSDP measured 0.83
of its peak. NemotronH (one block per layer) keeps one block per unit.
"""

from __future__ import annotations

import re

import pytest
import torch

from hybridpar.config import load_config
from hybridpar.parallel.checkpointing import find_blocks
from hybridpar.plan import make_plan
from hybridpar.plan.memory import fsdp_layers
from tests.plan.test_plan_hf import _checkpoint as _dense_checkpoint
from tests.plan.test_plan_moe import _checkpoint as _moe_checkpoint

FALCON = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              num_hidden_layers=4, vocab_size=256, mamba_n_heads=8, mamba_d_head=32, mamba_d_ssm=256,
              mamba_d_state=16, mamba_chunk_size=64, mamba_n_groups=2, mamba_rms_norm=True)


def _falcon_checkpoint(path) -> str:
    import json

    import transformers as hf

    path.mkdir(parents=True, exist_ok=True)
    config = hf.FalconH1Config(**FALCON)
    (path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["FalconH1ForCausalLM"]}))
    return str(path)


def _path(tmp_path, name: str) -> str:
    if name in ("llama", "bamba", "nemotron_h"):
        return _dense_checkpoint(tmp_path / name, name)
    if name == "falcon_h1":
        return _falcon_checkpoint(tmp_path / name)
    return _moe_checkpoint(tmp_path / name, "granite", num_local_experts=32)


def _plan(path: str, *more: str):
    return make_plan(load_config(None, [f"model.hf_path={path}", "model.backend=transformers", "data.pack_size=2048",
                                        "data.packs_per_step=1", *more]))


@pytest.mark.parametrize("name, per_unit", [("llama", 2), ("granite", 2), ("falcon_h1", 2), ("bamba", 2),
                                            ("nemotron_h", 1)])
def test_the_plans_fsdp_units_are_the_models_decoder_layers(tmp_path, name, per_unit):
    """The units the plan gathers hold what ``apply_fsdp``'s units hold: one per decoder layer, each with
    that layer's parameters (counted on transformers' meta model)."""
    import transformers as hf

    path = _path(tmp_path, name)
    plan = _plan(path)
    with torch.device("meta"):
        model = hf.AutoModelForCausalLM.from_config(hf.AutoConfig.from_pretrained(path))
    layers = find_blocks(model)
    units = fsdp_layers(plan.layout)
    assert len(units) == len(layers) and {len(u) for u in units} == {per_unit}
    numel = plan.memory.params.unit_numel
    assert [sum(numel[f"backbone.layers.{i}"] for i in unit) for unit in units] == \
        [sum(p.numel() for p in layer.parameters()) for layer in layers]


@pytest.mark.parametrize("name, more", [("granite", ["parallel.cp=2", "parallel.activation_checkpointing=full"]),
                                        ("granite", ["parallel.dp_shard=2", "data.packs_per_step=2"]), ("llama", ["parallel.dp_shard=2", "data.packs_per_step=2"]),
                                        ("falcon_h1", ["parallel.cp=2", "parallel.activation_checkpointing=full"])])
def test_the_peak_gathers_and_reduces_whole_decoder_layers(tmp_path, name, more):
    """At the peak's block the plan holds its whole layer gathered and the neighbouring layer FSDP prefetches
    (backward: the one before; forward: the next), and in backward the unsharded gradients of the layer's
    blocks done so far: per twin block it held one block's (the bug this guards)."""
    plan = _plan(_path(tmp_path, name), *more)
    memory, blocks = plan.memory, len(plan.layout.model.pattern)
    units = [(i, i + 1) for i in range(0, blocks, 2)]  # every twin here is paired: two blocks per decoder layer
    block = int(re.search(r"block (\d+)", memory.peak_moment).group(1))
    layer = next(u for u, unit in enumerate(units) if block in unit)
    backward = memory.peak_moment.startswith("backward")
    neighbour = layer - 1 if backward else layer + 1

    def gathered(u: int) -> int:
        return sum(memory.params.gathered(f"backbone.layers.{i}") for i in units[u]) if 0 <= u < len(units) else 0

    assert memory.breakdown["fsdp_gathered"] == gathered(layer) + gathered(neighbour)
    if backward:
        grads = sum(memory.params.unit_numel[f"backbone.layers.{i}"] for i in units[layer] if i >= block)
        assert memory.breakdown["unsharded_grads"] == grads * memory.params.element_bytes
