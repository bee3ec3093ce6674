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
from pathlib import Path

import harness
import torch
import torch.distributed as dist

from tests.distributed.harness import run_ranks

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


def _rank_measure(rank: int, world: int, name: str) -> dict:
    return measure_rank(name)


def run(name: str, world: int) -> list[dict]:
    """``measure_rank`` on ``world`` fresh gloo ranks; one result per rank."""
    return run_ranks(world, _rank_measure, name, timeout_s=900)


def markdown(rows: list[dict], meta: dict) -> str:
    mib = 2**20
    lines = harness.header("FSDP2 parameter + gradient + AdamW-state memory per rank", meta) + [
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
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
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
        **harness.environment(__file__, argv), "shapes": {"hybrid": HYBRID_SHAPE, "llama": LLAMA_SHAPE}, "checks": checks,
    }
    harness.write_results("fsdp_memory", {"meta": meta, "rows": rows}, markdown(rows, meta), args.out)


if __name__ == "__main__":
    main()
