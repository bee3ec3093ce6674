"""Plans that do not fit are refused by ``check_tp_plan`` before anything is sharded.

``apply_tp`` runs ``check_tp_plan(model, tp, plan, sequence_parallel)`` before any collective,
so these checks run in one process at ``tp=2`` without a mesh; the refusals that go through
``apply_tp`` on real ranks are in ``tests/distributed/tensor/test_hf.py``. Each case is a fallback
that would otherwise run and return a wrong shape, fail with a raw error at forward, or
silently treat a whole tensor as a shard.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from hybridpar.parallel.tensor.apply import check_tp_plan
from hybridpar.parallel.tensor.linear_styles import Conv1DColwiseParallel, LocalHeadCounts, PackedColwiseParallel
from hybridpar.parallel.tensor.moe import GroupedExpertsParallel, expert_placements
from hybridpar.parallel.tensor.plans import hf_tp_plan
from hybridpar.parallel.tensor.hf_plans.dense import llama_plan
from hybridpar.parallel.tensor.styles import LocalReplicateParallel
from tests.distributed.tensor.hf_models import build_model


def _check(model, plan=None, sequence_parallel=False, tp=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "default plan" notice
        return check_tp_plan(model, tp, plan, sequence_parallel)


class Attention(nn.Module):
    def __init__(self, width=64, head_dim=16):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj, self.o_proj = nn.Linear(64, width), nn.Linear(width, 64)

    def forward(self, x):
        return self.o_proj(self.q_proj(x))


class Block(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.attn = Attention(**kwargs)
        self.norm = nn.LayerNorm(64)


def test_conv1d_needs_its_own_styles():
    from transformers.pytorch_utils import Conv1D

    model = nn.ModuleDict({"proj": Conv1D(8, 4)})
    with pytest.raises(ValueError, match="Conv1D stores \\[in, out\\].*Conv1DColwiseParallel"):
        _check(model, {"proj": ColwiseParallel()})
    assert _check(model, {"proj": Conv1DColwiseParallel()}).source == "user"
    with pytest.raises(ValueError, match="needs a Hugging Face Conv1D"):
        _check(nn.ModuleDict({"proj": nn.Linear(4, 8)}), {"proj": Conv1DColwiseParallel()})


def test_torch_styles_take_linear_and_embedding_only():
    with pytest.raises(ValueError, match="supports nn.Linear and nn.Embedding, got LayerNorm"):
        _check(nn.ModuleDict({"norm": nn.LayerNorm(4)}), {"norm": RowwiseParallel()})


def test_sharded_sizes_and_whole_heads():
    with pytest.raises(ValueError, match="output features 63 are not divisible by tp=2"):
        _check(nn.ModuleDict({"proj": nn.Linear(4, 63)}), {"proj": ColwiseParallel()})
    with pytest.raises(ValueError, match="input features 63 are not divisible"):
        _check(nn.ModuleDict({"proj": nn.Linear(63, 4)}), {"proj": RowwiseParallel()})
    assert _check(nn.ModuleDict({"proj": nn.Linear(4, 63)}), {"proj": ColwiseParallel(output_layouts=Replicate())})
    block = Block(width=96, head_dim=32)  # 3 heads of 32: 48 columns per rank split a head
    with pytest.raises(ValueError, match="split a head of Attention \\(head_dim=32\\)"):
        _check(block, {"attn.q_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel()})
    _check(Block(), {"attn.q_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel()})


def test_row_parallel_needs_column_parallel_producers():
    with pytest.raises(ValueError, match="no projection in Attention is column-parallel"):
        _check(Block(), {"attn.o_proj": RowwiseParallel(), "attn.q_proj": LocalReplicateParallel()})
    with pytest.raises(ValueError, match="\\['attn.q_proj'\\] in Attention has no plan entry"):
        _check(Block(), {"attn.o_proj": RowwiseParallel()})
    _check(Block(), {"attn.o_proj": RowwiseParallel(input_layouts=Replicate())})  # reads a whole input: fine


def test_head_count_attributes_must_be_made_per_rank():
    stablelm = build_model("stablelm")
    with pytest.raises(ValueError, match="StableLmAttention.forward .* reshapes or splits with "
                                         "\\['num_heads', 'num_key_value_heads'\\]"):
        _check(stablelm, "default")
    assert _check(stablelm).source.startswith("registry")  # its plan: LocalHeadCounts on self_attn
    with pytest.raises(ValueError, match="num_heads=3 is not divisible by tp=2"):
        _check(nn.ModuleDict({"attn": type("A", (nn.Module,), {"num_heads": 3})()}),
               {"attn": LocalHeadCounts(("num_heads",))})


def test_default_plan_next_to_a_fused_projection_is_refused():
    with pytest.raises(ValueError, match="qkv_proj'\\] in Phi3Attention has no plan entry"):
        _check(build_model("phi3"), "default")


def test_sequence_parallel_needs_every_norm_and_the_residual_stream_covered():
    gpt2 = build_model("gpt2")
    _check(gpt2, "default")  # without SP the generic plan runs (only the LM head is sharded: a warning)
    with pytest.raises(ValueError, match="leaves \\['transformer'\\] uncovered"):
        _check(gpt2, "default", sequence_parallel=True)
    with pytest.raises(ValueError, match="uncovered") as err:
        _check(build_model("bamba"), "default", sequence_parallel=True)
    assert "model.layers.*.mamba" in str(err.value) and "model.final_layernorm" in str(err.value)
    plan = {"model.layers.*.input_layernorm": LocalReplicateParallel()}  # plain output on the stream
    with pytest.raises(ValueError, match="sit on the residual stream but their plan entries return plain tensors"):
        _check(build_model("llama"), lambda model, sp: {**llama_plan(model, sp), **plan}, sequence_parallel=True)
    assert isinstance(llama_plan(None, True)["model.norm"], SequenceParallel)  # what the registered plan gives


def test_every_registered_hf_plan_passes_with_and_without_sp():
    for name in ("gemma2", "phi3", "olmo2", "granite", "cohere", "starcoder2", "gpt_neox", "gpt2", "stablelm",
                 "bamba", "nemotron_h", "mixtral", "qwen2_moe", "qwen3_moe"):
        model = build_model(name)
        for sp in (False, True):
            assert _check(model, sequence_parallel=sp).source.startswith("registry"), (name, sp)


def test_config_flags_the_plans_cannot_shard_are_refused():
    stablelm = build_model("stablelm")
    stablelm.config.qk_layernorm = True
    with pytest.raises(ValueError, match="qk_layernorm=True is not supported at tp=2"):
        _check(stablelm)
    cohere = build_model("cohere")
    cohere.config.use_qk_norm = True
    with pytest.raises(ValueError, match="use_qk_norm=True"):
        _check(cohere)


def test_packed_linear_weight_is_refused_under_fsdp():
    model = nn.ModuleDict({"mlp": nn.ModuleDict({"gate_up_proj": nn.Linear(8, 16)})})
    plan = {"mlp.gate_up_proj": PackedColwiseParallel(2)}
    _check(model, plan)  # tensor parallel alone: fine
    with pytest.raises(ValueError, match="mlp.gate_up_proj.*FSDP's dim-0 shard cannot compose"):
        check_tp_plan(model, 2, plan, data_parallel=True)


def test_packed_and_expert_styles_check_their_sizes():
    PackedColwiseParallel(3).check("qkv", nn.Linear(8, 96), 4)
    with pytest.raises(ValueError, match="90 output features packing 3 parts .* multiple of 12"):
        PackedColwiseParallel(3).check("qkv", nn.Linear(8, 90), 4)
    experts = build_model("mixtral").model.layers[0].mlp.experts
    GroupedExpertsParallel().check("experts", experts, 2)
    with pytest.raises(ValueError, match="expert intermediate size 32 is not divisible by tp=3"):
        GroupedExpertsParallel().check("experts", experts, 3)
    experts.has_post_expert_norm = True
    with pytest.raises(ValueError, match="has a post-expert norm"):
        GroupedExpertsParallel().check("experts", experts, 2)
    # GPT-OSS: transposed, interleaved gate/up with biases; the down bias is added once (moe._once_over_tp)
    biased = build_model("gpt_oss").model.layers[0].mlp.experts
    assert {n: str(p) for n, p in expert_placements(biased).items()} == {
        "gate_up_proj": "S(2)", "gate_up_proj_bias": "S(1)", "down_proj": "S(1)", "down_proj_bias": "R"}


def test_hugging_face_moe_plan_translation():
    mixtral = build_model("mixtral")
    styles = hf_tp_plan(mixtral)
    assert type(styles["model.layers.*.mlp.experts"]) is GroupedExpertsParallel
    assert not any(p.endswith(("gate_up_proj", "down_proj")) and "experts" in p for p in styles)  # covered
    _check(mixtral, lambda model, sp: hf_tp_plan(model))
    # dense NemotronH: its Hugging Face plan names experts it does not have; they match nothing
    nemotron = build_model("nemotron_h")
    assert set(_check(nemotron, lambda model, sp: hf_tp_plan(model)).styles) == {"model.embeddings"}


def test_a_module_with_own_parameters_beside_planned_children_is_named_not_stop_iteration():
    """Qwen3-Next's gated DeltaNet holds A_log / dt_bias itself while its projections are planned:
    sequence parallelism is refused with a ValueError naming it (it raised a bare StopIteration)."""
    import transformers as hf

    config = hf.Qwen3NextConfig(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], hidden_size=64, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, vocab_size=128)
    with torch.device("meta"):
        model = hf.Qwen3NextForCausalLM(config)
    with pytest.raises(ValueError, match=r"model\.layers\.\*\.linear_attn'"):  # transformers' own plan
        check_tp_plan(model, 2, hf_tp_plan(model), sequence_parallel=True)
    # hybridpar's plan (plans_moe.qwen3_next_plan) shards the layer by heads once install_gdn_core switched it
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.linear_attn'.*switched by install_gdn_core"):
        check_tp_plan(model, 2, sequence_parallel=True)
