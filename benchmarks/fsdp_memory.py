"""Parameter, gradient and AdamW-state memory per rank under FSDP2, by dp_shard.

Each configuration runs ``apply_fsdp`` (blocks + root, ``hybridpar.parallel.data.fsdp``) on
``dp_shard`` gloo processes, takes one AdamW step (float32) and then adds up the storage
bytes of the tensors each rank really holds: the local shards of the parameters, of their
gradients, and of every AdamW state tensor (``exp_avg``, ``exp_avg_sq``, ``step``).
Storages are counted once each (``untyped_storage().nbytes()``), so FSDP's per-parameter
padding is included. This is a measurement of allocated tensors, not a formula; the
"ideal" column is the dp_shard=1 total divided by dp_shard.

Models: ``HybridLM`` (the "tiny" preset scaled up) and a mid-size Hugging Face Llama.
Target: at dp_shard=4 the per-rank total is at most 0.3x the dp_shard=1 total.

    python benchmarks/fsdp_memory.py [--dp 1 2 4]

Prints a table and writes benchmarks/results/fsdp_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    import hybridpar  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_RATIO = 0.3
HYBRID_SHAPE = dict(vocab_size=8192, hidden_size=256, pattern="M*-M-M*-M-", mamba_num_heads=8,
                    mamba_head_dim=64, mamba_n_groups=2, ssm_state_size=32, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=32, intermediate_size=1024)
LLAMA_SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4)


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "hybrid":
        from hybridpar.models.hybrid import HybridConfig, HybridLM

        return HybridLM(HybridConfig.from_preset("tiny", **HYBRID_SHAPE))
    import transformers

    config = transformers.LlamaConfig(**LLAMA_SHAPE, attn_implementation="sdpa", use_cache=False)
    return transformers.LlamaForCausalLM(config)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard)."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def measure_rank(name: str) -> dict:
    """One AdamW step under FSDP on this rank's group, then the bytes this rank holds."""
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.data.fsdp import apply_fsdp

    dims = ParallelDims(dp_shard=dist.get_world_size())
    model = build(name)
    num_params = sum(p.numel() for p in model.parameters())
    apply_fsdp(model, dims.build_mesh(), dims)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, 64))
    out = model(input_ids=ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    optimizer.step()
    params = list(model.parameters())
    states = [optimizer.state[p] for p in params]
    sizes = {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params),
        "exp_avg": storage_bytes(s["exp_avg"] for s in states),
        "exp_avg_sq": storage_bytes(s["exp_avg_sq"] for s in states),
        "step": storage_bytes(s["step"] for s in states),
    }
    sizes["total"] = sum(sizes.values())
    return {"num_params": num_params, "bytes": sizes, "unsharded_left": unsharded_bytes(model)}


def unsharded_bytes(model) -> int | None:
    """Bytes still held by FSDP's all-gathered (unsharded) parameters; 0 once all are resharded.

    Reads FSDP2 internals (``FSDPParam.all_gather_outputs``); None if they moved.
    """
    from torch.distributed.fsdp import FSDPModule

    try:
        buffers = [out for module in model.modules() if isinstance(module, FSDPModule)
                   for group in module._get_fsdp_state()._fsdp_param_groups
                   for fsdp_param in group.fsdp_params for out in fsdp_param.all_gather_outputs]
    except AttributeError:
        return None
    return storage_bytes(buffers)


def _worker(rank: int, world: int, port: int, name: str, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        result = measure_rank(name)
        dist.destroy_process_group()
        queue.put((rank, result))
    except BaseException as error:  # noqa: BLE001 - report to the parent
        queue.put((rank, {"error": repr(error)}))
        raise


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(name: str, world: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, name, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=900) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    for rank, res in results.items():
        if "error" in res:
            raise RuntimeError(f"{name} dp_shard={world} rank {rank} failed: {res['error']}")
    return [results[r] for r in range(world)]


def markdown(rows: list[dict], meta: dict) -> str:
    mib = 2**20
    lines = [
        "# FSDP2 parameter + gradient + AdamW-state memory per rank",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}  ",
        f"Machine: {meta['machine']}, Python {meta['python']}, torch {meta['torch']}  ",
        "Bytes of the storages each rank holds after one AdamW step (float32), the largest rank shown; "
        "'unsharded left' is what FSDP's all-gather buffers still hold after the step (counted apart). "
        f"Target: dp_shard=4 at most {TARGET_RATIO}x dp_shard=1.",
        "",
        "| model | params | dp_shard | params (MiB) | grads (MiB) | exp_avg (MiB) | exp_avg_sq (MiB) | step (KiB) | "
        "total (MiB) | ratio to dp_shard=1 | ideal | unsharded left (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        b = row["bytes"]
        left = "n/a" if row["unsharded_left"] is None else f"{row['unsharded_left'] / mib:.2f}"
        lines.append(
            f"| {row['model']} | {row['num_params'] / 1e6:.2f}M | {row['dp_shard']} | {b['params'] / mib:.2f} | "
            f"{b['grads'] / mib:.2f} | {b['exp_avg'] / mib:.2f} | {b['exp_avg_sq'] / mib:.2f} | "
            f"{b['step'] / 1024:.2f} | {b['total'] / mib:.2f} | {row['ratio']:.3f} | {1 / row['dp_shard']:.3f} | "
            f"{left} |"
        )
    lines += ["", "Checks:", ""] + [f"- {c}" for c in meta["checks"]] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="dp_shard sizes (1 is the baseline)")
    parser.add_argument("--models", nargs="+", default=["hybrid", "llama"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sizes = sorted(set(args.dp) | {1})

    rows = []
    for name in args.models:
        baseline = None
        for dp in sizes:
            per_rank = run(name, dp)
            worst = max(per_rank, key=lambda r: r["bytes"]["total"])
            baseline = baseline or worst["bytes"]["total"]
            rows.append({"model": name, "dp_shard": dp, "num_params": worst["num_params"], "bytes": worst["bytes"],
                         "per_rank_totals": [r["bytes"]["total"] for r in per_rank],
                         "ratio": worst["bytes"]["total"] / baseline,
                         "unsharded_left": max((r["unsharded_left"] or 0) for r in per_rank)
                         if all(r["unsharded_left"] is not None for r in per_rank) else None})
    at4 = [r for r in rows if r["dp_shard"] == 4]
    checks = [f"{r['model']}: dp_shard=4 / dp_shard=1 = {r['ratio']:.3f} <= {TARGET_RATIO}: {r['ratio'] <= TARGET_RATIO}"
              for r in at4]
    meta = {
        "command": " ".join(["python benchmarks/fsdp_memory.py", shlex.join(sys.argv[1:] if argv is None else argv)]).strip(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__,
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores",
        "shapes": {"hybrid": HYBRID_SHAPE, "llama": LLAMA_SHAPE}, "checks": checks,
    }
    table = markdown(rows, meta)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fsdp_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (args.out / "fsdp_memory.md").write_text(table)


if __name__ == "__main__":
    main()
