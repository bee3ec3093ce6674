"""``hybridpar plan`` predicted against one measured training step, per layout, length and policy.

For each model (``tiny``; ``mid``: the ``small`` preset's widths on a 5-block pattern, an 8K
vocabulary and 2 Mamba groups so that tp=2 applies; ``llama``: a small transformers Llama, planned
through its HybridLM twin; ``qwen2``, ``qwen3``: the same widths with Qwen2's q/k/v biases and Qwen3's
per-head q/k norms; ``bamba``, ``nemotron_h``: transformers Mamba2 hybrids with dense MLPs;
``nemotron_h_moe``, ``granitemoehybrid``, ``granitemoehybrid_dense``: with MoE layers, and Granite 4.0-H's
layers without experts; ``granitemoehybrid_aux``: 16 experts and ``output_router_logits`` (the trainer adds the
router's load-balancing loss; ``granitemoehybrid_aux32``: the same with 32 experts, whose FSDP peak
shows a decoder layer gathered as one unit); ``nemotron_h_latent``: ``nemotron_h_moe`` with MoE latent projections (``moe_latent_size``); ``falcon_h1``, ``falcon_h1_norm``: Mamba2 and attention side by side in each layer, one
B/C group and ``y * silu(z)`` (its default), or two groups and its gated norm; ``zamba2``: Mamba2 layers and one
shared attention block reused by two hybrid layers, with per-use adapters; ``+lora``, ``+lora-qv``: LoRA
(r=8) on every linear layer, or on q_proj and v_proj only; ``+lora-experts``: on the stacked experts too), layout
(1 process, cp=2, tp=2, dp_shard=2, cp=2 x tp=2), pack size and activation
checkpointing policy, a fresh set of gloo ranks (``tests/distributed/harness``) runs
``plan/validate.measure_step``: two training steps through ``Trainer.fit`` (the trainer reports
the live-tensor peak of the second, steady-state step: ``tensor_peak_gib`` in metrics.jsonl, from
the CPU allocator's events), a third step under ``CommStats``, and one pack's forward measuring
what it keeps for backward (allocator events; saved-tensor hooks as a cross-check). Next to it
the plan of the same config (``plan/validate.predict`` = ``hybridpar plan --json --target cpu``).
Targets: parameters and bytes per collective kind and mesh dim exact, saved activations within
10%, peak within 15%. Also the planner's own time for ``nemotronh-8b`` at 128K on cp=8, in a
fresh process (``make_plan``'s first call, imports it triggers included, and the whole CLI).

Measurements accumulate in benchmarks/results/planner.json across invocations (a case is
replaced when measured again); the plan side of every stored case is recomputed on each save,
so a change to the planner shows without measuring again (``--replan`` does only that).

    python benchmarks/planner.py                                  # every model at its two lengths, policy none
    python benchmarks/planner.py --models tiny --lengths 4096 16384
    python benchmarks/planner.py --models mid                     # mid at 2048 and 4096
    python benchmarks/planner.py --models llama                   # the transformers Llama at 4096 and 16384
    python benchmarks/planner.py --models qwen2 qwen3 --lengths 4096
    python benchmarks/planner.py --models bamba nemotron_h --lengths 4096
    python benchmarks/planner.py --models nemotron_h_moe granitemoehybrid granitemoehybrid_dense --lengths 2048
    python benchmarks/planner.py --models granitemoehybrid_aux nemotron_h_latent --lengths 2048
    python benchmarks/planner.py --models granitemoehybrid_aux32 --lengths 2048 --layouts cp=2 dp_shard=2 \
        --checkpointing none selective full
    python benchmarks/planner.py --models falcon_h1 falcon_h1_norm --lengths 4096 --checkpointing none selective full
    python benchmarks/planner.py --models zamba2                  # shared blocks reused at two depths, 4096 and 16384
    python benchmarks/planner.py --models zamba2 --lengths 4096 --checkpointing full selective
    python benchmarks/planner.py --models tiny --lengths 4096 --layouts "1 process" "cp=2 x tp=2" \\
        --checkpointing full selective
    python benchmarks/planner.py --models tiny+lora tiny+lora-qv llama+lora-qv bamba+lora nemotron_h+lora-qv --lengths 4096
    python benchmarks/planner.py --models nemotron_h_moe+lora granitemoehybrid+lora falcon_h1+lora falcon_h1_norm+lora-qv \
        --lengths 4096
    python benchmarks/planner.py --models nemotron_h_moe+lora-experts granitemoehybrid+lora-experts --lengths 4096
    python benchmarks/planner.py --replan
    python benchmarks/planner.py --again llama bamba              # every stored case of these models, measured again

Writes benchmarks/results/planner.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

# llama, qwen2, qwen3: transformers {Llama,Qwen2,Qwen3}ForCausalLM (hidden 128, 4 layers, 4 heads / 2 KV heads of 32,
# MLP 384, vocab 256); bamba: the same widths, layers Mamba2 (8 heads of 32, 2 groups, state 16) except layer 1;
# nemotron_h: layers mamba, mlp, attention, mlp, mamba, mlp; nemotron_h_moe: mamba, moe, attention, mlp, mamba, moe
# (4 experts of 96, top 2, shared experts 160); granitemoehybrid(_dense): layers mamba, attention, mamba, mamba (one
# Mamba group), each with 4 experts of 96, top 2 (none) and a shared_mlp of 160. All run on transformers' classes
# (model.backend=transformers) and are planned through their HybridLM twin (plan/hf/twin.py); falcon_h1(_norm): 4
# layers of Mamba2 (8 heads of 32, state 16) beside attention, then a gated MLP, with multipliers, one group and no
# Mamba norm (falcon_h1) or two groups and the gated norm applied before the gate (falcon_h1_norm); each checkpoint is
# written once (seed 0)
MAMBA_HF = ("bamba", "nemotron_h", "nemotron_h_moe", "granitemoehybrid", "granitemoehybrid_dense", "falcon_h1",
            "falcon_h1_norm", "granitemoehybrid_aux", "nemotron_h_latent", "granitemoehybrid_aux32", "zamba2")
HF_MODELS = ("llama", "qwen2", "qwen3", *MAMBA_HF)
CHECKPOINTS = {name: Path(tempfile.gettempdir()) / f"hybridpar-planner-{name}" for name in HF_MODELS}
MODELS = {"tiny": [], "mid": ["model.preset=small", "model.overrides={pattern: M*-M-, vocab_size: 8192, mamba_n_groups: 2}"],
          **{name: [f"model.hf_path={path}"] + (["model.backend=transformers"] if name in MAMBA_HF else [])
             for name, path in CHECKPOINTS.items()}}
# LoRA (peft.method=lora, r=8; plan/lora.py, parallel/comm/grad_flow.py): the default targets (every linear), and
# q_proj, v_proj only (peft's usual choice), where no gradient reaches the first blocks' inputs
QV = "peft.target_modules=[q_proj,v_proj]"
LORA = {"tiny+lora": MODELS["tiny"], "tiny+lora-qv": MODELS["tiny"] + [QV], "llama+lora-qv": MODELS["llama"] + [QV],
        "bamba+lora": MODELS["bamba"], "nemotron_h+lora-qv": MODELS["nemotron_h"] + [QV],
        "nemotron_h_moe+lora": MODELS["nemotron_h_moe"], "granitemoehybrid+lora": MODELS["granitemoehybrid"],
        "falcon_h1+lora": MODELS["falcon_h1"], "falcon_h1_norm+lora-qv": MODELS["falcon_h1_norm"] + [QV],
        "nemotron_h_moe+lora-experts": MODELS["nemotron_h_moe"] + ["peft.target_parameters=[experts.up_proj,experts.down_proj]"],
        "granitemoehybrid+lora-experts": MODELS["granitemoehybrid"] + [
            "peft.target_parameters=[experts.gate_up_proj,experts.down_proj]"]}
MODELS.update({name: overrides + ["peft.method=lora", "peft.r=8"] for name, overrides in LORA.items()})
# mid runs ~30x tiny's flops per token on 2 shared cores: 2048 and 4096 keep a case within minutes
LENGTHS = {"tiny": [4096, 16384], "mid": [2048, 4096], **{name: [4096, 16384] for name in (*HF_MODELS, *LORA)}}
LAYOUTS = {  # name -> (world size, overrides)
    "1 process": (1, ["parallel.cp=1", "parallel.tp=1"]),
    "cp=2": (2, ["parallel.cp=2", "parallel.tp=1"]),
    "tp=2": (2, ["parallel.cp=1", "parallel.tp=2"]),
    "dp_shard=2": (2, ["parallel.cp=1", "parallel.tp=1", "parallel.dp_shard=2"]),
    "cp=2 x tp=2": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
}
POLICIES = ("none", "selective", "full")
NEMOTRON = ["model.preset=nemotronh-8b", "data.pack_size=131072", "parallel.cp=8", "parallel.tp=1"]


def case_overrides(model: str, layout: str, length: int, policy: str = "none") -> list[str]:
    packs = 2 if layout == "dp_shard=2" else 1
    return MODELS[model] + LAYOUTS[layout][1] + [f"data.pack_size={length}", f"data.packs_per_step={packs}",
                                                 f"parallel.activation_checkpointing={policy}"]


MAMBA_WIDTHS = {"bamba": dict(mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=64,
                               attn_layer_indices=[1]),
                "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=16, chunk_size=64,
                                   layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba", "mlp"])}
MAMBA_WIDTHS["nemotron_h_moe"] = {**MAMBA_WIDTHS["nemotron_h"], "n_routed_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 96, "moe_shared_expert_intermediate_size": 160,
                                  "layers_block_type": ["mamba", "moe", "attention", "mlp", "mamba", "moe"]}
GRANITE = dict(intermediate_size=96, shared_intermediate_size=160, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=32,
               mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=64, layer_types=["mamba", "attention", "mamba", "mamba"])
MAMBA_WIDTHS.update(granitemoehybrid={**GRANITE, "num_local_experts": 4}, granitemoehybrid_dense={**GRANITE, "num_local_experts": 0})
# the router's load-balancing loss (output_router_logits; 16 experts make its [T, E] float32 terms visible) and
# NemotronH's MoE latent projections (fc1/fc2_latent_proj, experts at width 64 of 128)
MAMBA_WIDTHS.update(granitemoehybrid_aux={**GRANITE, "num_local_experts": 16, "output_router_logits": True,
                                          "router_aux_loss_coef": 0.01},
                    granitemoehybrid_aux32={**GRANITE, "num_local_experts": 32, "output_router_logits": True,
                                            "router_aux_loss_coef": 0.01},
                    nemotron_h_latent={**MAMBA_WIDTHS["nemotron_h_moe"], "moe_latent_size": 64})
FALCON = dict(mamba_n_heads=8, mamba_d_head=32, mamba_d_ssm=256, mamba_d_state=16, mamba_chunk_size=64,
              ssm_in_multiplier=0.7, key_multiplier=0.5, mlp_multipliers=[1.1, 0.9], ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3])
MAMBA_WIDTHS.update(falcon_h1=FALCON, falcon_h1_norm={**FALCON, "mamba_n_groups": 2, "mamba_rms_norm": True,
                                                      "mamba_norm_before_gate": False})
# zamba2: layers mamba, hybrid, mamba, hybrid (8 Mamba heads of 32, 2 groups, state 16); both hybrid layers run
# one shared block (attention on [T, 2D], 4 heads of 64, RoPE; fused gelu MLP) with per-use q/k/v/MLP adapters of r=8
MAMBA_WIDTHS["zamba2"] = dict(layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], n_mamba_heads=8, mamba_ngroups=2,
                              mamba_d_state=16, chunk_size=64, num_key_value_heads=4, num_mem_blocks=1,
                              use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True)


def hf_checkpoints() -> None:
    """The transformers models' checkpoints at ``CHECKPOINTS`` (written once; the plan reads their config.json)."""
    import torch
    import transformers as hf

    widths = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  num_hidden_layers=4, vocab_size=256)
    for name, path in CHECKPOINTS.items():
        if (path / "config.json").exists():
            continue
        config, model = {"llama": (hf.LlamaConfig, hf.LlamaForCausalLM), "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM),
                         "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM), "bamba": (hf.BambaConfig, hf.BambaForCausalLM),
                         "nemotron_h": (hf.NemotronHConfig, hf.NemotronHForCausalLM),
                         "nemotron_h_moe": (hf.NemotronHConfig, hf.NemotronHForCausalLM),
                         "nemotron_h_latent": (hf.NemotronHConfig, hf.NemotronHForCausalLM),
                         **dict.fromkeys(("granitemoehybrid", "granitemoehybrid_dense", "granitemoehybrid_aux",
                                          "granitemoehybrid_aux32"),
                                         (hf.GraniteMoeHybridConfig, hf.GraniteMoeHybridForCausalLM)),
                         **dict.fromkeys(("falcon_h1", "falcon_h1_norm"), (hf.FalconH1Config, hf.FalconH1ForCausalLM)),
                         "zamba2": (hf.Zamba2Config, hf.Zamba2ForCausalLM)}[name]
        torch.manual_seed(0)
        fields = {**widths, **MAMBA_WIDTHS.get(name, {})}
        if name.startswith("nemotron_h"):  # its layer count is its layer list's
            del fields["num_hidden_layers"]
        if name == "zamba2":  # its attention's head_dim is 2 hidden / heads (it attends over [h, embeddings])
            del fields["head_dim"]
        model(config(**fields)).save_pretrained(path)


def measure_case(model: str, layout: str, length: int, policy: str) -> dict:
    from hybridpar.plan.validate import measure_step
    from tests.distributed.harness import run_ranks

    overrides = case_overrides(model, layout, length, policy)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        got = run_ranks(LAYOUTS[layout][0], measure_step, overrides, root, timeout_s=3600)[0]
    return {"model": model, "layout": layout, "length": length, "checkpointing": policy, "overrides": overrides,
            "measured": got, "wall_s": time.perf_counter() - start}


def compare(case: dict) -> dict:
    """The plan of a stored case next to its measurement."""
    from hybridpar.plan.validate import predict

    plan, got = predict(case["overrides"]), case["measured"]
    kinds: dict[str, int] = {}
    for key, nbytes in got["traffic_by_dim"].items():
        kinds[key.split("/")[0]] = kinds.get(key.split("/")[0], 0) + nbytes
    return {
        "params": [plan["parameters_per_rank"], got["parameters_per_rank"]],
        "traffic_by_kind": [plan["traffic_bytes_per_step"], kinds],
        "traffic_exact": plan["traffic_bytes_per_step_by_dim"] == got["traffic_by_dim"],
        "saved_bytes": [plan["saved_activation_bytes_per_pack"]["total"], got["saved_bytes"]],
        "peak_gib": [plan["peak_memory_gib_per_rank"], got["tensor_peak_gib"]],
        "peak_moment": plan["peak_moment"], "peak_breakdown_gib": plan["peak_breakdown_gib"],
        "rss_peak_gib": got["rss_peak_gib"], "baseline_gib": plan["baseline_gib"],
    }


def plan_timing() -> dict:
    """In a fresh process: the planner's import, its first ``make_plan`` and the best of 3 more."""
    start = time.perf_counter()
    from hybridpar.config import load_config
    from hybridpar.plan import make_plan

    imported = time.perf_counter()
    config = load_config(None, NEMOTRON)
    loaded = time.perf_counter()
    make_plan(config)
    first = time.perf_counter() - loaded
    warm = harness.timed(lambda: make_plan(config), repeats=3, warmup=0)["samples_s"]
    return {"import_s": imported - start, "first_plan_s": first, "warm_plan_s": min(warm)}


def planner_time() -> dict:
    """``make_plan`` for nemotronh-8b in a fresh process (first call, then best of 3), and the CLI."""
    out = harness.run_fresh(plan_timing, threads=1)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hybridpar", "plan", *NEMOTRON], capture_output=True, check=True,
                   env=harness.child_env(threads=1))
    return {**out, "cli_s": time.perf_counter() - start}


def case_key(case: dict) -> tuple:
    return case["model"], case["layout"], case["length"], case.get("checkpointing", "none")


def sort_key(case: dict) -> tuple:
    return sort_key_of(case_key(case))


def sort_key_of(key: tuple) -> tuple:
    model, layout, length, policy = key
    return list(MODELS).index(model), POLICIES.index(policy), length, list(LAYOUTS).index(layout)


def to_markdown(record: dict) -> str:
    t = record["planner"]
    lines = ["# Planner: predicted against measured (CPU, float32, one step)", "",
             "Commands (measurements accumulate; the plan columns are recomputed from the current planner):  "]
    lines += [f"`{c}`  " for c in record["commands"]]
    lines += [f"Last saved: {record['date']}  ", f"Machine: {record['machine']}  ",
              "Measured peak: live tensors of the second training step (`tensor_peak_gib`, CPU allocator events). "
              "Saved: bytes one pack's forward allocates and leaves live for backward (allocator events; under policy "
              "none the saved-tensor hooks agree, column `hooks`; under selective they do not see the outputs the "
              "policy caches, so there `hooks` is only part of it), parameters and FSDP's gathered root excluded. RSS "
              "(with the process baseline) for reference. Targets: params and bytes per kind and mesh dim exact, saved "
              "within 10%, peak within 15%.", "",
             "| model | layout | tokens | ckpt | params (plan = measured) | traffic exact | saved MiB plan / measured "
             "| ratio | hooks MiB | peak MiB plan / measured | ratio | peak at (plan) | RSS GiB | case s |",
             "|" + "---|" * 14]
    for r in sorted(record["cases"], key=sort_key):
        c = r["compare"]
        (sp, sm), (pp, pm) = c["saved_bytes"], c["peak_gib"]
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['length']:,} | {r.get('checkpointing', 'none')} | {c['params'][0]:,} "
            f"{'=' if c['params'][0] == c['params'][1] else '!='} {c['params'][1]:,} | {'yes' if c['traffic_exact'] else 'NO'} "
            f"| {sp / 2**20:,.1f} / {sm / 2**20:,.1f} | {sp / sm:.3f} | {r['measured']['saved_hook_bytes'] / 2**20:,.1f} "
            f"| {pp * 1024:,.1f} / {pm * 1024:,.1f} | {pp / pm:.3f} | {c['peak_moment']} | {c['rss_peak_gib']:.2f} "
            f"| {r['wall_s']:.0f} |")
    lines += ["", f"Planner time for nemotronh-8b, 128K tokens, cp=8, fresh process: first `make_plan` "
              f"{t['first_plan_s']:.2f} s (imports it triggers included), then {t['warm_plan_s']:.3f} s; "
              f"`import hybridpar.plan` {t['import_s']:.2f} s; whole `hybridpar plan` command {t['cli_s']:.2f} s "
              "(machine shared, see the date)."]
    return "\n".join(lines) + "\n"


def load() -> dict:
    path = harness.RESULTS / "planner.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    cases = [c for c in record.get("cases", []) if "measured" in c]  # older records kept no raw measurement
    return {"commands": record.get("commands", []), "cases": cases}


def save(record: dict) -> None:
    for case in record["cases"]:
        case["compare"] = compare(case)
    env = harness.environment(__file__)
    record.update(date=env["date"], machine=f"{platform.node()}, {env['cpus']} CPUs (shared), torch {env['torch']}")
    harness.write_results("planner", record, to_markdown(record), echo=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--lengths", nargs="+", type=int, help="pack sizes (default: each model's two, LENGTHS)")
    parser.add_argument("--checkpointing", nargs="+", default=["none"], choices=POLICIES)
    parser.add_argument("--replan", action="store_true", help="only recompute the plan side of the stored cases")
    parser.add_argument("--again", nargs="+", choices=list(MODELS), metavar="MODEL",
                        help="measure every stored case of these models again (after a change to what they keep)")
    args = parser.parse_args()
    hf_checkpoints()
    record = load()
    command = "python benchmarks/planner.py " + " ".join(f'"{a}"' if " " in a else a for a in sys.argv[1:])
    record["commands"] = [c for c in record["commands"] if c != command] + [command]
    record["planner"] = planner_time()
    if args.again:
        todo = sorted({case_key(c) for c in record["cases"] if c["model"] in args.again}, key=sort_key_of)
    elif args.replan:
        todo = []
    else:
        todo = [(model, layout, length, policy) for model in args.models for policy in args.checkpointing
                for length in args.lengths or LENGTHS[model] for layout in args.layouts]
    for model, layout, length, policy in todo:
        case = measure_case(model, layout, length, policy)
        record["cases"] = [c for c in record["cases"] if case_key(c) != case_key(case)] + [case]
        save(record)  # after every case: a long run stopped early keeps what it measured
        print(json.dumps({**case, "compare": compare(case)}), flush=True)
    save(record)
    print(to_markdown(record))


if __name__ == "__main__":
    main()
