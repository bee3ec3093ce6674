"""``hybridpar plan`` predicted against one measured training step, per layout and length.

For each model (``tiny``; ``mid``: the ``small`` preset's widths on a 5-block pattern and an 8K
vocabulary) and layout (1 process, cp=2, tp=2, dp_shard=2, cp=2 x tp=2) and pack size, a fresh
set of gloo ranks (``tests/distributed/harness``) runs ``plan/validate.measure_step``: two
training steps through ``Trainer.fit`` (the trainer reports the live-tensor peak of the second,
steady-state step: ``tensor_peak_gib`` in metrics.jsonl, from the CPU allocator's events), a
third step under ``CommStats``, and one pack's forward under saved-tensor hooks. Next to it the
plan of the same config (``plan/validate.predict`` = ``hybridpar plan --json --target cpu``).
Targets: parameters and bytes per collective kind exact, saved activations within 10%, peak
within 15%. Also the planner's own time for ``nemotronh-8b`` (meta model included).

    python benchmarks/planner.py                       # everything (long on a loaded 2-core machine)
    python benchmarks/planner.py --models tiny --lengths 4096 16384

Writes benchmarks/results/planner.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
MODELS = {"tiny": [], "mid": ["model.preset=small", "model.overrides={pattern: M*-M-, vocab_size: 8192}"]}
LAYOUTS = {  # name -> (world size, overrides)
    "1 process": (1, ["parallel.cp=1", "parallel.tp=1"]),
    "cp=2": (2, ["parallel.cp=2", "parallel.tp=1"]),
    "tp=2": (2, ["parallel.cp=1", "parallel.tp=2"]),
    "dp_shard=2": (2, ["parallel.cp=1", "parallel.tp=1", "parallel.dp_shard=2"]),
    "cp=2 x tp=2": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
}


def case_overrides(model: str, layout: str, length: int) -> list[str]:
    packs = 2 if layout == "dp_shard=2" else 1
    return MODELS[model] + LAYOUTS[layout][1] + [f"data.pack_size={length}", f"data.packs_per_step={packs}"]


def run_case(model: str, layout: str, length: int) -> dict:
    from hybridpar.plan.validate import measure_step, predict
    from tests.distributed.harness import run_ranks

    overrides = case_overrides(model, layout, length)
    with tempfile.TemporaryDirectory() as root:
        got = run_ranks(LAYOUTS[layout][0], measure_step, overrides, root, timeout_s=3600)[0]
    plan = predict(overrides)
    kinds: dict[str, int] = {}
    for key, nbytes in got["traffic_by_dim"].items():
        kinds[key.split("/")[0]] = kinds.get(key.split("/")[0], 0) + nbytes
    return {
        "model": model, "layout": layout, "length": length, "overrides": overrides,
        "params": [plan["parameters_per_rank"], got["parameters_per_rank"]],
        "traffic_by_kind": [plan["traffic_bytes_per_step"], kinds],
        "traffic_exact": plan["traffic_bytes_per_step_by_dim"] == got["traffic_by_dim"],
        "saved_bytes": [plan["saved_activation_bytes_per_pack"]["total"], got["saved_bytes"]],
        "peak_gib": [plan["peak_memory_gib_per_rank"], got["tensor_peak_gib"]],
        "peak_moment": plan["peak_moment"], "rss_peak_gib": got["rss_peak_gib"], "baseline_gib": plan["baseline_gib"],
    }


def planner_time() -> dict:
    from hybridpar.config import load_config
    from hybridpar.plan import make_plan

    config = load_config(None, ["model.preset=nemotronh-8b", "data.pack_size=131072", "parallel.cp=8", "parallel.tp=1"])
    times = []
    for _ in range(3):
        start = time.perf_counter()
        make_plan(config)
        times.append(time.perf_counter() - start)
    return {"nemotronh_8b_plan_s": min(times)}


def to_markdown(record: dict) -> str:
    lines = ["# Planner: predicted against measured (CPU, float32, one step)", "",
             f"Command: `{record['command']}`  ", f"Date: {record['date']}  ", f"Machine: {record['machine']}  ",
             "Measured peak: live tensors of the second training step (`tensor_peak_gib`, CPU allocator events); "
             "saved: distinct storages under saved-tensor hooks, one pack. RSS (with the process baseline) for reference.",
             "", "| model | layout | tokens | params (plan = measured) | bytes per kind exact | saved MiB plan / measured "
             "| ratio | peak MiB plan / measured | ratio | peak at | RSS GiB |", "|" + "---|" * 11]
    for r in record["cases"]:
        (sp, sm), (pp, pm) = r["saved_bytes"], r["peak_gib"]
        lines.append(f"| {r['model']} | {r['layout']} | {r['length']:,} | {r['params'][0]:,} {'=' if r['params'][0] == r['params'][1] else '!='} "
                     f"{r['params'][1]:,} | {'yes' if r['traffic_exact'] else 'NO'} | {sp / 2**20:,.1f} / {sm / 2**20:,.1f} | "
                     f"{sp / sm:.3f} | {pp * 1024:,.1f} / {pm * 1024:,.1f} | {pp / pm:.3f} | {r['peak_moment']} | {r['rss_peak_gib']:.2f} |")
    lines += ["", f"Planner time for nemotronh-8b, 128K tokens, cp=8 (meta model included): "
              f"{record['planner']['nemotronh_8b_plan_s']:.2f} s (best of 3; machine shared, see the date)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384])
    args = parser.parse_args()
    cases = []
    record = {"command": "python benchmarks/planner.py " + " ".join(sys.argv[1:]), "planner": planner_time()}
    for model in args.models:
        for length in args.lengths:
            for layout in args.layouts:
                cases.append(run_case(model, layout, length))
                print(json.dumps(cases[-1]), flush=True)
                save(record, cases)  # after every case: a long run stopped early keeps what it measured
    print(to_markdown(record))


def save(record: dict, cases: list) -> None:
    import torch

    record.update(date=datetime.datetime.now().isoformat(timespec="seconds"), cases=cases,
                  machine=f"{platform.node()}, {os.cpu_count()} CPUs (shared), torch {torch.__version__}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planner.json").write_text(json.dumps(record, indent=2))
    (RESULTS / "planner.md").write_text(to_markdown(record))


if __name__ == "__main__":
    main()
