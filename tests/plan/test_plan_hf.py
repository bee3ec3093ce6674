"""``hybridpar plan`` of a transformers decoder through its HybridLM twin (``plan/hf/twin.py``).

A Llama checkpoint is priced as pattern ``*-`` per layer, with transformers' extra norm products where its
own norms run (sequence parallelism; elsewhere hybridpar's lean norm runs in their place);
its plan is held to one measured training step as the HybridLM's is (``test_plan_measured.py``):
parameters and traffic exact, saved activations within 10%, peak within 15%, on one process, at
cp=2, tp=2 and tp=2 + SP, 1024 tokens per pack (each model's weights saved once for the module).
Exact TP traffic also holds two fixes: without SP, q, k, v (gate, up)
read one replicated norm output and all-reduce their input gradient once, not once each; the loss
seam hands lm_head no position, detached, so no logits are gathered and no zero gradient of the
whole hidden state is all-reduced. Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms: their
gradients all-reduced over TP, their float32 products kept) have twins too, as have transformers'
Bamba and dense NemotronH (``model.backend=transformers``: the pattern their checkpoints load as
natively; their gated norms, of Bamba's form, run hybridpar's); Qwen3 and Bamba are held to a measured step at
tp=2 + SP, Bamba under selective checkpointing and NemotronH at tp=2 without SP (where their norm
output is shared as a Llama's; ``benchmarks/planner.py`` measures every layout). A model without a twin keeps its
parameter share and says why; ``--fit`` refuses it in one line. Before, every
transformers model was planned without activations, and ``plan --fit`` of one (or of a HybridLM
without Mamba blocks at cp > 1) ended in a traceback.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridpar.config import ConfigError, load_config
from hybridpar.plan import make_plan
from hybridpar.plan.planner import Plan, TransformersPlan
from hybridpar.plan.report import plan_dict, plan_text
from hybridpar.plan.search import search_layouts
from tests.plan.step_check import assert_plan_matches_step

WIDTHS = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              num_hidden_layers=4, vocab_size=256)

MAMBA = {"bamba": dict(mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=64,
                       attn_layer_indices=[1]),
         "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=16, chunk_size=64,
                            num_hidden_layers=4, layers_block_type=["mamba", "mlp", "attention", "mlp"])}
BACKEND = {"bamba": ["model.backend=transformers"], "nemotron_h": ["model.backend=transformers"]}


def _checkpoint(path, name: str = "llama", weights: bool = False) -> str:
    import transformers as hf

    config_class, model_class = {"llama": (hf.LlamaConfig, hf.LlamaForCausalLM),
                                 "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM),
                                 "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM),
                                 "gemma": (hf.GemmaConfig, hf.GemmaForCausalLM),
                                 "bamba": (hf.BambaConfig, hf.BambaForCausalLM),
                                 "nemotron_h": (hf.NemotronHConfig, hf.NemotronHForCausalLM)}[name]
    config = config_class(**{**WIDTHS, **MAMBA.get(name, {})})
    if weights:
        torch.manual_seed(0)
        model_class(config).save_pretrained(path)
    else:  # config.json only: what the planner reads
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": [model_class.__name__]}))
    return str(path)


def test_a_llama_is_planned_through_its_twin_with_exact_parameters(tmp_path):
    import transformers as hf

    path = _checkpoint(tmp_path / "llama")
    plan = make_plan(load_config(None, [f"model.hf_path={path}", "data.pack_size=4096"]))
    assert isinstance(plan, Plan) and plan.layout.hf_decoder and plan.layout.model.pattern == "*-" * 4
    assert plan.memory.params.total == sum(p.numel() for p in hf.LlamaForCausalLM(hf.LlamaConfig(**WIDTHS)).parameters())
    assert plan_text(plan).startswith("model: LlamaForCausalLM (transformers; planned as its HybridLM twin")
    assert plan_dict(plan)["model"]["transformers"].startswith("LlamaForCausalLM")
    twin = make_plan(load_config(None, ["data.pack_size=4096", "model.overrides={pattern: '*-*-*-*-', hidden_size: 128, "
                                        "intermediate_size: 384, num_attention_heads: 4, num_key_value_heads: 2, "
                                        "head_dim: 32, vocab_size: 256, mlp_gated: true, mlp_activation: silu}"]))
    # its RMSNorms run ours (models/hf/activations.use_lean_rms_norms), not transformers', which keep float32 products;
    # its cos, sin [T, 32] are computed once for the 4 layers, HybridLM's in each attention layer
    cos_sin = 4096 * 2 * 32 * 4
    assert plan.memory.saved_bytes == twin.memory.saved_bytes - 3 * cos_sin and plan.layout.model.lean_norms


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_qwen2_biases_and_qwen3_head_norms_are_counted_on_the_twin(tmp_path, name):
    import transformers as hf

    plan = make_plan(load_config(None, [f"model.hf_path={_checkpoint(tmp_path / name, name)}", "data.pack_size=4096"]))
    model = {"qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**WIDTHS)),
             "qwen3": lambda: hf.Qwen3ForCausalLM(hf.Qwen3Config(**WIDTHS))}[name]()
    assert isinstance(plan, Plan) and plan.memory.params.total == sum(p.numel() for p in model.parameters())
    llama = make_plan(load_config(None, [f"model.hf_path={_checkpoint(tmp_path / 'llama')}", "data.pack_size=4096"]))
    grows = plan.memory.saved_bytes > llama.memory.saved_bytes  # Qwen3's head norms keep their inputs and products
    assert grows == (name == "qwen3")


@pytest.mark.parametrize("name, pattern", [("bamba", "M-*-M-M-"), ("nemotron_h", "M-*-")])
def test_transformers_mamba2_hybrids_are_planned_on_their_layer_pattern(tmp_path, name, pattern):
    import transformers as hf

    path = _checkpoint(tmp_path / name, name)
    plan = make_plan(load_config(None, [f"model.hf_path={path}", "data.pack_size=4096", *BACKEND[name]]))
    model = hf.AutoModelForCausalLM.from_config(hf.AutoConfig.from_pretrained(path))
    assert isinstance(plan, Plan) and plan.layout.model.pattern == pattern
    assert plan.memory.params.total == sum(p.numel() for p in model.parameters())
    assert f"planned as its HybridLM twin, pattern '{pattern}'" in plan_text(plan)


def test_a_model_without_a_twin_keeps_its_parameter_share_and_fit_refuses_it_in_one_line(tmp_path):
    path = _checkpoint(tmp_path / "gemma", "gemma")
    config = load_config(None, [f"model.hf_path={path}", "data.pack_size=4096"])
    plan = make_plan(config)
    assert isinstance(plan, TransformersPlan) and "llama, mistral, qwen2, qwen3" in plan.text()
    with pytest.raises(ConfigError, match=r"^plan --fit needs every layout's activations, and for GemmaForCausalLM "
                                          r"activations and traffic are modelled for HybridLM and llama, mistral, "
                                          r"qwen2, qwen3[^\n]*$"):
        search_layouts(config, 2, 80.0)


def test_fit_searches_a_llama_and_an_attention_only_hybridlm_with_one_mamba_strategy(tmp_path):
    path = _checkpoint(tmp_path / "llama")
    for overrides in ([f"model.hf_path={path}"], ["model.overrides={pattern: '*-*-'}"]):
        candidates = search_layouts(load_config(None, overrides + ["data.pack_size=4096"]), 2, 80.0)
        planned = [c for c in candidates if c.plan is not None]
        assert any(c.parallel["cp"] == 2 for c in planned)  # cp=2 priced: no Mamba traffic to count
        assert all(c.parallel["cp_mamba"] == "a2a" for c in candidates)


CASES = {"1 process": (1, []), "cp=2": (2, ["parallel.cp=2"]), "tp=2": (2, ["parallel.tp=2"]),
         "tp=2 + SP": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
         "tp=2 selective": (2, ["parallel.tp=2", "parallel.activation_checkpointing=selective"])}
# Bamba and NemotronH at tp=2 without SP: q, k, v (Bamba's gate, up) read one replicated norm output and
# all-reduce their input gradient once (they did once each: 2 and 6 [Tc, D] more than the plan at 4 layers)
HYBRIDS_TP = [("bamba", "tp=2 selective"), ("nemotron_h", "tp=2")]
PACK = 1024  # tokens per pack (2048 until the suite trim measured the same paths at twice the tokens)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Each model's weights saved once for the module (read-only to the runs; each run writes its own directory)."""
    root = tmp_path_factory.mktemp("hf_checkpoints")
    return {model: _checkpoint(root / model, model, weights=True) for model in ("llama", "qwen3", "bamba", "nemotron_h")}


@pytest.mark.parametrize("model, name", [("llama", c) for c in sorted(CASES) if c != "tp=2 selective"]
                         + [("qwen3", "tp=2 + SP"), ("bamba", "tp=2 + SP")] + HYBRIDS_TP)
def test_the_plan_of_a_transformers_decoder_matches_one_measured_step(tmp_path, checkpoints, model, name):
    world, layout = CASES[name]
    overrides = [f"model.hf_path={checkpoints[model]}", *BACKEND.get(model, []), f"data.pack_size={PACK}",
                 "data.packs_per_step=1", *layout]
    assert_plan_matches_step(overrides, str(tmp_path / "run"), world)
