"""No model is packed silently across documents (``train/packing_rule.py``).

The trainer (as ``hybridpar train``, ``check`` and evaluation build it) of tiny float64
checkpoints saved by transformers: Zamba (v1: its per-head Mamba1 layout has no core here) trains one document
per row and says so with the padding it costs; FalconMamba (Mamba1 on hybridpar's selective scan), RecurrentGemma
(its RG-LRU on the same scan), a Granite 4.0-H MoE, a NemotronH with MoE layers (``model.backend=auto``:
the transformers model), LFM2 (short convolutions on hybridpar's document-resetting conv) and a
Qwen3-Next (gated DeltaNet on hybridpar's core) pack several documents, say why that is safe, and
take a float64 step (eager experts);
the Granite MoE at cp=2 (Mamba ``state``, attention ``ulysses``) trains, exports, reloads in
transformers with no missing or unexpected key, and ``hybridpar check`` is exact on its packed rows
(and at tp=2, where its Mamba mixers are sharded by heads, the one B/C group replicated).
``hybridpar check`` is exact in float64 for a Zamba2 whose two hybrid layers reuse one attention block
(tp=2 + SP, cp=2), Falcon-H1 (cp=2), FalconMamba (cp=2, Mamba1 state passing), RecurrentGemma (cp=2, RG-LRU
state passing), Bamba (tp=2 + SP) and Qwen3-Next (cp=2, gated DeltaNet all-to-all and state passing).
Training checkpoints resume at another layout (Granite MoE tp=2 <-> one process; the Zamba2
cp=2 -> tp=2 + SP and one process; LFM2 cp=2 -> tp=2 + SP; Qwen3-Next, Kimi Linear and FalconMamba
tp=2 + SP -> one process): the resumed step's loss is the uninterrupted run's.
The leak probe tells a leaking model from an exact one.
"""

from __future__ import annotations

import contextlib
import io
import shutil

import pytest
import torch

from tests.distributed.harness import run_each, run_ranks
from tests.models.hf.kda_models import CONFIG as KIMI_LINEAR

_C = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
          use_cache=False)
_M = dict(mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)


def _models(hf) -> dict:
    return {
        "qwen3_next": lambda: hf.Qwen3NextForCausalLM(hf.Qwen3NextConfig(
            num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], head_dim=16,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, **_C)),
        "lfm2": lambda: hf.Lfm2ForCausalLM(hf.Lfm2Config(num_hidden_layers=2, layer_types=["conv", "full_attention"], **_C)),
        "kimi_linear": lambda: hf.KimiLinearForCausalLM(hf.KimiLinearConfig(**{**KIMI_LINEAR, "vocab_size": 256})),
        "falcon_mamba": lambda: hf.FalconMambaForCausalLM(hf.FalconMambaConfig(
            num_hidden_layers=2, hidden_size=64, state_size=8, vocab_size=256)),
        "recurrent_gemma": lambda: hf.RecurrentGemmaForCausalLM(hf.RecurrentGemmaConfig(
            num_hidden_layers=3, hidden_size=64, lru_width=64, num_attention_heads=4, num_key_value_heads=1,
            intermediate_size=96, vocab_size=256, attention_window_size=16)),
        "zamba": lambda: hf.ZambaForCausalLM(hf.ZambaConfig(  # one shared attention block on layers 2 and 5
            num_hidden_layers=6, attn_layer_period=3, attn_layer_offset=2, attention_hidden_size=128,
            attention_head_dim=32, n_mamba_heads=2, mamba_d_state=8, mamba_dt_rank=8,
            **{**_C, "num_key_value_heads": 4})),
        "granite_moe": lambda: hf.GraniteMoeHybridForCausalLM(hf.GraniteMoeHybridConfig(
            num_hidden_layers=2, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_expand=1,
            num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64, **_M, **_C)),
        "falcon_h1": lambda: hf.FalconH1ForCausalLM(hf.FalconH1Config(
            num_hidden_layers=2, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_rms_norm=True,
            mamba_norm_before_gate=True, key_multiplier=0.5, **_M, **_C)),
        "bamba": lambda: hf.BambaForCausalLM(hf.BambaConfig(
            num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, **_M, **_C)),
        "zamba2_shared": lambda: hf.Zamba2ForCausalLM(hf.Zamba2Config(
            num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=8,
            n_mamba_heads=8, mamba_ngroups=2, chunk_size=8, num_mem_blocks=1, use_shared_attention_adapter=True,
            adapter_rank=8, use_mem_rope=True, **{**_C, "num_key_value_heads": 4})),
        "nemotron_h_moe": lambda: hf.NemotronHForCausalLM(hf.NemotronHConfig(
            layers_block_type=["mamba", "attention", "moe"], head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
            ssm_state_size=8, n_groups=1, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1, **_C)),
    }


ONE_PER_ROW = ("zamba",)
PACKED = ("granite_moe", "nemotron_h_moe", "zamba2_shared", "lfm2", "qwen3_next", "kimi_linear", "falcon_mamba",
          "recurrent_gemma")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import transformers as hf

    root = tmp_path_factory.mktemp("packing_safety")
    paths = {}
    for name, make in _models(hf).items():
        torch.manual_seed(0)
        make().save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def _trainers(rank, world_size, checkpoints, root):
    from hybridpar.config import load_config
    from hybridpar.train.trainer import Trainer

    results = {}
    for name, path in checkpoints.items():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            trainer = Trainer(load_config(None, [
                f"model.hf_path={path}", "model.dtype=float64", "data.pack_size=128", "data.packs_per_step=1",
                "data.task_options={min_len: 32, max_len: 64, num_kv_pairs: [2, 4]}",
                "tensorboard=false", "plot=false", f"output_dir={root}/{name}"]), torch.device("cpu"))
        docs = [len(p["seq_lens"]) for p in trainer.train_data.pool]
        results[name] = {"one_per_row": trainer.one_per_row, "docs": docs, "out": out.getvalue(),
                         "type": type(trainer.model).__name__}
        if name in PACKED:
            results[name]["loss"] = float(trainer.step_gradients(0))
    return results


def test_models_we_cannot_reset_train_one_document_per_row_and_say_so(checkpoints, tmp_path):
    results = run_ranks(1, _trainers, checkpoints, str(tmp_path), timeout_s=300)[0]
    for name in ONE_PER_ROW:
        result = results[name]
        lines = [line for line in result["out"].splitlines() if line.startswith("packing:")]
        assert result["one_per_row"] and set(result["docs"]) == {1}, (name, result["docs"])
        assert len(lines) == 1 and "one document per row" in lines[0] and "% of the token slots" in lines[0], lines
    assert "model.layers.0.mamba (ZambaMambaMixer)" in results["zamba"]["out"]  # the mixer no core reaches
    assert "selective scan on 2 Mamba1 mixers" in results["falcon_mamba"]["out"]  # models/hf/mixers/mamba1.py
    assert "RG-LRU on 2 recurrent blocks" in results["recurrent_gemma"]["out"]  # models/hf/mixers/rglru.py
    assert "document-resetting conv on 1 short convolutions" in results["lfm2"]["out"]  # LFM2's short convs reset
    assert "gated DeltaNet core on 1 gated DeltaNet layers" in results["qwen3_next"]["out"]  # models/hf/mixers/gdn.py
    for name in PACKED:
        result = results[name]
        assert not result["one_per_row"] and max(result["docs"]) > 1, (name, result["docs"])
        assert "packing: several documents per row; every token mixer resets" in result["out"], result["out"]
        assert "hybridpar's blockwise document-causal core" in result["out"]
        assert result["type"].endswith("ForCausalLM") and torch.isfinite(torch.tensor(result["loss"]))


def _cli_runs(rank, world_size, runs):
    from hybridpar.cli import main

    results = []
    for argv in runs:
        out = io.StringIO()
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            code = main(argv)
        results.append((code, out.getvalue()))
    return results


def test_granite_moe_at_cp2_trains_exports_reloads_and_checks_exact(checkpoints, tmp_path):
    common = [f"model.hf_path={checkpoints['granite_moe']}", "data.pack_size=128", "data.packs_per_step=2",
              "data.task_options={min_len: 32, max_len: 64, num_kv_pairs: [2, 4]}", "parallel.cp=2",
              "tensorboard=false", "plot=false"]
    train = ["train", *common, "train.steps=2", "train.eval_every=0", "checkpoint.every=-1",
             f"output_dir={tmp_path}/run", f"model.export_hf={tmp_path}/export"]
    check = ["check", *common, "model.dtype=float64", "parallel.cp_mamba=state", "parallel.cp_attention=ulysses",
             f"output_dir={tmp_path}/check"]
    tp = [a if a != "parallel.cp=2" else "parallel.tp=2" for a in check[:-3]] + [f"output_dir={tmp_path}/tp"]
    results = run_ranks(2, _cli_runs, [train, check, tp], timeout_s=300)
    (_, train_out), (_, report), (_, tp_report) = results[0]
    assert all(code == 0 for rank in results for code, _ in rank), train_out + report + tp_report
    assert "packing: several documents per row" in report and "check exact" in report, report
    # cp=2 pads documents to 4 (a run at cp=1 pads to 2, so packs other rows): said, with the key that aligns them
    assert "each document padded to a multiple of 4 (2*cp), so a run at another cp packs other rows" in train_out
    assert "a run at another cp" not in tp_report, tp_report
    assert "tp=2" in tp_report and "check exact" in tp_report, tp_report  # Mamba by heads (one B/C group: replicated)
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(f"{tmp_path}/export", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


CHECKED = {  # transformers hybrids whose float64 ``hybridpar check`` runs here (Granite MoE: above)
    # two hybrid layers reusing one attention block (tied parameters: one FSDP unit, re-tied after TP),
    # per-layer adapters, RoPE
    "zamba2_shared": (["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.cp=2", "parallel.cp_mamba=state"]),
    "falcon_h1": (["parallel.cp=2", "parallel.cp_mamba=a2a", "parallel.cp_attention=ulysses"],),
    "bamba": (["parallel.tp=2", "parallel.sequence_parallel=true"],),  # a HybridLM (backend=auto): one B/C group
    "lfm2": (["parallel.cp=2", "parallel.cp_attention=ulysses"],),  # short convs: the halo exchange at cp=2
    "falcon_mamba": (["parallel.cp=2", "parallel.cp_mamba=state"],),  # Mamba1: state passing (context/mamba_state.py)
    "recurrent_gemma": (["parallel.cp=2"],  # RG-LRU: state passing (context/recurrent/rglru.py), local MQA allgather
                        ["parallel.tp=2", "parallel.sequence_parallel=true"]),  # by heads (hf_plans/recurrent_gemma.py)
    # gated DeltaNets on hybridpar's core, all-to-all over heads (parallel/context/recurrent/gdn.py); MoE layers
    "qwen3_next": (["parallel.cp=2", "parallel.cp_mamba=a2a", "parallel.cp_attention=ulysses"],
                   ["parallel.cp=2", "parallel.cp_mamba=state"],
                   ["parallel.tp=2"]),  # gated DeltaNets by heads (parallel/tensor/hf_plans/dense.py: GDNHeadParallel)
}


@pytest.fixture(scope="module")
def checked(checkpoints, tmp_path_factory):
    """Every layout of ``CHECKED`` in one 2-rank launch (``run_each``: one call per model), not one
    launch per model: a rank's first-time costs (imports, DTensor's sharding propagation) come once."""
    root = tmp_path_factory.mktemp("checked")
    names = sorted(CHECKED)
    calls = []
    for name in names:
        common = ["check", f"model.hf_path={checkpoints[name]}", "model.dtype=float64", "data.pack_size=128",
                  "data.packs_per_step=2", "data.task_options={min_len: 32, max_len: 64, num_kv_pairs: [2, 4]}",
                  "tensorboard=false", "plot=false"]
        calls.append(([common + layout + [f"output_dir={root}/{name}-{index}"]
                       for index, layout in enumerate(CHECKED[name])],))
    return {name: ranks[0] for name, ranks in zip(names, run_each(2, _cli_runs, calls, timeout_s=600))}


@pytest.mark.parametrize("name", sorted(CHECKED))
def test_transformers_hybrids_check_exact_in_float64(checked, name):
    """``hybridpar check`` in float64 on packed rows: exact at each layout of ``CHECKED``."""
    assert len(checked[name]) == len(CHECKED[name])
    for code, report in checked[name]:
        assert code == 0 and "check exact" in report and "several documents per row" in report, report[-3000:]


def test_the_leak_probe_sees_a_leak_and_passes_our_cores():
    from hybridpar.models.hf.mixers.mamba2 import install_mamba_core
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.train.packing_rule import leak_probe, packing_problem
    from tests.models.hf.hybrid_models import VOCAB, build_hybrid

    model = build_hybrid("zamba2")
    assert "do not reach" in packing_problem(model)  # its Mamba2 mixers are not switched yet
    assert leak_probe(model, VOCAB) > 1e-6
    install_mamba_core(model)
    use_hybridpar_attention(model)
    assert packing_problem(model) is None
    assert leak_probe(model, VOCAB) < 1e-12


def _losses(rank, world_size, path, directory, layout):
    """Train (or resume) the float64 checkpoint at ``path`` in ``directory`` to step 3, one pack per step,
    saving step 1 only (the one a resume reads); rank 0 returns the step losses. One pack, not two: what a
    resume must restore (weights, optimizer, scheduler, data position) is the same; half the passes."""
    from hybridpar.config import load_config
    from hybridpar.train.trainer import Trainer

    overrides = [f"model.hf_path={path}", "model.dtype=float64", "data.pack_size=128", "data.packs_per_step=1",
                 "data.task_options={min_len: 32, max_len: 64, num_kv_pairs: [2, 4]}", "train.steps=3",
                 "train.log_every=1", "train.eval_every=0", "checkpoint.every=1", "checkpoint.keep=3",
                 f"output_dir={directory}", "tensorboard=false", "plot=false", *layout]
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(load_config(None, overrides), torch.device("cpu"))
        save = trainer.save  # only step 1's checkpoint is ever read: steps 2 and 3 are not written (0.5 s each)
        trainer.save = lambda step: save(step) if step == 1 else None
        history = trainer.fit()
    return [r["loss"] for r in history] if rank == 0 else None


TP2 = ["parallel.tp=2", "parallel.sequence_parallel=true"]
CP2 = ["parallel.cp=2", "parallel.cp_mamba=state"]
RESUMES = [("granite_moe", TP2, []), ("granite_moe", [], TP2), ("zamba2_shared", CP2, TP2), ("zamba2_shared", CP2, []),
           ("lfm2", CP2, TP2), ("qwen3_next", TP2, []), ("kimi_linear", TP2, []), ("falcon_mamba", TP2, [])]


def _label(layout: list[str]) -> str:
    return "-".join(option.split(".")[1].replace("=", "") for option in layout[:1]) or "one"


@pytest.fixture(scope="module")
def resumed_runs(checkpoints, tmp_path_factory):
    """Each first layout's uninterrupted 3-step run, and each of ``RESUMES`` resumed from a copy of it
    that holds only the step-1 checkpoint (as an interruption after step 1 leaves it). Three launches,
    every layout of one world size in one: the 2-rank first runs, then every one-process run (Granite's
    first run, then the resumes), then the 2-rank resumes; no run resumes in the processes that wrote it."""
    root = tmp_path_factory.mktemp("resumes")
    firsts = sorted({(name, _label(first)): first for name, first, _ in RESUMES}.items())
    first_dir = {key: str(root / "-".join(key)) for key, _ in firsts}
    reference = {}

    def run(world_size, runs):
        return [ranks[0] for ranks in run_each(world_size, _losses, [run[1:] for run in runs], timeout_s=600)]

    def resumes(world_size):
        runs = []
        for name, first, then in RESUMES:
            if bool(then) == (world_size == 2):
                directory = root / f"{name}-{_label(first)}-to-{_label(then)}"
                shutil.copytree(first_dir[name, _label(first)], directory,
                                ignore=shutil.ignore_patterns("step_00000002", "step_00000003"))
                runs.append(((name, _label(first), _label(then)), checkpoints[name], str(directory), then))
        return runs

    two = [(key, checkpoints[key[0]], first_dir[key], first) for key, first in firsts if first]
    reference.update(zip([r[0] for r in two], run(2, two)))
    one = [(key, checkpoints[key[0]], first_dir[key], first) for key, first in firsts if not first]
    one_results = run(1, one + (one_resumes := resumes(1)))  # the resumes read only the 2-rank runs' directories
    reference.update(zip([r[0] for r in one], one_results))
    resumed = dict(zip([r[0] for r in one_resumes], one_results[len(one):]))
    two_resumes = resumes(2)
    resumed.update(zip([r[0] for r in two_resumes], run(2, two_resumes)))
    return reference, resumed


@pytest.mark.parametrize("name, first, then", RESUMES,
                         ids=[f"{n}-{_label(f)}-to-{_label(t)}" for n, f, t in RESUMES])
def test_a_transformers_hybrid_resumes_at_another_layout(resumed_runs, name, first, then):
    """Mamba mixers are stored per component at every layout and packed expert weights as one
    process holds them, so a DCP checkpoint resumes at another layout: Granite MoE written at tp=2
    resumes on one process and the other way; a Zamba2 with a shared block (one FSDP unit at cp=2)
    written at cp=2 resumes at tp=2 + SP and on one process; LFM2 (``in_proj`` of its short convs per
    component at every layout) written at cp=2 resumes at tp=2 + SP; Qwen3-Next (gated DeltaNets: ``conv1d``
    per q, k, v at every layout) written at tp=2 + SP resumes on one process, and so do Kimi Linear (its KDA
    ``conv1d`` per q, k, v) and FalconMamba (Mamba1 ``in_proj`` per x, z). Resumed after step 1, steps 2-3
    (step 3 after an update by the restored optimizer) equal the uninterrupted run's (float64)."""
    reference, resumed = resumed_runs
    losses = resumed[name, _label(first), _label(then)]
    assert len(reference[name, _label(first)]) == 3 and len(losses) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[name, _label(first)][1:]),
                               rtol=1e-10, atol=1e-10, msg=f"{name}: {first} -> {then}")
