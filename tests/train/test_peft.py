"""``peft.*``: the config rules, the preflight refusals and a LoRA run of the trainer.

The run (2 gloo ranks, cp=1 x tp=2 with sequence parallelism, tiny float64 hybrid, 3 steps)
trains only the adapters: the optimizer holds exactly the adapter parameters, every base
weight after training equals the freshly built model's bit for bit, and the adapters moved.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hybridpar.config import ConfigError, load_config
from tests.distributed.harness import run_ranks

DEFAULT = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-hybrid.yaml")
LORA = ["model.preset=tiny", "data.pack_size=64", "model.dtype=float64", "train.steps=3", "train.eval_every=0",
        "checkpoint.every=-1", "tensorboard=false", "plot=false", "peft.method=lora", "peft.r=4", "train.lr=1e-2",
        "parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=true"]


@pytest.mark.parametrize("override, fragment", [
    ("peft.r=0", "peft.r=0 is invalid: it must be an integer >= 1"),
    ("peft.method=qlora", "peft.method='qlora' is invalid"),
    ("peft.dropout=1.0", "peft.dropout=1.0 is invalid"),
    ("peft.target_parameters=[]", "peft.target_parameters=[] is invalid"),
])
def test_peft_keys_have_rules(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        load_config(DEFAULT, [override])


def test_no_linear_target_and_no_expert_target_is_refused_in_preflight():
    from hybridpar.train.preflight import validate_layout

    config = load_config(DEFAULT, ["peft.method=lora", "peft.target_modules=[]"])
    with pytest.raises(ConfigError, match=r"^peft.target_modules is empty and peft.target_parameters is not set: "
                                          r"nothing would train;[^\n]*$"):
        validate_layout(config)


def test_a_target_that_matches_nothing_is_refused_in_preflight():
    from hybridpar.train.preflight import validate_layout

    config = load_config(DEFAULT, ["peft.method=lora", "peft.target_modules=[q_proj,qkv_proj]"])
    with pytest.raises(ConfigError, match=r"'qkv_proj' matches no module of HybridLM; use names of its linear"):
        validate_layout(config)
    validate_layout(load_config(DEFAULT, ["peft.method=lora", "parallel.tp=2", "parallel.cp=1"]))  # pairs at tp=2


def _lora_run(rank, world_size, overrides):
    from hybridpar.models.lora import is_lora_parameter
    from hybridpar.parallel.state import canonical_state_dict
    from hybridpar.train.trainer import Trainer, build_model

    config = load_config(DEFAULT, overrides)
    trainer = Trainer(config, torch.device("cpu"))
    before = canonical_state_dict(trainer.model)
    history = trainer.fit()
    after = canonical_state_dict(trainer.model)
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    named = dict(trainer.model.named_parameters())
    optimized = sorted(n for n, p in named.items() if id(p) in in_optimizer)
    fresh = {n: p.detach() for n, p in build_model(config).named_parameters()}
    base_changed = [n for n in fresh if (after[n] - fresh[n]).abs().max().item() != 0.0]
    adapters_moved = sum((after[n] - before[n]).abs().max().item() > 0 for n in after if is_lora_parameter(n))
    state_params = len(trainer.optimizer.state)
    return dict(losses=[r["loss"] for r in history], optimized=optimized, base_changed=base_changed,
                adapters=sum(is_lora_parameter(n) for n in after), adapters_moved=adapters_moved,
                state_params=state_params) if rank == 0 else None


def test_a_lora_run_trains_only_the_adapters(tmp_path):
    from hybridpar.models.lora import is_lora_parameter

    result = run_ranks(2, _lora_run, LORA + [f"output_dir={tmp_path}"], timeout_s=300)[0]
    assert result["optimized"] and all(is_lora_parameter(n) for n in result["optimized"]), result["optimized"][:5]
    assert result["state_params"] == len(result["optimized"])
    assert result["base_changed"] == []
    assert result["adapters_moved"] == result["adapters"] > 0
    assert all(torch.isfinite(torch.tensor(result["losses"])))


def test_an_unloadable_adapter_export_is_refused_in_preflight():
    from hybridpar.train.preflight import validate_layout

    config = load_config(DEFAULT, ["peft.method=lora", "model.export_hf=/tmp/x", "model.export_architecture=Mamba2ForCausalLM"])
    with pytest.raises(ConfigError, match=r"peft cannot load one on a Mamba mixer's out_proj.*peft\.merge=true"):
        validate_layout(config)
    validate_layout(load_config(DEFAULT, ["peft.method=lora", "model.export_hf=/tmp/x", "peft.merge=true",
                                          "model.export_architecture=Mamba2ForCausalLM"]))


RESUME = [o for o in LORA if not o.startswith(("train.steps", "checkpoint.every"))] + ["train.steps=4", "peft.dropout=0.2"]


def _steps(rank, world_size, directory, extra):
    from hybridpar.train.trainer import Trainer

    config = load_config(DEFAULT, RESUME + [f"output_dir={directory}", "checkpoint.every=2"] + extra)
    history = Trainer(config, torch.device("cpu")).fit()
    return [r["loss"] for r in history] if rank == 0 else None


def test_a_lora_run_resumes_exactly_from_adapter_only_checkpoints_and_refuses_another_base(tmp_path):
    from hybridpar.train.run.checkpoint import read_run_info
    from tests.distributed.harness import RankFailure

    straight = run_ranks(2, _steps, tmp_path / "a", [], timeout_s=300)[0]  # checkpoints at steps 2 and 4
    shutil.copytree(tmp_path / "a", tmp_path / "b", ignore=shutil.ignore_patterns("step_00000004"))  # stopped at 2
    checkpoint = tmp_path / "b" / "checkpoints" / "step_00000002"
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:4]
    assert read_run_info(checkpoint)["lora_base"]["path"] == "preset tiny (seed 0)"
    resumed = run_ranks(2, _steps, tmp_path / "b", [], timeout_s=300)[0]
    assert resumed == straight[2:], (resumed, straight)

    from hybridpar.generate import load_for_generation  # generate --checkpoint: base rebuilt + trained adapters
    from hybridpar.train.trainer import build_model

    model, _ = load_for_generation(checkpoint=str(tmp_path / "b"))
    fresh = dict(build_model(load_config(DEFAULT, RESUME)).named_parameters())
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], p) for n, p in fresh.items())
    assert all(params[n].abs().max() > 0 for n in params if ".lora_B." in n)

    with pytest.raises(RankFailure, match=r"trained on preset tiny \(seed 0\).*this run's base is preset tiny \(seed 1\)"):
        run_ranks(2, _steps, tmp_path / "b", ["train.seed=1", "train.steps=6"], timeout_s=300)


def _check_lora(rank, world_size, layout):
    import contextlib
    import io

    from hybridpar.train.proof.layout import run_check

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run_check(load_config(DEFAULT, LORA[:3] + ["peft.method=lora", "peft.r=4", "output_dir=unused", *layout]),
                         torch.device("cpu"))
    return code, out.getvalue()


@pytest.mark.parametrize("layout", [
    ["parallel.cp=1", "parallel.tp=2"],
    # LoRA dropout: masks keyed by each token's pack and position, so a CP rank's zigzag shard and a
    # data-parallel rank's packs get one process's masks (before: 9e-2 on a gradient at cp=2)
    ["parallel.cp=2", "parallel.tp=1", "peft.dropout=0.3", "parallel.cp_attention=ring"],
    ["parallel.cp=1", "parallel.tp=1", "parallel.dp_shard=2", "data.packs_per_step=4", "peft.dropout=0.3"],
], ids=["tp2", "cp2-dropout", "dp2-dropout"])
def test_hybridpar_check_of_a_lora_layout_is_exact(layout):
    code, text = run_ranks(2, _check_lora, layout, timeout_s=300)[0]
    assert code == 0 and "exact" in text and "(frozen)" in text, text[-2000:]


def test_the_first_lines_say_what_lora_adapts_and_which_expert_weights_it_does_not():
    """transformers' MoE experts are stacked 3-D parameters, not nn.Linear layers: the default targets
    adapt the attention only, and the run says so (it was silent: the experts hold most weights)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.models.lora import add_lora
    from hybridpar.train.peft import lora_line

    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             num_experts=4, num_experts_per_tok=2, vocab_size=64)).to(torch.bfloat16)
    assert lora_line(moe) is None
    add_lora(moe, r=4)
    line = lora_line(moe)
    assert line.startswith("LoRA r=4: adapters on 8 linear layers (k_proj, o_proj, q_proj, v_proj)")
    assert "adapters float32, base bfloat16" in line
    assert "not adapted: 4 stacked weights (experts.down_proj, experts.gate_up_proj; 50% of the parameters); " \
           "adapt them with peft.target_parameters=[experts.down_proj,experts.gate_up_proj]" in line
    experts = Qwen3MoeForCausalLM(moe.config).to(torch.bfloat16)
    add_lora(experts, r=4, target_parameters=["experts.gate_up_proj"])  # down_proj left out: still listed
    line = lora_line(experts)
    assert "; expert adapters (rank 4 per expert) on 2 stacked weights (experts.gate_up_proj)" in line
    assert "not adapted: 2 stacked weights (experts.down_proj; 15% of the parameters)" in line
    hybrid = HybridLM(HybridConfig.from_preset("tiny"))
    add_lora(hybrid, r=8)
    assert "not adapted" not in lora_line(hybrid)  # the Mamba conv's [C, 1, K] weight is not a linear layer
