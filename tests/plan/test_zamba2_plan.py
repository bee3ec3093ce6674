"""``hybridpar plan`` of Zamba2: Mamba2 layers and shared transformer blocks reused at several depths.

The twin spells a hybrid layer ``ZM`` (``plan/hf/zamba2.py``): the shared block's use (attention on
``[h, embeddings]`` of width 2D, fused gated MLP, per-use adapters) with its layer's ``linear``, then
its Mamba block. Its parameters (shared weights once, adapters per use) equal transformers' model's for
every sharing (``num_mem_blocks`` 1, 2, more than the uses), with and without the q/k/v adapters and
biases. One measured step at tp=2 + SP holds parameters and traffic exact (the shared norms' gradients
reduced once, the linear's per use, the adapters' ``[Tc, r]``), saved within 10%, peak within 15%, and so
does one under FSDP's bf16 at cp=2; the
stored benchmark cases (``benchmarks/planner.py --models zamba2``) are replanned against their
measurement (``full`` and ``selective`` checkpointing too: one checkpoint per hybrid layer, which keeps
the layer's input and the embeddings once, and whose recomputation repeats the shared block's mid-layer
collectives), and so does one under bf16 autocast, and two under LoRA (every use's copy of the block adapted on
its own).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridpar.config import load_config
from hybridpar.plan import make_plan
from hybridpar.plan.planner import Plan, TransformersPlan, planned_shape
from hybridpar.plan.validate import predict
from tests.plan.step_check import assert_plan_matches_step

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "planner.json"
# benchmarks/planner.py's zamba2 (hidden 128, MLP 384, vocab 256): mamba, hybrid, mamba, hybrid on one shared block
WIDTHS = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
              num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], n_mamba_heads=8,
              mamba_ngroups=2, mamba_d_state=16, chunk_size=64, num_mem_blocks=1, use_shared_attention_adapter=True,
              adapter_rank=8, use_mem_rope=True)
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
             mamba_d_state=8, n_mamba_heads=4, mamba_ngroups=1, chunk_size=16)


def _config(**fields):
    import transformers as hf

    fields = {**fields, "num_hidden_layers": len(fields["layers_block_type"])}
    return hf.Zamba2Config(**fields)


def _checkpoint(path: Path, weights: bool = False, **fields) -> str:
    import transformers as hf

    config = _config(**{**WIDTHS, **fields})
    if weights:
        torch.manual_seed(0)
        hf.Zamba2ForCausalLM(config).save_pretrained(path)
    else:  # config.json only: what the planner reads
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["Zamba2ForCausalLM"]}))
    return str(path)


def _overrides(path: str, *more: str, tokens: int = 2048) -> list[str]:
    return [f"model.hf_path={path}", "model.backend=transformers", f"data.pack_size={tokens}", "data.packs_per_step=1",
            *more]


@pytest.mark.parametrize("kinds, fields, pattern", [
    (["mamba", "hybrid", "mamba", "hybrid"], dict(num_mem_blocks=1, use_shared_attention_adapter=True, adapter_rank=4,
                                                  use_mem_rope=True), "MZMMZM"),
    (["mamba", "hybrid", "hybrid", "mamba", "hybrid", "hybrid"], dict(num_mem_blocks=2, use_shared_attention_adapter=True,
                                                                      adapter_rank=4), "MZMZMMZMZM"),
    (["hybrid", "mamba", "hybrid"], dict(num_mem_blocks=3, add_bias_linear=True), "ZMMZM"),
    (["hybrid", "mamba", "hybrid"], dict(num_key_value_heads=2), "ZMMZM"),
])
def test_a_zamba2_plan_counts_the_shared_blocks_once_and_the_adapters_per_use(kinds, fields, pattern):
    import transformers as hf

    config = _config(**{**SMALL, "layers_block_type": kinds, **fields})
    twin, why, _ = planned_shape(config)
    with torch.device("meta"):
        model = hf.Zamba2ForCausalLM(config)
    assert twin is not None and not why and twin.pattern == pattern
    from hybridpar.plan.params import parameter_count

    assert parameter_count(twin) == sum(p.numel() for p in model.parameters())


def test_a_zamba2_plan_prices_every_use_of_a_shared_block(tmp_path):
    """Two uses of one block keep twice one use's bytes; its weights, gathered by FSDP as one unit of their
    own, are gathered twice per pack whatever the uses."""
    plans = {uses: make_plan(load_config(None, _overrides(_checkpoint(tmp_path / str(uses), layers_block_type=kinds),
                                                          "parallel.dp_shard=2", "data.packs_per_step=2")))
             for uses, kinds in ((1, ["mamba", "hybrid"]), (2, ["mamba", "hybrid", "hybrid"]))}
    assert all(isinstance(p, Plan) for p in plans.values())
    one, two = (plans[n].memory.saved_by_kind["shared_block"] for n in (1, 2))
    assert one > 0 and two == 2 * one
    assert plans[1].memory.params.total < plans[2].memory.params.total  # the second use's adapters, linear, Mamba


def test_what_a_zamba2_plan_does_not_price_keeps_the_parameter_share_and_says_why(tmp_path):
    plan = make_plan(load_config(None, _overrides(_checkpoint(tmp_path / "z", tie_word_embeddings=False))))
    assert isinstance(plan, TransformersPlan) and "blocks are not shared" in plan.text()


@pytest.mark.parametrize("targets, more", [
    ([], ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    (["gate_up_proj", "linear", "o_proj"], ["parallel.dp_shard=2", "data.packs_per_step=2"]),
    (["linear", "v_proj"], ["parallel.tp=2", "parallel.sequence_parallel=true"]),
])
def test_the_plan_of_a_zamba2_under_lora_matches_one_measured_step(tmp_path, targets, more):
    """LoRA puts adapters on each use's copy of the shared block (and may on each layer's ``linear``); with the base
    frozen a use keeps only what a gradient into what lies before it needs, and its backward collectives run only
    there: the default targets at tp=2 + SP, and adapters from the first use's o_proj on under FSDP (nothing
    before them trains, so the first use's attention keeps nothing; the copies' adapters gather with the shared
    block's unit, the linear's with its layer's, and only theirs are reduced); and the linear's adapters under SP,
    on each rank's tokens, their gradients summed over TP per pack.
    Before: refused, on the parameter-only plan (its adapters priced as an MLP's: saved 0.71 of the measured); the
    linear's adapters under SP were refused by ``train`` (no LoRA pairing for ``TokenwiseParallel``)."""
    chosen = [f"peft.target_modules=[{','.join(targets)}]"] if targets else []
    overrides = _overrides(_checkpoint(tmp_path / "z", weights=True), "peft.method=lora", *chosen, *more, tokens=1024)
    assert_plan_matches_step(overrides, str(tmp_path / "run"))


def test_the_plan_of_a_zamba2_matches_one_measured_step_at_tp2_with_sp(tmp_path):
    """Under SP the shared block's norms over 2D and D reduce their weight gradients once per block (not
    per use), the linear's ``[D, D]`` once per use, each q/k/v adapter its ``[Tc, r]`` input gradient."""
    overrides = _overrides(_checkpoint(tmp_path / "z", weights=True), "parallel.tp=2", "parallel.sequence_parallel=true",
                           tokens=1024)
    assert_plan_matches_step(overrides, str(tmp_path / "run"))


def test_the_plan_of_a_zamba2_under_fsdp_bf16_matches_one_measured_step(tmp_path):
    """FSDP's bf16 (cp=2: parameters sharded over CP): the 2D norm keeps its input's float32 copy and the
    product cast back, not the 16-bit input."""
    overrides = _overrides(_checkpoint(tmp_path / "z", weights=True), "parallel.cp=2", "parallel.mixed_precision=bf16",
                           tokens=1024)
    assert_plan_matches_step(overrides, str(tmp_path / "run"))


def test_the_plan_of_a_zamba2_under_autocast_matches_one_measured_step(tmp_path):
    """bf16 autocast without FSDP (tp=2): each projection keeps its own bf16 cast of its float32 input, RoPE's
    float32 cos, sin lift q, k and the core's output to float32, and each use keeps bf16 copies of the matrices it
    reads. Before: the plan refused to price it (its saved bytes were 0.78 of the measured)."""
    overrides = _overrides(_checkpoint(tmp_path / "z", weights=True), "parallel.tp=2", "parallel.mixed_precision=bf16",
                           tokens=1024)
    assert_plan_matches_step(overrides, str(tmp_path / "run"))


def test_the_stored_zamba2_cases_hold_their_bands(tmp_path):
    """Every stored ``zamba2`` case of ``benchmarks/results/planner.json``, replanned: parameters and traffic
    exact, saved within 10% and peak within 15% of the measured step."""
    cases = [c for c in json.loads(RESULTS.read_text())["cases"] if c["model"] == "zamba2"]
    assert len(cases) >= 5
    path = _checkpoint(tmp_path / "z")
    for case in cases:
        overrides = [f"model.hf_path={path}" if o.startswith("model.hf_path=") else o for o in case["overrides"]]
        plan, got = predict(overrides), case["measured"]
        where = (case["layout"], case["length"])
        assert plan["parameters_per_rank"] == got["parameters_per_rank"], where
        assert plan["traffic_bytes_per_step_by_dim"] == got["traffic_by_dim"], where
        assert abs(plan["saved_activation_bytes_per_pack"]["total"] / got["saved_bytes"] - 1) <= 0.10, where
        assert abs(plan["peak_memory_gib_per_rank"] / got["tensor_peak_gib"] - 1) <= 0.15, where
