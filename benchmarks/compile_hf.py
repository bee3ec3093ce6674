"""``parallel.compile`` on transformers' recurrent mixers: graph breaks and graphs per CP strategy.

Each transformers recurrent family hybridpar switches onto its cores, as a tiny float64 model from
``tests/models/hf/`` (Bamba: Mamba2; Qwen3-Next and Qwen3.5: gated DeltaNet; LFM2: short conv; Kimi Linear: KDA;
Jamba: Mamba1; RecurrentGemma: RG-LRU), goes through ``parallelize(ParallelDims(cp=P),
compile="aot_eager", cp_mamba=strategy)`` on ``P`` gloo ranks (P = 1, or 2 with each strategy the
family has). Three training steps (forward, loss, backward) on two packed rows of 32 tokens whose
document boundaries differ at every step (``DOCS``: the same number of documents, then one more). Per
case, from ``torch._dynamo.utils.counters`` on rank 0: graph breaks (and their reasons), graphs
compiled, and the frames dynamo compiled again (recompiles) in steps 2 and 3; the loss of every step
against the same model in eager (float64), and the wall time of steps 1 (compiling) and 3.

    python benchmarks/compile_hf.py [--families bamba qwen3_next ...] [--strategies - a2a state halo] [--out DIR]

Prints the table and writes benchmarks/results/compile_hf.{json,md}. ``aot_eager`` traces exactly
the graphs inductor would get (the breaks are dynamo's) without inductor's C++ code generation.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import harness
import torch

# Two rows of 32 tokens: three documents at the first two steps (boundaries moved), four at the third.
DOCS = ([0, 4, 16, 32], [0, 12, 20, 32], [0, 8, 12, 24, 32])
LENGTH = 32
# family -> (tests/models/hf builder module, builder, its argument, the strategies of its mixers at cp=2)
FAMILIES = {
    "bamba": ("hybrid_models", "build_hybrid", "bamba", ("a2a", "state")),
    "qwen3_next": ("gdn_models", "build_gdn", "qwen3_next", ("a2a", "state")),
    "qwen3_5": ("gdn_models", "build_gdn", "qwen3_5", ("a2a", "state")),
    "lfm2": ("lfm_models", "build_lfm", "lfm2", ("halo",)),
    "kimi_linear": ("kda_models", "build_kda", None, ("a2a", "state")),
    "jamba": ("mamba1_models", "build_mamba1", "jamba", ("state",)),
    "recurrent_gemma": ("rglru_models", "build_recurrent_gemma", "recurrent_gemma", ("state",)),
}


def build(family: str, keep_float64: bool):
    """The tiny float64 model; without ``keep_float64`` transformers' float32 casts stay (as for a float32 or
    bf16 model: the trainer puts only float64 models under ``models/hf/float64.KeepFloat64``)."""
    import importlib
    from contextlib import nullcontext
    from unittest import mock

    module, builder, argument, _ = FAMILIES[family]
    make = getattr(importlib.import_module(f"tests.models.hf.{module}"), builder)
    from hybridpar.parallel.context.hf import use_hybridpar_attention

    with nullcontext() if keep_float64 else mock.patch("hybridpar.models.hf.float64.keep_float64", lambda m: m):
        model = make() if argument is None else make(argument)
    use_hybridpar_attention(model)  # packed documents in every attention layer, at cp=1 too
    return model.train()


def _batch(step: int, cp_group, vocab: int):
    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.inputs import shard_inputs

    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (2, LENGTH), generator=gen)
    labels = torch.randint(0, vocab, (2, LENGTH), generator=gen)
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(DOCS[step], dtype=torch.int32))
    return shard_inputs(input_ids=ids, labels=labels, packed=packed, cp_group=cp_group)


def _steps(model, cp_group, vocab: int) -> dict:
    """Three forward/backward steps; per step the loss (summed over CP), the seconds, the counters."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from hybridpar.train.trainer import pack_loss_sum

    torch._dynamo.reset()
    counters.clear()
    losses, seconds, frames = [], [], []
    for step in range(len(DOCS)):
        start = time.perf_counter()
        loss = pack_loss_sum(model, _batch(step, cp_group, vocab))[0]
        loss.backward()
        seconds.append(time.perf_counter() - start)
        total = loss.detach().clone()
        if cp_group is not None:
            dist.all_reduce(total, group=cp_group)
        losses.append(total.item())
        frames.append(counters["stats"]["unique_graphs"])
    return {"losses": losses, "seconds": seconds, "graphs_after_step": frames,
            "graph_breaks": dict(counters["graph_break"]), "graphs": counters["stats"]["unique_graphs"]}


def case(rank: int, world_size: int, family: str, strategy: str, keep_float64: bool) -> dict:
    """One (family, cp, strategy) on this rank: eager steps, then compiled steps (an error is a result)."""
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    dims = ParallelDims(cp=world_size)
    mesh = dims.build_mesh() if world_size > 1 else None
    cp_group = ParallelDims.group(mesh, "cp") if mesh is not None else None
    options = {} if strategy in ("-", "halo") else {"cp_mamba": strategy}
    runs = {}
    for backend in (False, "aot_eager"):
        model = parallelize(build(family, keep_float64), dims, mesh=mesh, compile=backend, **options)
        try:
            runs["compiled" if backend else "eager"] = _steps(model, cp_group, model.config.vocab_size)
        except Exception as error:  # noqa: BLE001 (a crash under compile is a row of the table)
            from torch._dynamo.utils import counters

            return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}",
                    "graph_breaks": dict(counters["graph_break"]), "graphs": counters["stats"]["unique_graphs"]}
    eager, compiled = runs["eager"], runs["compiled"]
    loss_rel = max(abs(c - e) / abs(e) for c, e in zip(compiled["losses"], eager["losses"]))
    return {**compiled, "loss_rel": loss_rel}


def measure(families: list[str], keep_float64: bool, strategies: list[str], done=lambda rows: None) -> list[dict]:
    """The rows of every (family, cp, strategy) with the strategy in ``strategies`` ("-": cp=1);
    ``done(rows)`` after each."""
    from tests.distributed.harness import run_ranks

    rows = []
    for family in families:
        for cp, strategy in [(1, "-")] + [(2, s) for s in FAMILIES[family][3]]:
            if strategy not in strategies:
                continue
            result = run_ranks(cp, case, family, strategy, keep_float64, timeout_s=1800)[0]
            row = {"family": family, "cp": cp, "strategy": strategy, "graph_breaks": sum(result["graph_breaks"].values()),
                   "break_reasons": sorted({_reason(r) for r in result["graph_breaks"]}), "graphs": result["graphs"],
                   "error": result.get("error")}
            if "error" not in result:
                graphs = result["graphs_after_step"]
                row.update(recompiled=graphs[-1] - graphs[0], loss_rel=result["loss_rel"],
                           first_step_s=result["seconds"][0], last_step_s=result["seconds"][-1])
            print(row, flush=True)
            rows.append(row)
            done(rows)
    return rows


def _reason(text: str) -> str:
    """The first line of dynamo's graph-break reason and its debug context (the call it could not trace)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    context = next((line for line in lines if line.startswith("Developer debug context")), "")
    return f"{lines[0]} ({context.removeprefix('Developer debug context:').strip()[:60]})" if context else lines[0]


def markdown(rows: list[dict], meta: dict) -> str:
    lines = harness.header("torch.compile (aot_eager) of transformers' recurrent mixers under CP: graph breaks", meta) + [
        f"Tiny float64 models of `tests/models/hf/`; `parallelize(ParallelDims(cp=P), compile=\"aot_eager\")`; three "
        f"forward+backward steps on 2 rows of {LENGTH} tokens whose documents move every step ({list(DOCS)}). "
        "Counters of rank 0. \"graphs\": graphs dynamo compiled in the three steps; \"recompiled\": those after the "
        "first step (new boundaries, then a new document count). \"loss diff\": the largest relative loss difference "
        f"against eager over the steps. KeepFloat64 (`models/hf/float64.py`): {meta['keep_float64']}. {meta['machine']}, torch {meta['torch']}, one torch thread per rank.",
        "", "| family | cp | strategy | graph breaks | graphs | recompiled | loss diff (rel) | step 1 (s) | step 3 (s) | "
        "break reasons |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        case = f"{r['family']} | {r['cp']} | {r['strategy']} | {r['graph_breaks']}"
        reasons = "; ".join(reason.replace("|", "/")[:160] for reason in r["break_reasons"]) or "-"
        if r["error"]:
            lines.append(f"| {case} | {r['graphs']} | - | failed: {r['error'].replace('|', '/')} | - | - | {reasons} |")
            continue
        lines.append(f"| {case} | {r['graphs']} | "
                     f"{r['recompiled']} | {r['loss_rel']:.1e} | {r['first_step_s']:.1f} | {r['last_step_s']:.2f} | "
                     f"{reasons} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--strategies", nargs="+", default=["-", "a2a", "state", "halo"],
                        help="the cases to run: '-' for cp=1, the others at cp=2")
    parser.add_argument("--keep-float64", action="store_true",
                        help="the models under KeepFloat64, as `hybridpar check` and the float64 tests run them")
    parser.add_argument("--name", default="compile_hf", help="results file name (compile_hf_before: a baseline)")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    load_average = list(os.getloadavg())
    meta = {**harness.environment(__file__, argv), "load_average": load_average, "keep_float64": args.keep_float64}

    def write(rows: list[dict]) -> None:  # after every case: a long run keeps what it measured
        harness.write_results(args.name, {"meta": meta, "rows": rows}, markdown(rows, meta), args.out, echo=False)

    rows = measure(args.families, args.keep_float64, args.strategies, write)
    harness.write_results(args.name, {"meta": meta, "rows": rows}, markdown(rows, meta), args.out)


if __name__ == "__main__":
    main()
