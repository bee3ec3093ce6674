"""GPU throughput: step time, tokens/s, peak memory and MFU of one training step, per variant.

Rows (one process, one GPU, one packed row of T tokens in 8 documents of growing length, a
full step: forward, backward and AdamW on fp32 master weights):

- ``small`` (120M) at 8K, 32K and 128K tokens and ``1b`` (1.17B) at 8K and 32K, each as
  ``fp32-eager`` (today's path, the baseline of the same process: float32, TF32 off, the
  pure-PyTorch Mamba core, the LM head loss's blocks eager), ``bf16-fused``
  (``parallel.mixed_precision=bf16``, TF32 on, FLA's fused scan when ``fla-core`` imports, flash
  attention, the loss's blocks compiled) and ``bf16-fused-compiled`` (the same
  with ``compile=True``: inductor per block; graph breaks counted); the bf16 rows at 64K tokens
  and more run under selective activation checkpointing (said in the note column);
- a ~1.2B transformers Llama (Llama-3.2-1B's shape, random weights) at 8K: through hybridpar
  (transformers backend: its blockwise/varlen attention and fused LM head loss, bf16 mixed
  precision, variant ``bf16-fused``) and through plain transformers (SDPA attention with
  position-id packing masks, its own loss on the ``[T, V]`` logits, bf16 autocast; variant
  ``transformers-sdpa``).

MFU = model FLOPs per token x tokens/s / the GPU's dense bf16 peak (spec: H100 SXM and H200
989 TFLOP/s, H100 PCIe 756, A100 312; None when unknown). Model FLOPs per token of training
(3 x forward, recomputation not counted), with every ``nn.Linear`` weight counted in
``N_linear`` (the LM head included, embeddings excluded), ``K = sum_d L_d (L_d + 1) / 2 / T``
the mean number of keys a token sees in its document, and chunk size ``Q``:

    6 * N_linear
    + per attention layer   12 * H_q * d_head * K
    + per Mamba2 layer      3 * (2 * Q * (G * N + H * P) + 4 * H * P * N)
      (SSD: intra-chunk C B^T over groups and its product with x, chunk states, state outputs)

    python benchmarks/gpu_throughput.py [--budget-s 450] [--out benchmarks/results] [--mamba-kernel pure]
    python benchmarks/gpu_throughput.py --rows 1b:8192:bf16-fused,small:8192:fp32-eager --append
    python benchmarks/gpu_throughput.py --profile 1b:8192:bf16-fused   # + one profiled step: its top kernels
    python benchmarks/gpu_throughput.py --dry-run     # CPU, tiny shapes: exercises every path

``--rows`` measures only the rows named (``model:tokens:variant``); ``--append`` keeps the rows of an
earlier run in ``--out``'s JSON and replaces those measured again (two calls on a GPU lease).

Writes ``gpu_throughput.json`` (``{"device", "torch", "date", "command", "rows": [{"model",
"tokens", "variant", "step_s", "tokens_per_s", "mfu", "peak_gib", "graph_breaks", "note"}]}``) and
``gpu_throughput.md``. A row's note gives the host's time per step (until the step's Python returns,
before the device sync): near ``step_s``, the device waited on the host (kernel launches, Python,
or a host sync inside the step), and fewer ops, no syncs or CUDA graphs are the lever, not fewer
bytes. A row that does not fit (out of memory), fails (the error) or is skipped
for time has null numbers and says why in its note. Without CUDA (and without ``--dry-run``) it refuses.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import json
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts this checkout's src/ first on sys.path)

ROOT = harness.ROOT

from hybridpar.config import TrainConfig  # noqa: E402
from hybridpar.data.thd import PackedSeqParams  # noqa: E402
from hybridpar.models.hybrid import HybridConfig, HybridLM  # noqa: E402
from hybridpar.models.cuda_compile import compile_steps  # noqa: E402
from hybridpar.models.mamba.fused import choose_kernel, use_mamba_kernel  # noqa: E402
from hybridpar.models.norm_kernels import norm_kernel  # noqa: E402
from hybridpar.parallel.context.inputs import shard_inputs  # noqa: E402
from hybridpar.parallel.dims import ParallelDims  # noqa: E402
from hybridpar.parallel.parallelize import parallelize  # noqa: E402
from hybridpar.parallel.precision import set_tf32  # noqa: E402
from hybridpar.train.optim import build_optimizer  # noqa: E402

GIB = 2**30
PEAK_BF16 = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12))  # dense, spec
VARIANTS = ("fp32-eager", "bf16-fused", "bf16-fused-compiled")
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                max_position_embeddings=131072, rope_theta=500000.0)
# Rows in the order they run: the bars first (small at 128K against its float32 baseline,
# 1b's MFU, the Llama pair), then the compiled rows (the next lever on the bars), 1b's float32
# baselines, and small at 8K and 32K; a run cut short by --budget-s loses the last.
FULL_PLAN = [("small", 131072, "fp32-eager"), ("small", 131072, "bf16-fused"), ("1b", 8192, "bf16-fused"),
             ("1b", 32768, "bf16-fused"), ("llama-1b", 8192, "transformers-sdpa"), ("llama-1b", 8192, "bf16-fused"),
             ("1b", 8192, "bf16-fused-compiled"), ("small", 131072, "bf16-fused-compiled"),
             ("1b", 32768, "bf16-fused-compiled"), ("1b", 8192, "fp32-eager"), ("1b", 32768, "fp32-eager"),
             *((("small", t, v) for t in (8192, 32768) for v in VARIANTS))]
DRY_PLAN = [("tiny", 128, v) for v in VARIANTS] + [("llama-tiny", 128, v) for v in ("transformers-sdpa", "bf16-fused")]


def peak_flops(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16 if key in device_name), None)


def doc_lengths(tokens: int, docs: int = 8) -> list[int]:
    """``docs`` documents of growing lengths (multiples of 8) that fill ``tokens``."""
    weights = list(range(1, docs + 1))
    lengths = [max(8, tokens * w // sum(weights) // 8 * 8) for w in weights]
    lengths[-1] += tokens - sum(lengths)
    return lengths


def mean_keys(lengths: list[int]) -> float:
    return sum(n * (n + 1) / 2 for n in lengths) / sum(lengths)


def linear_params(model: nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def hybrid_flops_per_token(model: HybridLM, lengths: list[int]) -> float:
    c = model.config
    attention = 12 * c.num_attention_heads * c.head_dim * mean_keys(lengths)
    heads, p, n, g, q = c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.mamba_n_groups, c.chunk_size
    ssd = 3 * (2 * q * (g * n + heads * p) + 4 * heads * p * n)
    return 6 * linear_params(model) + c.pattern.count("*") * attention + c.pattern.count("M") * ssd


def llama_flops_per_token(model: nn.Module, lengths: list[int]) -> float:
    c = model.config
    return 6 * linear_params(model) + c.num_hidden_layers * 12 * c.num_attention_heads * c.head_dim * mean_keys(lengths)


def packed_batch(vocab: int, lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor, PackedSeqParams]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, sum(lengths) + 1), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams.from_cu_seqlens(cu)
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(packed).items()}
    packed.__dict__.update(fields)
    return ids[:, :-1].to(device), ids[:, 1:].to(device), packed


def checkpointing_for(tokens: int, variant: str) -> str:
    """The bf16 rows at 64K tokens and more run under selective checkpointing (the planner puts
    ``small`` at 128K without it at ~41 GiB, over the issue's 40 GiB bar); every other row, and the
    float32 baseline, keep everything (today's path)."""
    return "selective" if tokens >= 65536 and variant.startswith("bf16") else "none"


def build_case(name: str, variant: str, lengths: list[int], device, compile_backend):
    """``(step function, model, flops per token)`` of one row."""
    torch.manual_seed(0)
    mixed = None if variant == "fp32-eager" else "bf16"
    compile_option = compile_backend if variant == "bf16-fused-compiled" else False
    if name.startswith("llama"):
        from transformers import LlamaConfig, LlamaForCausalLM

        shape = LLAMA_1B if name == "llama-1b" else dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                         vocab_size=256, tie_word_embeddings=True)
        model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).to(device)
        flops = llama_flops_per_token(model, lengths)
        ids, labels, packed = packed_batch(model.config.vocab_size, lengths, device)
        if variant == "transformers-sdpa":
            return _plain_transformers_step(model, ids, packed, device), model, flops
        from hybridpar.train.hf_model import hf_forward_inputs, hf_loss_sum, install_cores, use_blockwise_attention

        install_cores(model)  # as `hybridpar train` builds it: the lean gated MLP (one [T, I] less kept per layer)
        use_blockwise_attention(model)
        model = parallelize(model, ParallelDims(), mixed_precision=mixed, compile=compile_option)
        sharded = shard_inputs(input_ids=ids, labels=labels, packed=packed)
        inputs = hf_forward_inputs(sharded, model)
        return _step(model, lambda: hf_loss_sum(model, sharded.input_ids, sharded.labels, inputs)[0], labels), model, flops
    model = HybridLM(HybridConfig.from_preset(name)).to(device)
    flops = hybrid_flops_per_token(model, lengths)
    model = parallelize(model, ParallelDims(), mixed_precision=mixed, compile=compile_option,
                        activation_checkpointing=checkpointing_for(sum(lengths), variant))
    ids, labels, packed = packed_batch(model.config.vocab_size, lengths, device)
    return _step(model, lambda: model(ids, packed=packed, labels=labels)[0], labels), model, flops


def _step(model: nn.Module, loss_sum, labels: torch.Tensor):
    optimizer = build_optimizer(model, TrainConfig(lr=1e-5))  # as the trainer builds it (fused on CUDA)
    count = (labels != -100).sum()

    def step():
        (loss_sum() / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _plain_transformers_step(model: nn.Module, ids: torch.Tensor, packed: PackedSeqParams, device):
    """transformers as people run it: SDPA, packing by position ids, its own loss, bf16 autocast, fused AdamW
    (its Trainer's default with torch >= 2.8)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")  # HF Trainer's default
    positions = packed.position_ids.reshape(1, -1).long()

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def measure(name: str, tokens: int, variant: str, device, compile_backend, peak, quick: bool = False,
            mamba_kernel: str = "auto", profile_to: Path | None = None) -> tuple[dict, str]:
    """One row (the issue's schema; its ``note`` says what else the reader needs); with
    ``profile_to``, one more step under ``torch.profiler`` whose top kernels go to that file."""
    from torch._dynamo.utils import counters

    row = empty_row(name, tokens, variant)
    lengths = doc_lengths(tokens)
    set_tf32(variant != "fp32-eager")  # today's float32 path ran without TF32
    if variant.endswith("compiled"):  # its blocks compile from scratch; eager rows keep the compiled steps
        torch._dynamo.reset()           # (inside custom ops: compiled once, dynamic shapes after the first)
    counters.clear()
    note = "selective checkpointing" if checkpointing_for(tokens, variant) == "selective" else ""
    faulthandler.dump_traceback_later(180, exit=False)  # a row stuck for 3 minutes prints where it is
    try:
        baseline = variant == "fp32-eager"  # today's path: the pure Mamba core, the loss's blocks eager
        # the steps inside custom ops: inductor on CUDA; a dry run traces them with dynamo's eager backend
        steps = compile_steps(None) if baseline else compile_steps("eager") if quick else contextlib.nullcontext()
        with use_mamba_kernel("pure" if baseline else mamba_kernel), steps:
            step, model, flops = build_case(name, variant, lengths, device, compile_backend)
            slow = variant == "fp32-eager" and tokens >= 65536
            warmup, timed = (2, 3) if variant.endswith("compiled") else (1, 1 if slow else 3)
            warmup, timed = (1, 1) if quick else (warmup, timed)
            for _ in range(warmup):
                step()
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times, host = [], []
            for _ in range(timed):
                start = time.perf_counter()
                step()
                host.append(time.perf_counter() - start)  # the host's work (launches, Python) until step() returns
                _sync(device)
                times.append(time.perf_counter() - start)
            if profile_to is not None:
                write_profile(step, device, profile_to, f"{name} at {tokens:,} tokens, {variant}")
        row["step_s"] = statistics.median(times)
        row["tokens_per_s"] = tokens / row["step_s"]
        row["mfu"] = flops * row["tokens_per_s"] / peak if peak else None
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None
        row["graph_breaks"] = sum(counters["graph_break"].values())
        host_s = statistics.median(host)  # near step_s: the device waited on the host (launch-bound)
        note = "; ".join(filter(None, [note, f"host {host_s:.3f} s of {row['step_s']:.3f}"]))
    except torch.OutOfMemoryError as error:
        note = f"out of memory: {str(error).splitlines()[0][:90]}"
    except Exception as error:  # noqa: BLE001 - a row that fails is reported, the others still run
        traceback.print_exc()
        note = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    finally:
        faulthandler.cancel_dump_traceback_later()
        model = step = None  # noqa: F841
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {**row, "note": note}


def write_profile(step, device, path: Path, title: str, rows: int = 30) -> None:
    """One profiled step: the ops with the most device time (self), as a text table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=70)
    path.write_text(f"# One profiled step: {title} ({device})\n\n```\n{table}\n```\n")
    print(f"gpu_throughput: profile of {title} in {path}", flush=True)


def empty_row(name: str, tokens: int, variant: str, note: str = "") -> dict:
    return {"model": name, "tokens": tokens, "variant": variant, "step_s": None, "tokens_per_s": None, "mfu": None,
            "peak_gib": None, "graph_breaks": None, "note": note}


def parse_rows(spec: str) -> list[tuple[str, int, str]]:
    """``"1b:8192:bf16-fused,small:8192:fp32-eager"`` as plan entries."""
    rows = []
    for item in filter(None, spec.split(",")):
        parts = item.split(":")
        if len(parts) != 3 or not parts[1].isdigit():
            raise SystemExit(f"gpu_throughput: --rows entry {item!r} is not model:tokens:variant (e.g. 1b:8192:bf16-fused)")
        rows.append((parts[0], int(parts[1]), parts[2]))
    return rows


def merged(earlier: list[dict], rows: list[dict]) -> list[dict]:
    """``earlier`` rows not measured again, then ``rows``."""
    key = lambda row: (row["model"], row["tokens"], row["variant"])  # noqa: E731
    again = {key(row) for row in rows}
    return [row for row in earlier if key(row) not in again] + rows


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def kernels_line(device) -> str:
    """Which Mamba core and norms the bf16 rows run on this machine, and why."""
    xBC = torch.zeros(1, 8, 4, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], device=device)
    kernel, reason = choose_kernel(xBC, cu, None, None)
    weight = torch.ones(4, device=device)
    norms = (norm_kernel("rmsnorm", (xBC.float(), weight)), norm_kernel("gated_norm", (xBC, xBC, weight), 4))
    return (f"Mamba core of the bf16 rows: {kernel} ({reason}); eager norms: RMSNorm {norms[0]}, gated {norms[1]} "
            "(models/norm_kernels.py); fp32-eager rows: the pure-PyTorch core and norms.")


def markdown(meta: dict, rows: list[dict], kernels: str) -> str:
    def f(value, digits=2):
        return "-" if value is None else f"{value:,.{digits}f}"

    lines = ["# GPU throughput (one training step, one process)", "", f"Command: `{meta['command']}`  ",
             f"Date: {meta['date']}  ", f"Device: {meta['device']}, torch {meta['torch']}  ", kernels, "",
             "| model | tokens | variant | step s | tokens/s | MFU | peak GiB | graph breaks | note |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for row in sorted(rows, key=lambda row: (row["model"], row["tokens"])):
        mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        breaks = "-" if row["graph_breaks"] is None else str(row["graph_breaks"])
        lines.append(f"| {row['model']} | {row['tokens']:,} | {row['variant']} | {f(row['step_s'], 3)} | "
                     f"{f(row['tokens_per_s'], 0)} | {mfu} | {f(row['peak_gib'])} | {breaks} | {row.get('note', '')} |")
    lines += ["", "MFU: model FLOPs per token (docstring of benchmarks/gpu_throughput.py) x tokens/s / dense bf16 peak.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="where the tables go (default benchmarks/results; a dry run: a temporary folder)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="skip the rows left after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (compile backend 'eager')")
    parser.add_argument("--mamba-kernel", choices=("auto", "pure"), default="auto",
                        help="the bf16 rows' Mamba core: auto (FLA's when it imports) or the pure-PyTorch one")
    parser.add_argument("--rows", default="", help="only these rows: model:tokens:variant[,...] (default: all)")
    parser.add_argument("--append", action="store_true", help="keep --out's earlier rows; replace those measured again")
    parser.add_argument("--autotune-keep", type=int, default=0,
                        help="Triton autotuners time at most this many configs each (0: all; a short lease: 3)")
    parser.add_argument("--lift-fla-640", action="store_true",
                        help="run FLA's gated backward where it refuses (Hopper, triton < 3.7.1), to check or time it")
    parser.add_argument("--profile", default="", help="model:tokens:variant rows to profile one more step of "
                        "(gpu_profile_<model>_<tokens>_<variant>.md in --out)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device here; run it on a GPU machine (or pass --dry-run on CPU).", file=sys.stderr)
        return 2
    lifted = None
    if torch.cuda.is_available():
        harness.limit_autotune(args.autotune_keep)
        lifted = harness.lift_fla_640_guard() if args.lift_fla_640 else None
    if args.out is None:  # a dry run never overwrites the GPU's table
        args.out = Path(tempfile.mkdtemp(prefix="gpu_throughput_")) if args.dry_run else ROOT / "benchmarks" / "results"
        print(f"gpu_throughput: tables go to {args.out}", flush=True)
    device = torch.device("cpu" if args.dry_run else "cuda")
    device_name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(device)
    plan = parse_rows(args.rows) if args.rows else DRY_PLAN if args.dry_run else FULL_PLAN
    compile_backend = "eager" if args.dry_run else True
    meta = {"device": device_name, "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python benchmarks/gpu_throughput.py " + shlex.join(sys.argv[1:] if argv is None else argv)}
    with use_mamba_kernel(args.mamba_kernel):
        kernels = kernels_line(device)
    if lifted:
        kernels += (f" FLA's #640 guard lifted (--lift-fla-640; gpu_parity.md says whether its backward is right "
                    f"here): {lifted}.")
    print(kernels, flush=True)
    earlier = []
    if args.append and (args.out / "gpu_throughput.json").exists():
        before = json.loads((args.out / "gpu_throughput.json").read_text())
        earlier = before["rows"]
        meta["command"] = f"{before['command']} && {meta['command']}"
        meta["date"] = f"{before['date']} and {meta['date']}"
    profiled = set(parse_rows(args.profile))
    rows, started = [], time.perf_counter()
    for name, tokens, variant in plan:
        if time.perf_counter() - started > args.budget_s:
            row = empty_row(name, tokens, variant, f"skipped: past --budget-s {args.budget_s:g}")
        else:
            row = measure(name, tokens, variant, device, compile_backend, peak_flops(device_name),
                          quick=args.dry_run, mamba_kernel=args.mamba_kernel,
                          profile_to=(args.out / f"gpu_profile_{name}_{tokens}_{variant}.md"
                                      if (name, tokens, variant) in profiled else None))
        rows.append(row)
        print(json.dumps(row), flush=True)
        everything = merged(earlier, rows)
        harness.write_results("gpu_throughput", {**meta, "rows": everything}, markdown(meta, everything, kernels),
                              out=args.out, echo=False)
    print(markdown(meta, merged(earlier, rows), kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
