"""Round 11 of fault hunting (docs/reliability.md, "Round 11"): each test holds one class of fault."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.train.fault_probes import one_line


class _Mixer(nn.Module):
    """A Mamba1-shaped mixer: ``in_proj`` of ``[x | z]`` rows, as an older run saved it (fused)."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(3, 8, bias=False)
        self.out_proj = nn.Linear(4, 3, bias=False)


def _adam_state(model):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.out_proj(model.in_proj(torch.randn(5, 3))[:, :4] * model.in_proj(torch.randn(5, 3))[:, 4:]).square().sum().backward()
    optimizer.step()
    return optimizer, dict(zip(("model", "optim"), get_state_dict(model, optimizer)))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_with_a_fused_in_proj_loads_into_its_components(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from hybridpar.parallel.tensor.hybrid import SplitInProj
    from hybridpar.train.run.fused_resume import fused_legacy_names, legacy_fused_keys

    torch.manual_seed(0)
    old = _Mixer()
    old_optimizer, saved = _adam_state(old)
    dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    new = _Mixer()
    new.in_proj = SplitInProj(new.in_proj, {"x": 4, "z": 4})  # what split_mamba1 stores today
    optimizer, state = _adam_state(new)
    assert legacy_fused_keys(tmp_path, new) == {"in_proj.weight": ["in_proj.weight_x", "in_proj.weight_z"]}
    with fused_legacy_names(state, tmp_path, new):
        dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    set_state_dict(new, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    weight = old.in_proj.weight.detach()
    assert torch.equal(new.in_proj.weight_x, weight[:4]) and torch.equal(new.in_proj.weight_z, weight[4:])
    moments = old_optimizer.state[old.in_proj.weight]
    for part, rows in ((new.in_proj.weight_x, slice(0, 4)), (new.in_proj.weight_z, slice(4, 8))):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[part][name], moments[name][rows])
        assert float(optimizer.state[part]["step"]) == 1.0
    model_state, _ = get_state_dict(new, optimizer)
    assert "in_proj.weight_x" in model_state and "in_proj.weight" not in model_state  # the names are put back


def test_the_new_families_counts_and_scales_in_config_json_are_checked():
    from hybridpar.models.hf.generation_config import config_vocab_problem

    for field in ("lru_width", "attention_window_size", "conv1d_width", "linear_num_heads", "linear_head_dim",
                  "kv_lora_rank", "mamba_expand", "mamba_dt_rank", "sliding_window"):
        assert f"{field}=0 must be an integer >= 1" in config_vocab_problem({field: 0}, "c.json")
    assert config_vocab_problem({"mamba_dt_rank": "auto", "time_step_rank": "auto"}, "c.json") is None
    for field in ("logits_soft_cap", "final_logit_softcapping", "query_pre_attn_scalar", "logits_scaling",
                  "embedding_multiplier", "lm_head_multiplier"):
        assert f"{field}=0.0 must be a finite number > 0" in config_vocab_problem({field: 0.0}, "c.json")
        assert config_vocab_problem({field: 30.0}, "c.json") is None
    assert "ssm_multipliers=[1.0, 0.0] must be each entry a finite number > 0" in config_vocab_problem(
        {"ssm_multipliers": [1.0, 0.0]}, "c.json")
    assert config_vocab_problem({"final_logit_softcapping": None}, "c.json") is None


def test_a_config_transformers_cannot_build_is_one_line():
    from transformers import Gemma2Config

    from hybridpar.train.hf_model import hf_meta_model

    shape = Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=0)
    with pytest.raises(ValueError) as error:  # was a ZeroDivisionError traceback at --dry-run
        hf_meta_model(shape)
    message = one_line(error)
    assert "config.json builds no Gemma2Config model (ZeroDivisionError in transformers" in message, message


def test_a_layout_message_names_the_key_not_a_styles_argument():
    from hybridpar.config import config_from_dict
    from hybridpar.train.preflight import _named_parallel_key

    config = config_from_dict({"parallel": {"tp": 2}})
    message = ("LoRA target 'm.x_proj' (Linear) is tensor-parallel with Mamba1ChannelParallel(sequence_parallel=False), "
               "which LoRA cannot pair; drop it from peft.target_modules or use parallel.tp=1.")
    assert _named_parallel_key(config, message) == "parallel.tp=2"


def test_load_causal_lm_refuses_a_dtype_a_model_does_not_load_in(tmp_path):
    from hybridpar.models.hf.causal_lm import load_causal_lm, model_dtype

    assert model_dtype("bfloat16") is torch.bfloat16 and model_dtype(torch.float64) is torch.float64
    for dtype in (torch.int64, "float8", "fp32", 16, torch.float8_e4m3fn):  # were transformers' or torch's errors
        with pytest.raises(ValueError) as error:
            load_causal_lm(tmp_path, dtype=dtype)  # refused before the folder is read
        assert f"dtype={dtype!r} is invalid: a model loads in one of float32, bfloat16" in one_line(error)


def test_a_latent_attentions_cache_counts_in_the_generation_memory():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from hybridpar.models.generation import transformers_generation_bytes

    with torch.device("meta"):  # a KDA layer (constant state) and an MLA layer (no k_proj: was not counted)
        model = KimiLinearForCausalLM(KimiLinearConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, qk_rope_head_dim=4, v_head_dim=8,
            qk_nope_head_dim=8, num_experts=4, num_experts_per_token=2, mlp_layer_types=["dense", "sparse"],
            layer_types=["linear_attention", "full_attention"], linear_head_dim=8, linear_num_heads=2, head_dim=8,
            pad_token_id=0, bos_token_id=1, eos_token_id=2))
    new = 10**6
    per_token = 2 * (8 + 4 + 8) * 4  # H x (nope + rope + v) float32
    assert transformers_generation_bytes(model, 1, 10, new) >= (10 + new) * (per_token + 512)
