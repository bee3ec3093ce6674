"""Bytes per training step, per collective kind and mesh dim, measured next to the closed forms.

One training step (forward and backward of every pack, gradient clipping, AdamW) of the
default job (``configs/tiny-hybrid.yaml``) with the tiny model, float32, 4 packs of 256 tokens per
step, on gloo processes of this machine, at cp=2, tp=2 (sequence parallel), dp_shard=2 and
tp=2 x cp=2 (sequence parallel). ``comm_stats.CommStats`` counts every collective (hybridpar's
CP exchanges, DTensor's TP/SP redistributions, FSDP2's gathers and reductions, the loss's and
clipping's all-reduces); ``step_comm`` gives each (kind, dim) total in closed form, by source.
A third column checks that nothing escapes: the collectives counted against the ``gloo:*``
events ``torch.profiler`` records below the dispatcher.

    python benchmarks/comm_counts.py

Prints the tables and writes benchmarks/results/comm_counts.{json,md}. Bytes are what one rank
sends (rank 0; the layouts are symmetric): all_gather (P-1) x its shard, reduce_scatter and
all_to_all (P-1)/P x its buffer, all_reduce 2(P-1)/P x its buffer.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

import harness
import torch

from tests.distributed.harness import run_ranks

CONFIG = str(harness.ROOT / "configs" / "tiny-hybrid.yaml")
# The tiny model on 4 packs of 256 tokens per step (the default job's MQAR data otherwise).
BASE = ["model.preset=tiny", "data.pack_size=256", "data.packs_per_step=4", "parallel.reshard_after_forward=true"]
LAYOUTS = {  # name -> (world size, overrides of the default job)
    "cp=2": (2, BASE + ["parallel.cp=2", "parallel.tp=1", "parallel.sequence_parallel=false"]),
    "tp=2": (2, BASE + ["parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "dp_shard=2": (2, BASE + ["parallel.cp=1", "parallel.tp=1", "parallel.dp_shard=2", "parallel.sequence_parallel=false"]),
    "tp=2 x cp=2": (4, BASE + ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
}


def measure_step(overrides: list[str], output_dir: str) -> dict:
    """CommStats of one training step and the closed forms of its shape (this rank)."""
    from torch.profiler import ProfilerActivity, profile

    from hybridpar.config import load_config
    from hybridpar.parallel.comm.stats import CommStats
    from hybridpar.parallel.comm.step import StepShape, step_collectives
    from hybridpar.train.trainer import Trainer, pack_tensors

    extra = ["train.eval_every=0", "checkpoint.every=-1", "tensorboard=false", "plot=false", f"output_dir={output_dir}"]
    trainer = Trainer(load_config(CONFIG, overrides + extra), torch.device("cpu"))
    config, dims = trainer.config, trainer.layout.dims
    packs = trainer.train_data.rank_packs(0, trainer.layout.dp_rank, dims.size("dp"))
    docs = tuple(pack_tensors(p, torch.device("cpu"))[2].cu_seqlens_padded.numel() - 1 for p in packs)
    p = config.parallel
    element = torch.finfo(next(trainer.model.parameters()).dtype).bits // 8
    shape = StepShape(trainer.model.config, dims, config.data.pack_size, len(packs), element, p.sequence_parallel,
                      p.cp_attention, p.cp_mamba, p.reshard_after_forward, docs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with CommStats(trainer.layout.mesh) as stats:
            trainer.train_step(0)
    sources = {name: {f"{k}|{d}": v for (k, d), v in tally.items()} for name, tally in step_collectives(shape).items()}
    return {
        "calls": {f"{k}|{d}": v for (k, d), v in stats.calls_by_dim().items()},
        "bytes": {f"{k}|{d}": v for (k, d), v in stats.by_dim().items()},
        "counted": len(stats.records), "gloo": sum(1 for e in prof.events() if e.name.startswith("gloo:")),
        "sources": sources, "packs_per_rank": len(packs), "pack_size": config.data.pack_size,
        "sequence_parallel": p.sequence_parallel and dims.tp > 1, "element_size": element,
    }


def _rank_step(rank: int, world: int, overrides: list[str], output_dir: str) -> dict:
    return measure_step(overrides, output_dir)


def run_layout(world: int, overrides: list[str]) -> dict:
    """``measure_step`` on ``world`` fresh gloo ranks; rank 0's result (the layouts are symmetric)."""
    with tempfile.TemporaryDirectory() as output_dir:
        return run_ranks(world, _rank_step, overrides, output_dir, timeout_s=1800)[0]


def closed_form(sources: dict) -> tuple[dict, dict]:
    calls, nbytes = collections.Counter(), collections.Counter()
    for tally in sources.values():
        for key, (c, b) in tally.items():
            calls[key] += c
            nbytes[key] += b
    return dict(calls), dict(nbytes)


def markdown(results: dict, meta: dict) -> str:
    lines = harness.header("Collectives of one training step: measured (CommStats) and closed form (step_comm)", meta) + [
        f"Model: tiny preset, float32; data: the default job's (4 packs of 256 tokens per step); {meta['machine']}, "
        f"torch {meta['torch']}. Bytes one rank sends in the whole step (forward, backward, clipping, AdamW).", "",
    ]
    for name, r in results.items():
        calls, nbytes = closed_form(r["sources"])
        lines += [
            f"## {name}  ({r['packs_per_rank']} packs per rank, sequence parallel: {r['sequence_parallel']})", "",
            "| kind | mesh dim | calls | closed form | bytes | closed form | equal |", "|---|---|---:|---:|---:|---:|---|",
        ]
        for key in sorted(set(nbytes) | set(r["bytes"])):
            kind, dim = key.split("|")
            got_c, got_b = r["calls"].get(key, 0), r["bytes"].get(key, 0)
            equal = got_c == calls.get(key, 0) and got_b == nbytes.get(key, 0)
            lines.append(f"| {kind} | {dim} | {got_c} | {calls.get(key, 0)} | {got_b:,} | {nbytes.get(key, 0):,} | "
                         f"{'yes' if equal else 'NO'} |")
        total = sum(r["bytes"].values())
        lines += ["", f"Total {total:,} bytes in {r['counted']} collectives; gloo ran {r['gloo']} "
                      f"({'all counted' if r['counted'] == r['gloo'] else 'MISSING SOME'}). By source (closed form, bytes): "
                      + ", ".join(f"{s} {sum(b for _, b in t.values()):,}" for s, t in r["sources"].items() if t), ""]
    lines += ["Checks:", ""] + [f"- {c}" for c in meta["checks"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    results = {}
    for name, (world, overrides) in LAYOUTS.items():
        print(f"measuring {name} on {world} processes ...", flush=True)
        results[name] = run_layout(world, overrides)
    checks = []
    for name, r in results.items():
        calls, nbytes = closed_form(r["sources"])
        checks.append(f"{name}: every (kind, dim) total equals its closed form: {r['calls'] == calls and r['bytes'] == nbytes}; "
                      f"every collective gloo ran was counted: {r['counted'] == r['gloo']}")
    meta = {**harness.environment(__file__, argv), "checks": checks}
    harness.write_results("comm_counts", {"meta": meta, "layouts": results}, markdown(results, meta), args.out)


if __name__ == "__main__":
    main()
