"""SSD scan on CPU: chunked ``ssd_scan`` vs the implementation it replaced vs the sequential
``ssd_scan_reference`` vs the torch fallback of transformers' ``mamba2_chunk_scan``.

One Mamba2 head/state config (B=1, H=16, P=64, G=1, N=64, chunk 256, float32, Mamba2-like
dt/A: dt = softplus(raw + dt_bias) with dt_bias from dt in [1e-3, 1e-1], A in [-16, -1]).
For each length L, forward+backward (gradients of x, dt, A, B, C, D, dt_bias):

- wall time: median over repeats; all implementations run round-robin in one process per L so
  that load from other jobs on the machine hits them alike. One torch thread by default: on a
  shared 2-core machine two OpenMP threads per process oversubscribe the cores, and the
  sequential reference's thousands of tiny ops then slow down 5-30x at random;
- peak memory: one forward+backward in a fresh subprocess per (implementation, L), peak RSS
  (``VmHWM``, reset just before the call: ``harness.measure_peak``) minus the RSS just before the
  call, in MiB.

``ssd_scan`` is the ``hybridpar::ssd_chunk_scan`` op (inputs saved, internals recomputed in
backward, loop-free state passing); "before" is the previous chunked scan (autograd through
every step, a Python loop over chunks), kept as ``tests/models/mamba/reference.py``. Extra rows:
``ssd_scan`` with 8 packed documents (transformers' fallback refuses ``seq_idx``) and with chunk 64. The sequential reference only runs at L <= 4K. Accuracy: at L=1K each
float32 output and x-gradient is compared with the float64 sequential reference.

    python benchmarks/ssd.py [--quick] [--threads 1]
    python benchmarks/ssd.py --lengths 4096 16384 --impls ssd_scan before --out ssd_vs_before   # a focused run

Prints a table and writes benchmarks/results/ssd.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import platform
import statistics

import harness
import torch

from tests.models.mamba.ssd_reference import ssd_scan, ssd_scan_reference

logging.getLogger("transformers").setLevel(logging.ERROR)
CONFIG = dict(batch=1, nheads=16, headdim=64, ngroups=1, dstate=64, chunk_size=256, dtype="float32")
IMPLS = {
    "ssd_scan": "hybridpar ssd_scan",
    "ssd_scan_packed": "hybridpar ssd_scan, 8 packed docs",
    "ssd_scan_q64": "hybridpar ssd_scan, chunk 64",
    "before": "before: chunked scan with a loop over chunks",
    "before_q64": "before, chunk 64",
    "hf": "transformers mamba2_chunk_scan (torch)",
    "reference": "hybridpar ssd_scan_reference (sequential)",
}
REFERENCE_MAX_LEN = 4096


def make_inputs(seqlen: int, dtype=torch.float32, seed: int = 0) -> dict:
    """Mamba2-like inputs, all leaves with requires_grad."""
    gen = torch.Generator().manual_seed(seed)
    b, h, p, g, n = (CONFIG[k] for k in ("batch", "nheads", "headdim", "ngroups", "dstate"))
    dt_init = torch.exp(torch.rand(h, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    inputs = dict(
        x=torch.randn(b, seqlen, h, p, generator=gen),
        dt=0.5 * torch.randn(b, seqlen, h, generator=gen),
        A=-(1 + 15 * torch.rand(h, generator=gen)),
        B=torch.randn(b, seqlen, g, n, generator=gen),
        C=torch.randn(b, seqlen, g, n, generator=gen),
        D=torch.randn(h, generator=gen),
        dt_bias=dt_init + torch.log(-torch.expm1(-dt_init)),  # inverse softplus
    )
    return {k: v.to(dtype).requires_grad_() for k, v in inputs.items()}


def packed_seq_idx(seqlen: int, ndocs: int = 8) -> torch.Tensor:
    """Document ids of ``ndocs`` documents of random lengths packed into one row ``[1, L]``."""
    gen = torch.Generator().manual_seed(1)
    cuts = torch.randperm(seqlen - 1, generator=gen)[: ndocs - 1].sort().values + 1
    return torch.searchsorted(cuts, torch.arange(seqlen), right=True).int()[None]


def scan_fn(impl: str, seqlen: int):
    """``fn(inputs) -> y`` for one implementation."""
    chunk = CONFIG["chunk_size"]
    if impl == "hf":
        from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

        return lambda t: mamba2_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True)
    if impl == "reference":
        return lambda t: ssd_scan_reference(**t, chunk_size=chunk, dt_softplus=True)
    if impl == "ssd_scan_packed":
        seq_idx = packed_seq_idx(seqlen)
        return lambda t: ssd_scan(**t, chunk_size=chunk, dt_softplus=True, seq_idx=seq_idx)
    if impl == "ssd_scan_q64":
        return lambda t: ssd_scan(**t, chunk_size=64, dt_softplus=True)
    if impl.startswith("before"):
        from tests.models.mamba.reference import ssd_scan_chunked

        return lambda t: ssd_scan_chunked(**t, chunk_size=64 if impl == "before_q64" else chunk, dt_softplus=True)
    return lambda t: ssd_scan(**t, chunk_size=chunk, dt_softplus=True)


def forward_backward(fn, inputs: dict, grad_y: torch.Tensor) -> tuple:
    y = fn(inputs)
    return torch.autograd.grad(y, list(inputs.values()), grad_y)


def worker_memory(impl: str, seqlen: int) -> dict:
    """Peak RSS added by one forward+backward (run in a fresh process)."""
    fn = scan_fn(impl, seqlen)
    inputs = make_inputs(seqlen)
    grad_y = torch.randn(inputs["x"].shape)
    peak = harness.measure_peak(lambda: forward_backward(fn, inputs, grad_y))
    return {"peak_mib": peak["peak_bytes"] / 2**20, "rss_before_mib": peak["rss_before_bytes"] / 2**20,
            "peak_seen": peak["hwm_reset"]}


def worker_time(seqlen: int, impls: list[str], repeats: int, reference_repeats: int) -> dict:
    """Median forward+backward seconds per implementation, round-robin after one warm-up each."""
    inputs = make_inputs(seqlen)
    grad_y = torch.randn(inputs["x"].shape)
    steps = {impl: (lambda fn=scan_fn(impl, seqlen): forward_backward(fn, inputs, grad_y)) for impl in impls}
    times = harness.interleaved(steps, repeats, limit={"reference": reference_repeats})
    return {impl: {"median_s": statistics.median(ts), "times_s": ts} for impl, ts in times.items()}


def accuracy(seqlen: int = 1024) -> dict:
    """Max error of float32 outputs and x-gradients against the float64 sequential reference,
    relative to the reference's max magnitude."""
    grad_y = torch.randn(CONFIG["batch"], seqlen, CONFIG["nheads"], CONFIG["headdim"], generator=torch.Generator().manual_seed(2))
    inputs64 = make_inputs(seqlen, torch.float64)
    y_ref = scan_fn("reference", seqlen)(inputs64)
    (gx_ref,) = torch.autograd.grad(y_ref, [inputs64["x"]], grad_y.double())
    result = {}
    for impl in ("ssd_scan", "hf"):
        inputs = make_inputs(seqlen)
        y = scan_fn(impl, seqlen)(inputs)
        (gx,) = torch.autograd.grad(y, [inputs["x"]], grad_y)
        result[impl] = {
            "y_rel_err": ((y.double() - y_ref).abs().max() / y_ref.abs().max()).item(),
            "grad_x_rel_err": ((gx.double() - gx_ref).abs().max() / gx_ref.abs().max()).item(),
        }
    return result


def hf_backend() -> str:
    """Which implementation transformers' decorated ``mamba2_chunk_scan`` dispatches to here."""
    if importlib.util.find_spec("mamba_ssm") is not None:
        return "mamba_ssm kernel (not the torch fallback!)"
    if importlib.util.find_spec("kernels") is not None:
        return "hub kernels possible (kernels installed)"
    return "torch fallback (neither mamba_ssm nor kernels installed)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L in {1K, 4K}, fewer repeats, reference at 1K only")
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default 1K, 4K, 16K)")
    parser.add_argument("--impls", nargs="+", choices=sorted(IMPLS), help="implementations (default all)")
    parser.add_argument("--out", default="ssd", help="results file name in benchmarks/results (default ssd)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per measuring process (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    lengths = args.lengths or ([1024, 4096] if args.quick else [1024, 4096, 16384])
    repeats, ref_repeats = (5, 1) if args.quick else (7, 2)
    ref_max = 1024 if args.quick else REFERENCE_MAX_LEN
    backend = hf_backend()
    load_start = os.getloadavg()
    print(f"transformers mamba2_chunk_scan backend: {backend}")
    rows = []
    for seqlen in lengths:
        impls = [i for i in (args.impls or IMPLS) if i != "reference" or seqlen <= ref_max]
        print(f"L={seqlen}: timing {', '.join(impls)} ...", flush=True)
        times = harness.run_fresh(worker_time, seqlen, impls, repeats, ref_repeats, threads=args.threads)
        for impl in impls:
            memory = harness.run_fresh(worker_memory, impl, seqlen, threads=args.threads)
            rows.append({"impl": impl, "name": IMPLS[impl], "seqlen": seqlen, **times[impl], **memory})
    acc = accuracy()
    verdicts = targets(rows)
    env = harness.environment(__file__)
    record = {
        "command": env["command"], "date": env["date"],
        "machine": {"platform": platform.platform(), "cpu": platform.processor(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "load_avg_start": load_start, "load_avg_end": os.getloadavg()},
        "config": CONFIG, "hf_backend": backend, "rows": rows, "accuracy_vs_float64_reference_L1024": acc, "targets": verdicts,
    }
    harness.write_results(args.out, record, to_markdown(record))


def targets(rows: list[dict], seqlen: int = 4096) -> dict:
    """The issue's targets at L=4K: >= 20x over the reference, >= 2x faster and <= 0.5x memory vs HF;
    and at every L, forward+backward at least as fast as the implementation it replaced."""
    at = {r["impl"]: r for r in rows if r["seqlen"] == seqlen}
    ours, hf, ref = at.get("ssd_scan"), at.get("hf"), at.get("reference")
    out = {}
    for length in sorted({r["seqlen"] for r in rows}):
        pair = {r["impl"]: r for r in rows if r["seqlen"] == length}
        if "ssd_scan" in pair and "before" in pair:
            out[f"speedup_vs_before_L{length}"] = {"value": pair["before"]["median_s"] / pair["ssd_scan"]["median_s"], "target": ">= 1"}
    if ours and ref:
        out["speedup_vs_reference"] = {"value": ref["median_s"] / ours["median_s"], "target": ">= 20"}
    if ours and hf:
        out["speedup_vs_hf"] = {"value": hf["median_s"] / ours["median_s"], "target": ">= 2"}
        out["memory_ratio_vs_hf"] = {"value": ours["peak_mib"] / hf["peak_mib"], "target": "<= 0.5"}
    for name, item in out.items():
        bound = float(item["target"].split()[1])
        item["met"] = item["value"] >= bound if item["target"].startswith(">=") else item["value"] <= bound
    return out


def to_markdown(record: dict) -> str:
    cfg, machine = record["config"], record["machine"]
    base = {(r["seqlen"]): r for r in record["rows"] if r["impl"] == "ssd_scan"}
    lines = [
        *harness.header("SSD scan: chunked vs sequential vs transformers (CPU)", {**record, "device": "CPU",
                                                                                   "torch": machine["torch"]}),
        f"Machine: {machine['cpus']} CPUs, {machine['torch_threads']} torch threads, torch {machine['torch']}, "
        f"load average (1/5/15 min) at start {', '.join(f'{x:.1f}' for x in machine['load_avg_start'])}, at end "
        f"{', '.join(f'{x:.1f}' for x in machine['load_avg_end'])} (shared machine: times are noisy)  ",
        f"Config: B={cfg['batch']}, H={cfg['nheads']}, P={cfg['headdim']}, G={cfg['ngroups']}, N={cfg['dstate']}, "
        f"chunk {cfg['chunk_size']}, {cfg['dtype']}, forward+backward; transformers backend: {record['hf_backend']}", "",
        "| implementation | L | fwd+bwd median (s) | peak memory (MiB) | time / ssd_scan | memory / ssd_scan |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in record["rows"]:
        ours = base[r["seqlen"]]
        peak = f"{r['peak_mib']:.0f}" + ("" if r["peak_seen"] else " (<=)")
        lines.append(
            f"| {r['name']} | {r['seqlen']} | {r['median_s']:.3f} | {peak} | "
            f"{r['median_s'] / ours['median_s']:.2f}x | {r['peak_mib'] / ours['peak_mib']:.2f}x |"
        )
    lines += ["", "Targets (speedups at L=4096 unless named):", ""]
    for name, item in record["targets"].items():
        lines.append(f"- {name}: {item['value']:.2f} (target {item['target']}): {'met' if item['met'] else 'MISSED'}")
    lines += ["", "Accuracy at L=1024, float32 against the float64 sequential reference (max error / max magnitude):", ""]
    for impl, acc in record["accuracy_vs_float64_reference_L1024"].items():
        lines.append(f"- {IMPLS[impl]}: y {acc['y_rel_err']:.1e}, grad x {acc['grad_x_rel_err']:.1e}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
