"""CUDA checks of the long-context paths: parity, peak memory against length, compile.

Run on a machine with a GPU (the project never needs one to build or test). Sections:

- ``parity``: the ``small`` preset (every block kind) on a packed row, float64, loss and every
  parameter gradient on CUDA against the same model on CPU (relative to the largest value).
- ``memory``: ``torch.cuda.max_memory_allocated`` added by forward+backward (tensor level, no
  allocator slack) for each length L, fitted exponent ``d log(peak) / d log(L)``:
  attention core (``small`` heads 12/4 x 64, bfloat16; causal and 8 packed documents; the kernel
  ``attention_core`` picks and the pure-PyTorch blockwise core), the fused LM head loss
  (V = 131072, hidden 256, float32) and one whole training step of the ``small`` preset
  (float32, packed, every block kind, blockwise attention and the Mamba core).
- ``compile``: the ``tiny`` preset through ``parallelize(..., compile="inductor")`` on CUDA:
  graph breaks, first step and median step time against eager, loss difference.

    python benchmarks/cuda_check.py [--sections parity memory compile] [--out DIR]

Writes ``cuda_check.{json,md}`` into ``--out`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import harness
import torch

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.attention.mixer import sequence_layout
from hybridpar.models.attention.kernels import attention_core, choose_kernel
from hybridpar.models.hybrid import HybridConfig, HybridLM
from hybridpar.parallel.dims import ParallelDims
from hybridpar.parallel.parallelize import parallelize
from hybridpar.train.loss import lm_head_loss

GIB = 2**30


def packed(tokens: int, docs: int, device) -> PackedSeqParams:
    """``docs`` documents of growing lengths (multiples of 8) filling ``tokens``."""
    weights = torch.arange(1, docs + 1, dtype=torch.float64)
    lengths = (weights / weights.sum() * tokens / 8).floor().long() * 8
    lengths[-1] += tokens - int(lengths.sum())
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).int()
    return _to(PackedSeqParams.from_cu_seqlens(cu), device)


def peak_of(step) -> tuple[float, float]:
    """``(peak bytes the step adds, seconds)`` of ``step()`` after one warm-up."""
    step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, time.perf_counter() - start


def exponent(rows: list[dict], key: str) -> float | None:
    return harness.log_slope((r["L"], r.get(key)) for r in rows)


def section_parity(device) -> dict:
    torch.manual_seed(0)
    cpu = HybridLM(HybridConfig.from_preset("small", dtype=torch.float64, vocab_size=512))
    gpu = copy.deepcopy(cpu).to(device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (1, 2049), generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    layout = PackedSeqParams.from_cu_seqlens(torch.tensor([0, 300, 1100, 1500, 2048], dtype=torch.int32))
    results = {}
    for name, model, dev in (("cpu", cpu, "cpu"), ("cuda", gpu, device)):
        loss, count = model(inputs.to(dev), packed=_to(layout, dev), labels=labels.to(dev))
        (loss / count).backward()
        results[name] = (loss.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()})
    loss_rel = float((results["cuda"][0] - results["cpu"][0]).abs() / results["cpu"][0].abs())
    grad_rel = max(float((results["cuda"][1][n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
                   for n, g in results["cpu"][1].items())
    return {"loss_rel": loss_rel, "max_grad_rel": grad_rel, "parameters": len(results["cpu"][1]), "tokens": 2048}


def _to(layout: PackedSeqParams, device) -> PackedSeqParams:
    if str(device) == "cpu":
        return layout
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(layout).items()}
    out = copy.copy(layout)
    out.__dict__.update(fields)
    return out


def section_memory(device, lengths: list[int]) -> dict:
    out = {"attention": [], "loss": [], "model": []}
    for L in lengths:  # attention core: heads 12/4 x 64, bfloat16
        for kind, docs in (("causal", 1), ("packed", 8)):
            layout = sequence_layout(packed(L, docs, device), L, device)
            q = torch.randn(1, L, 12, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(1, L, 4, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
            auto = choose_kernel(q, layout)[0]
            row = {"L": L, "kind": kind, "auto_kernel": auto}
            for kernel in sorted({auto, "blockwise"}):
                def step(kernel=kernel):
                    for t in (q, k, v):
                        t.grad = None
                    attention_core(q, k, v, layout, kernel=kernel).sum().backward()
                try:
                    peak, seconds = peak_of(step)
                    row[f"{kernel}_mib"], row[f"{kernel}_s"] = peak / 2**20, seconds
                except Exception as error:  # noqa: BLE001 - reported in the table
                    row[f"{kernel}_mib"] = f"{type(error).__name__}: {str(error)[:80]}"
            out["attention"].append(row)
            print("attention", row, flush=True)
            del q, k, v
    for T in lengths:  # the loss: V = 131072, D = 256, float32
        hidden = torch.randn(T, 256, device=device, requires_grad=True)
        weight = torch.randn(131072, 256, device=device, requires_grad=True) * 0.02
        weight = weight.detach().requires_grad_()
        labels = torch.randint(0, 131072, (T,), device=device)

        def step():
            hidden.grad = weight.grad = None
            lm_head_loss(hidden, weight, labels)[0].backward()
        peak, seconds = peak_of(step)
        row = {"L": T, "fused_mib": peak / 2**20, "fused_s": seconds, "logits_mib": T * 131072 * 4 / 2**20}
        out["loss"].append(row)
        print("loss", row, flush=True)
        del hidden, weight
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_preset("small")).to(device)
    for L in lengths:  # one training step of the small preset (float32, packed, 8 documents)
        ids = torch.randint(0, model.config.vocab_size, (1, L + 1), device=device)
        layout = packed(L, 8, device)

        def step():
            model.zero_grad(set_to_none=True)
            loss, count = model(ids[:, :-1], packed=layout, labels=ids[:, 1:])
            (loss / count).backward()
        try:
            peak, seconds = peak_of(step)
            row = {"L": L, "step_mib": peak / 2**20, "step_s": seconds, "kib_per_token": peak / 1024 / L}
        except torch.OutOfMemoryError as error:
            row = {"L": L, "step_mib": f"OOM: {str(error)[:60]}"}
        out["model"].append(row)
        print("model", row, flush=True)
    out["exponents"] = {
        **{f"attention {kind} {kernel}": exponent([r for r in out["attention"] if r["kind"] == kind], f"{kernel}_mib")
           for kind in ("causal", "packed") for kernel in ("blockwise", out["attention"][0]["auto_kernel"])},
        "loss fused": exponent(out["loss"], "fused_mib"), "model step": exponent(out["model"], "step_mib"),
    }
    return out


def section_compile(device) -> dict:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base = HybridLM(HybridConfig.from_preset("tiny")).to(device)
    ids = torch.randint(0, base.config.vocab_size, (1, 2049), device=device)
    layout = _to(PackedSeqParams.from_cu_seqlens(torch.tensor([0, 256, 768, 1024, 2048], dtype=torch.int32)), device)
    result = {}
    for name, backend in (("eager", False), ("inductor", "inductor")):
        model = parallelize(copy.deepcopy(base), ParallelDims(), compile=backend)
        counters.clear()
        times, losses = [], []
        for _ in range(6):
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss, count = model(ids[:, :-1], packed=layout, labels=ids[:, 1:])
            (loss / count).backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
        result[name] = {"first_step_s": times[0], "median_step_s": statistics.median(times[1:]), "loss": losses[0],
                        "graph_breaks": sum(counters["graph_break"].values()),
                        "graphs": counters["stats"]["unique_graphs"]}
        print("compile", name, result[name], flush=True)
    result["loss_rel"] = abs(result["inductor"]["loss"] - result["eager"]["loss"]) / abs(result["eager"]["loss"])
    return result


def markdown(results: dict, meta: dict) -> str:
    lines = [*harness.header("CUDA checks", meta), ""]
    if "parity" in results:
        p = results["parity"]
        lines += ["## Parity (small preset, float64, packed 2048 tokens, CUDA vs CPU)", "",
                  f"loss relative difference {p['loss_rel']:.2e}; largest parameter-gradient difference "
                  f"{p['max_grad_rel']:.2e} (relative to the gradient's largest value) over {p['parameters']} parameters", ""]
    if "memory" in results:
        m = results["memory"]
        lines += ["## Attention core, forward+backward (heads 12/4 x 64, bfloat16): peak MiB added / seconds", "",
                  "| L | kind | auto kernel | auto MiB | auto s | blockwise MiB | blockwise s |", "|---:|---|---|---:|---:|---:|---:|"]
        for r in m["attention"]:
            a = r["auto_kernel"]
            lines.append(f"| {r['L']} | {r['kind']} | {a} | {_f(r.get(f'{a}_mib'))} | {_f(r.get(f'{a}_s'), 3)} | "
                         f"{_f(r.get('blockwise_mib'))} | {_f(r.get('blockwise_s'), 3)} |")
        lines += ["", "## Fused LM head loss (V = 131072, hidden 256, float32)", "",
                  "| T | peak MiB added | seconds | one float32 logit matrix (MiB) |", "|---:|---:|---:|---:|"]
        lines += [f"| {r['L']} | {_f(r['fused_mib'])} | {_f(r['fused_s'], 3)} | {_f(r['logits_mib'])} |" for r in m["loss"]]
        lines += ["", "## One training step, small preset (float32, 8 packed documents)", "",
                  "| L | peak MiB added | KiB per token | seconds |", "|---:|---:|---:|---:|"]
        lines += [f"| {r['L']} | {_f(r['step_mib'])} | {_f(r.get('kib_per_token'))} | {_f(r.get('step_s'), 3)} |"
                  for r in m["model"]]
        lines += ["", "Fitted memory exponents (least squares over all L): "
                  + ", ".join(f"{k} {_f(v, 3)}" for k, v in m["exponents"].items()), ""]
    if "compile" in results:
        c = results["compile"]
        lines += ["## torch.compile per block (tiny preset, 2048 packed tokens, float32)", "",
                  "| run | first step (s) | median step (s) | graphs | graph breaks |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {n} | {c[n]['first_step_s']:.2f} | {c[n]['median_step_s']:.4f} | {c[n]['graphs']} | "
                  f"{c[n]['graph_breaks']} |" for n in ("eager", "inductor")]
        lines += ["", f"loss relative difference compiled vs eager: {c['loss_rel']:.1e}", ""]
    return "\n".join(lines) + "\n"


def _f(value, digits: int = 1) -> str:
    return f"{value:,.{digits}f}" if isinstance(value, (int, float)) else ("-" if value is None else str(value))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", default=["parity", "memory", "compile"],
                        choices=["parity", "memory", "compile"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_check: no CUDA device here; run it on a GPU machine.")
        return 0
    device = torch.device("cuda")
    meta = harness.environment(__file__)
    results = {}
    for name in args.sections:
        results[name] = {"parity": lambda: section_parity(device), "memory": lambda: section_memory(device, args.lengths),
                         "compile": lambda: section_compile(device)}[name]()
    harness.write_results("cuda_check", {"meta": meta, "results": results}, markdown(results, meta), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
