"""Round 21 of fault hunting (docs/reliability.md, "Round 21"): parallel layouts at their edges (degrees that do not
divide the model's heads, groups or the pack; odd context-parallel sizes; sequence parallelism over tiny packs) for
HybridLM presets and transformers models, through ``train --dry-run``, ``plan`` and ``check``."""

from __future__ import annotations

import pytest

from tests.train.fault_probes import cli, one_line, refusal_line

TINY = ["model.preset=tiny", "train.steps=1", "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny float64 transformers checkpoints with 6 heads (vocabulary 97): a Llama (2 KV heads) and a Falcon-H1 (6
    Mamba heads in 2 groups), by name."""
    import transformers as hf

    from tests.models.hf.hybrid_models import _C, _M
    from tests.models.hf.tiny import perturbed_float64

    folder = tmp_path_factory.mktemp("six_heads")
    builders = {
        "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(
            hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
            num_hidden_layers=1, vocab_size=97, use_cache=False)),
        "falcon_h1": lambda: hf.FalconH1ForCausalLM(hf.FalconH1Config(
            num_hidden_layers=1, mamba_n_heads=6, mamba_d_head=16, mamba_d_ssm=96, **_M, **_C)),
    }

    def save(name: str):
        path = folder / name
        if not path.exists():
            perturbed_float64(builders[name]).save_pretrained(path)
        return path
    return save


@pytest.mark.parametrize("name, layout, said", [
    ("llama", ["parallel.cp=4", "parallel.cp_attention=ulysses"], "6 query heads (per tensor-parallel rank) are not "
                                                                  "divisible by cp=4"),
    ("falcon_h1", ["parallel.cp=4", "parallel.cp_mamba=a2a"], "6 heads (per tensor-parallel rank) are not divisible by "
                                                              "cp=4"),
    ("falcon_h1", ["parallel.cp=3", "parallel.cp_mamba=a2a", "data.pack_size=66"], "n_groups=2 and cp=3"),
])
def test_a_transformers_models_heads_are_held_to_cp_before_any_process_starts(saved, tmp_path, name, layout, said):
    """Before: the launcher, ``--dry-run`` and ``plan`` checked a transformers model's attention and Mamba heads against
    a context-parallel core of size 1 (a core with no group), so ``cp=4`` ulysses over a Llama's 6 heads, or ``a2a`` over
    a Falcon-H1's 6 Mamba heads, said "config and layout valid"; every rank then built the model and stopped with a
    message naming no ``parallel.*`` key (and ``plan`` of the first was an AssertionError)."""
    run = [f"model.hf_path={saved(name)}", "model.dtype=float64", "data.pack_size=64", f"output_dir={tmp_path}",
           "train.steps=1", *layout]
    cp = layout[0].split("=")[1]
    code, output = cli("train", "--dry-run", "--nproc-per-node", cp, *run)
    assert code == 2 and refusal_line(output).startswith(f"hybridpar: error: parallel.cp={cp}: "), output
    assert said in output
    code, output = cli("plan", *run)
    assert code == 2 and said in refusal_line(output), output
    layout[1] = layout[1].replace("ulysses", "allgather").replace("a2a", "state")  # the strategy the message names
    code, output = cli("train", "--dry-run", "--nproc-per-node", cp, *run[:-len(layout)], *layout)
    assert code == 0, output


def test_a_sequence_parallel_pack_that_tp_does_not_split_is_refused_before_any_process_starts(tmp_path):
    """Before: ``data.pack_size=66`` at ``tp=4`` with ``sequence_parallel=true`` passed ``--dry-run`` and ``plan``
    (66 is a multiple of the document padding 2*cp=2) and every rank stopped after building the model with "sequence
    length 66 gives 66 tokens per context-parallel rank ... pad S ... (packed: extend the last document's padding ...)",
    a fix no config key makes."""
    layout = ["parallel.tp=4", "parallel.sequence_parallel=true", f"output_dir={tmp_path}",
              "model.overrides={mamba_n_groups: 4, num_key_value_heads: 4}"]
    for pack_size, fix in [(66, 68), (6, 8)]:
        code, output = cli("train", "--dry-run", "--nproc-per-node", "4", *TINY, *layout, f"data.pack_size={pack_size}")
        line = refusal_line(output)
        assert code == 2 and f"data.pack_size={pack_size} gives {pack_size} tokens per context-parallel rank" in line
        assert f"use data.pack_size={fix}" in line and "parallel.sequence_parallel=false" in line, line
        code, output = cli("plan", *TINY, *layout, f"data.pack_size={pack_size}")
        assert code == 2 and "cannot split evenly over parallel.tp=4" in output, output
    code, output = cli("train", "--dry-run", "--nproc-per-node", "6", *TINY, "parallel.tp=3", "parallel.cp=2",
                       "parallel.sequence_parallel=true", "data.pack_size=68", f"output_dir={tmp_path}",
                       "model.overrides={mamba_num_heads: 6, mamba_n_groups: 3, num_attention_heads: 3, "
                       "num_key_value_heads: 3, intermediate_size: 129}")
    assert code == 2 and "34 tokens per context-parallel rank (cp=2)" in output and "data.pack_size=72" in output, output
    for pack_size in (68, 8):  # whole tokens on every rank: accepted
        code, output = cli("train", "--dry-run", "--nproc-per-node", "4", *TINY, *layout, f"data.pack_size={pack_size}")
        assert code == 0, output


@pytest.mark.parametrize("model", [
    ["parallel.cp_attention=ulysses", "parallel.cp_mamba=state", "model.overrides={num_attention_heads: 6, "
                                                                 "num_key_value_heads: 3}"],
    ["parallel.cp_attention=ulysses", "parallel.cp_mamba=state", "model.overrides={num_attention_heads: 6, "
                                                                 "num_key_value_heads: 2}"],
    ["parallel.cp_attention=ulysses", "parallel.cp_mamba=state", "model.overrides={pattern: 'M-M-'}"],
], ids=["kv3", "kv2-repeated", "no-attention"])
def test_plan_prices_ulysses_at_an_odd_cp_and_without_attention(model):
    """Before: ``hybridpar plan`` at ``cp=3`` with ulysses was a bare AssertionError traceback: the tally floors each
    head's bytes (a third of a byte lost per head) and was held equal to the closed form's float; and a model without
    an attention block (``pattern: 'M-M-'``) with ulysses was "KeyError: ('all_to_all', 'cp')" (``train`` takes both)."""
    code, output = cli("plan", *TINY, "data.pack_size=66", "parallel.cp=3", *model)
    assert code == 0 and "per step" in output, output


def test_check_of_a_step_with_no_labelled_token_is_one_line(tmp_path):
    """Before: ``hybridpar check data.pack_size=8`` (MQAR documents cut into pieces without an answer) was "TypeError:
    unsupported operand type(s) for -: 'NoneType' and 'Tensor'", a traceback from comparing a loss that does not
    exist; training skips such a step with a notice."""
    code, output = cli("check", *TINY, "model.dtype=float64", "data.pack_size=8", f"output_dir={tmp_path}")
    line = refusal_line(output)
    assert code == 2 and "hold no labelled token" in line and "use a larger data.pack_size" in line, output
    assert "Traceback" not in output


def test_a_parallel_setting_the_layout_never_uses_is_said(tmp_path):
    """Before: ``parallel.sequence_parallel=true`` at ``tp=1``, and ``parallel.cp_attention=ulysses`` or
    ``parallel.cp_mamba=state`` at ``cp=1``, trained without a word, and ``check`` printed ``sp=True`` of a layout
    without sequence parallelism, as if it had proven it."""
    base = ["--dry-run", *TINY, "data.pack_size=64", f"output_dir={tmp_path}"]
    code, output = cli("train", *base, "parallel.sequence_parallel=true", "parallel.cp_attention=ulysses",
                       "parallel.cp_mamba=state")
    assert code == 0 and "parallel.sequence_parallel=true is not used" in output, output
    assert "parallel.cp_attention='ulysses' and parallel.cp_mamba='state' are not used" in output, output
    code, output = cli("check", *base, "parallel.cp_attention=ring")
    assert code == 0 and "parallel.cp_attention='ring' is not used" in output, output
    code, output = cli("train", *base, "--nproc-per-node", "4", "parallel.tp=2", "parallel.cp=2",
                       "parallel.sequence_parallel=true", "parallel.cp_attention=ring")
    assert code == 0 and "not used" not in output, output


def test_plan_fit_lists_no_cp_strategy_a_transformers_models_heads_refuse(saved):
    """Before: ``plan --fit`` checked a layout's other CP strategies with the HybridLM rules only, so for a Llama of 6
    heads it listed ``cp=4`` with ulysses among the layouts that fit, a layout every rank then refused."""
    import json

    code, output = cli("plan", "--fit", "80", "--world-size", "4", "--json", f"model.hf_path={saved('llama')}",
                       "data.pack_size=64", "parallel.cp_attention=ulysses")
    assert code == 0, output
    found = json.loads(output[output.index("{"):])
    ulysses = [c for kind in ("fitting", "failing") for c in found[kind]
               if c["parallel"]["cp"] == 4 and c["parallel"]["cp_attention"] == "ulysses"]
    assert ulysses and all("6 query heads" in c.get("refused", "") for c in ulysses), ulysses


def test_plan_of_a_resharding_group_names_the_key():
    """Before: ``plan parallel.reshard_after_forward=2`` (a layout ``train`` takes) was refused with "closed forms cover
    reshard_after_forward true or false, not a resharding group size.", naming no key and no way on."""
    code, output = cli("plan", *TINY, "data.pack_size=64", "parallel.dp_shard=2", "data.packs_per_step=2",
                       "parallel.reshard_after_forward=2")
    line = refusal_line(output)
    assert code == 2 and "parallel.reshard_after_forward=2" in line and "plan both" in line, output


def test_a_moe_config_routing_to_more_experts_than_it_has_is_one_line(tmp_path):
    """Before: a Qwen3-MoE ``config.json`` with ``num_experts_per_tok=3`` over ``num_experts=2`` passed ``--dry-run`` and
    the first forward was torch's "selected index k out of range" traceback (``generate`` likewise). A dense Granite
    (``num_local_experts=0`` beside the default ``num_experts_per_tok``) is not a MoE and is left alone."""
    import json

    import transformers as hf

    path = tmp_path / "qwen3moe"
    hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(
        hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_experts=2, num_experts_per_tok=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_hidden_layers=1, vocab_size=97)).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 3}))
    code, output = cli("train", "--dry-run", f"model.hf_path={path}", "data.pack_size=64", f"output_dir={tmp_path / 'run'}")
    assert code == 2 and "num_experts_per_tok=3 must be in [1, 2]" in refusal_line(output), output
    code, output = cli("generate", "--hf-path", str(path), "--prompt", "hi", "--max-new-tokens", "1", "--tokenizer", "bytes")
    assert code == 2 and "num_experts_per_tok=3 must be in [1, 2]" in refusal_line(output), output
    from hybridpar.models.hf.generation_config import config_vocab_problem

    assert config_vocab_problem({"num_local_experts": 0, "num_experts_per_tok": 2}, "config.json") is None


def test_compiled_selective_checkpointing_holds_back_dynamos_advice_on_each_rank():
    """Before: ``parallel.compile=aot_eager parallel.activation_checkpointing=selective`` printed dynamo's 4 raw log
    lines per rank ("[rank0]:W... Detected that context_fn is passed to torch.utils.checkpoint under torch.compile.
    Please make sure the checkpointed region does not contain in-place ops") about hybridpar's own policy, whose
    layouts ``check`` holds to one process (exact at cp=2)."""
    import logging

    import torch

    from hybridpar import HybridConfig, HybridLM
    from hybridpar.parallel.checkpointing import apply_activation_checkpointing
    from hybridpar.parallel.compiled_blocks import apply_compile

    logger = logging.getLogger("torch._higher_order_ops.wrap")
    level = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        model = apply_activation_checkpointing(HybridLM(HybridConfig.from_preset("tiny", dtype=torch.float64)), "none")
        apply_compile(model, backend="aot_eager")
        assert logger.getEffectiveLevel() < logging.ERROR  # no selective block: left alone
        model = apply_activation_checkpointing(HybridLM(HybridConfig.from_preset("tiny", dtype=torch.float64)),
                                               "selective")
        apply_compile(model, backend="aot_eager")
        assert logger.getEffectiveLevel() == logging.ERROR
    finally:
        logger.setLevel(level)
        torch._dynamo.reset()


@pytest.mark.parametrize("pattern", ["-", "*"])
def test_plan_of_a_model_without_mamba_blocks_ignores_the_mamba_groups_tp_cannot_split(pattern):
    """Before: ``plan parallel.tp=4 parallel.cp=2`` of a preset whose pattern holds no Mamba block (its unused
    ``mamba_n_groups=2`` not divisible by 4) was a ZeroDivisionError traceback; ``train`` takes the layout."""
    run = [*TINY, "data.pack_size=64", "parallel.tp=4", "parallel.cp=2",
           f"model.overrides={{pattern: '{pattern}', num_attention_heads: 4, num_key_value_heads: 4}}"]
    code, output = cli("plan", *run)
    assert code == 0 and "per step" in output, output
    code, output = cli("train", "--dry-run", "--nproc-per-node", "8", *run, "output_dir=unused-r21")
    assert code == 0, output


def test_heads_tp_cannot_split_are_named_by_tp_under_cp_too(saved, tmp_path):
    """Before: a Llama of 6 heads (2 KV heads) at ``tp=4`` with ``cp=2`` was told "query heads 1 must be a positive
    multiple of kv heads 2 (grouped-query attention)" by the context-parallel check, which ran before the TP rules;
    at ``cp=1`` the same layout names ``parallel.tp=4`` and the heads it does not divide."""
    run = [f"model.hf_path={saved('llama')}", "data.pack_size=64", f"output_dir={tmp_path}", "parallel.tp=4"]
    for cp in (1, 2):
        code, output = cli("train", "--dry-run", "--nproc-per-node", str(4 * cp), *run, f"parallel.cp={cp}")
        line = refusal_line(output)
        assert code == 2 and line.startswith("hybridpar: error: parallel.tp=4: "), output
        assert "num_attention_heads=6 is not divisible by tp=4" in line, line


def test_plan_names_its_world_size_flag_when_the_layout_does_not_fit_it():
    """Before: ``plan --world-size 4 parallel.cp=2`` said "... = 2, but the world size is 4; choose degrees whose
    product is 4 (e.g. dp_shard=2)", naming neither the flag nor the ``parallel.*`` key, where ``train`` names
    ``--nproc-per-node``."""
    code, output = cli("plan", "--world-size", "4", *TINY, "data.pack_size=64", "parallel.cp=2")
    line = refusal_line(output)
    assert code == 2 and "--world-size 4 does not fit the layout dp_replicate*dp_shard*cp*tp = 1*1*2*1 = 2" in line
    assert "pass --world-size 2" in line, line
    code, output = cli("plan", "--world-size", "2", *TINY, "data.pack_size=64", "parallel.cp=2")
    assert code == 0, output


def test_an_expert_parallel_degree_is_told_how_experts_are_split():
    """Before: ``parallel.ep=2`` was "unknown config key(s) ['parallel.ep']; did you mean parallel.tp?", which reads as a
    misspelling; hybridpar has no expert parallelism, and the message now says how experts are split instead."""
    code, output = cli("train", "--dry-run", *TINY, "parallel.ep=2")
    line = refusal_line(output)
    assert code == 2 and "['parallel.ep']; hybridpar has no expert parallelism: parallel.tp splits every expert" in line


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_compiled_checkpointed_blocks_at_tp_are_accepted(saved, tmp_path, policy):
    """Before: ``parallel.tp=2 parallel.compile=aot_eager parallel.activation_checkpointing=selective`` (or full) passed
    every check and trained, but no Mamba2 mixer parameter ever received a gradient (``check``: 14 of 33 quantities
    without one, a KeyError traceback), and neither did a Qwen3-MoE's grouped experts; round 21 refused the pair for
    such models. The cause (a recomputation stopped before the TP hook that puts the swapped parameters back,
    ``compiled_blocks.py``) is fixed, the numbers are held in ``tests/distributed/test_compile.py``, and the pair is
    accepted for every model again."""
    import transformers as hf

    moe = tmp_path / "qwen3moe"
    hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(
        hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_experts=2, num_experts_per_tok=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_hidden_layers=1, vocab_size=97)).save_pretrained(moe)
    base = ["--dry-run", "--nproc-per-node", "2", *TINY, "data.pack_size=64", f"output_dir={tmp_path / 'run'}",
            "parallel.compile=aot_eager", "parallel.tp=2", f"parallel.activation_checkpointing={policy}"]
    for model in (["model.preset=tiny"], [f"model.hf_path={saved('falcon_h1')}"], [f"model.hf_path={moe}"],
                  [f"model.hf_path={saved('llama')}"]):
        code, output = cli("train", *base, *model)
        assert code == 0, output


def test_check_names_a_gradient_the_layout_never_produced(monkeypatch, tmp_path):
    """Before: a parameter with a gradient in the one-process step but none under the layout (compiled, checkpointed
    Mamba blocks at tp=2, above) stopped ``check`` with "KeyError: 'backbone.layers.0.mixer.dt_bias'"; it is a FAIL
    row of its own now."""
    import hybridpar.train.proof.layout as layout

    real, calls = layout.canonical_state_dict, []

    def parallel_without_dt_bias(model, grads=False):
        state = real(model, grads=grads)
        calls.append(1)
        return {k: v for k, v in state.items() if k != "backbone.layers.0.mixer.dt_bias"} if len(calls) == 1 else state
    monkeypatch.setattr(layout, "canonical_state_dict", parallel_without_dt_bias)
    code, output = cli("check", *TINY, "model.dtype=float64", "data.pack_size=64", f"output_dir={tmp_path}")
    assert code == 1 and "grad backbone.layers.0.mixer.dt_bias (none under the layout)" in output, output
    assert "FAILED: 1 of" in output and "KeyError" not in output, output


def test_validate_parallelize_holds_a_hybridlms_heads_to_the_cp_strategies():
    """Before: ``validate_parallelize`` (the API's check without a mesh) passed a HybridLM whose 4 query heads ulysses
    cannot split over cp=8; only ``parallelize`` raised, once the mesh existed. ``train`` checked it already."""
    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import validate_parallelize

    model = HybridLM(HybridConfig.from_preset("tiny"))
    with pytest.raises(ValueError) as error:
        validate_parallelize(model, ParallelDims(cp=8), cp_attention_strategy="ulysses", cp_mamba_strategy="state")
    assert one_line(error).startswith("module 'backbone.layers.1.mixer' at tp=1, cp=8: ulysses attention splits query heads"), error
    validate_parallelize(model, ParallelDims(cp=4), cp_attention_strategy="ulysses", cp_mamba_strategy="state")
