"""``parallel.compile``: time of one training step, blocks compiled against eager, one process.

The model goes through ``parallelize(model, ParallelDims(), compile=backend)`` (the same
per-block ``torch.compile`` a parallel job gets, without collectives). One step = forward of a
packed row of ``--tokens`` tokens (documents of mixed lengths), the summed token loss,
backward and an AdamW step, float32. Per backend: the first step (dynamo + AOT autograd +
code generation, i.e. the compile time) and the median of ``--repeats`` later steps, the eager
and compiled steps interleaved so that load from other jobs hits them alike; graph breaks and
graphs from ``torch._dynamo.utils.counters``; and the loss and largest gradient difference of
the first step against eager (in float32 ~1e-6 relative is expected: inductor reorders sums;
``--dtype float64`` checks inductor's float64 code).

    python benchmarks/compile.py [--preset tiny] [--tokens 2048] [--repeats 5] [--backends inductor aot_eager]
                                 [--dtype float32] [--threads 1] [--out DIR]

``inductor`` compiles C++ kernels with the system compiler (minutes per block kind on a busy
2-core machine); ``aot_eager`` traces the same graphs and runs them with eager kernels, which
separates tracing overhead from inductor's fusion. One torch thread by default (a shared
2-core machine; ``--threads`` to change). Prints the table and writes
benchmarks/results/compile.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import harness
import torch

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.hybrid import HybridConfig, HybridLM
from hybridpar.parallel.dims import ParallelDims
from hybridpar.parallel.parallelize import parallelize
from hybridpar.train.loss import token_loss_sum


def packed_row(tokens: int, vocab: int, seed: int = 0):
    """``ids, labels [1, T]`` and the layout of documents of 1/8, 1/4, 1/8 and 1/2 of the row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, tokens + 1), generator=gen)
    cuts = [0, tokens // 8, tokens // 8 + tokens // 4, tokens // 2, tokens]
    return ids[:, :-1], ids[:, 1:], PackedSeqParams.from_cu_seqlens(torch.tensor(cuts, dtype=torch.int32))


class Job:
    """A model (eager or compiled), its optimizer, and one training step on a fixed row."""

    def __init__(self, base: HybridLM, compile_backend: str | None, batch):
        self.model = parallelize(copy.deepcopy(base), ParallelDims(), compile=compile_backend or False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=False)
        self.batch = batch

    def step(self) -> tuple[float, float, dict]:
        ids, labels, packed = self.batch
        start = time.perf_counter()
        loss = token_loss_sum(self.model(ids, packed=packed), labels)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, float(loss.detach()), grads


def measure(preset: str, tokens: int, repeats: int, backends: list[str], dtype: str = "float32") -> dict:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base = HybridLM(HybridConfig.from_preset(preset, dtype=getattr(torch, dtype)))
    batch = packed_row(tokens, base.config.vocab_size)
    jobs = {"eager": Job(base, None, batch)} | {b: Job(base, b, batch) for b in backends}
    first, parity, graphs = {}, {}, {}
    reference = None
    for name, job in jobs.items():  # the first step compiles
        counters.clear()
        seconds, loss, grads = job.step()
        first[name] = seconds
        graphs[name] = {"graph_breaks": sum(counters["graph_break"].values()),
                        "graphs": counters["stats"]["unique_graphs"]}
        if reference is None:
            reference = (loss, grads)
        else:
            parity[name] = {
                "loss_rel": abs(loss - reference[0]) / abs(reference[0]),
                "grad_rel": max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                                for n, g in reference[1].items()),
            }
    samples = harness.interleaved({name: job.step for name, job in jobs.items()}, repeats, warmup=0)
    median = {name: statistics.median(v) for name, v in samples.items()}
    return {"first_step_s": first, "median_step_s": median, "samples_s": samples, "parity": parity, "graphs": graphs,
            "ratio": {name: median[name] / median["eager"] for name in jobs}, "parameters": base.num_parameters()}


def markdown(result: dict, meta: dict) -> str:
    lines = harness.header("torch.compile per block: one training step against eager (one process)", meta) + [
        f"Model: {meta['preset']} preset ({result['parameters'] / 1e6:.2f}M parameters), {meta['dtype']}; one packed row of "
        f"{meta['tokens']} tokens (4 documents); forward, loss, backward, AdamW. {meta['machine']}, torch {meta['torch']}, "
        f"{meta['threads']} torch thread(s); load average {meta['load_average'][0]:.1f} (1 min) at the start: the machine "
        "is shared, so the medians move with other jobs (eager and compiled steps are interleaved to share the noise).",
        "", "| run | first step (s) | median step (s) | compiled / eager | graphs | graph breaks | loss diff (rel) | "
        "max grad diff (rel) |", "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in result["median_step_s"]:
        p, g = result["parity"].get(name), result["graphs"][name]
        loss, grad = ("-", "-") if p is None else (f"{p['loss_rel']:.1e}", f"{p['grad_rel']:.1e}")
        lines.append(f"| {name} | {result['first_step_s'][name]:.2f} | {result['median_step_s'][name]:.3f} | "
                     f"{result['ratio'][name]:.2f} | {g['graphs']} | {g['graph_breaks']} | {loss} | {grad} |")
    lines += ["", f"Median of {meta['repeats']} steps after the first. \"first step\" includes compiling."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", nargs="+", default=["inductor", "aot_eager"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_average = list(os.getloadavg())
    result = measure(args.preset, args.tokens, args.repeats, args.backends, args.dtype)
    meta = {
        **harness.environment(__file__, argv), "preset": args.preset, "tokens": args.tokens, "repeats": args.repeats,
        "threads": args.threads, "load_average": load_average, "dtype": args.dtype,
    }
    harness.write_results("compile", {"meta": meta, "result": result}, markdown(result, meta), args.out)


if __name__ == "__main__":
    main()
