"""Peak memory per rank of full fine-tuning against LoRA: measured (``small``) and planned (``nemotronh-8b``).

Measured: the ``small`` preset (float32) on 8K-token packs on 2 gloo processes as cp=2 (FSDP over
the CP ranks), through the trainer (``Trainer.train_step``): one warm-up step (AdamW state
allocated), then the peak resident memory of a second step per rank (``harness.measure_peak``:
VmHWM, so the interpreter, torch and the data are in it too), the peak of live tensors of a third
(``train/tensor_peak.py``), and the storage bytes of the parameters and AdamW state each rank
holds. Each method runs in fresh processes.
Planned: ``hybridpar plan`` for the same layout, and for ``nemotronh-8b`` (bfloat16) at 32K and
128K tokens on 8 GPUs (cp=8) with full fine-tuning and LoRA (r=8, default targets).

    python benchmarks/lora_memory.py [--pack-size 8192]

Writes benchmarks/results/lora_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import tempfile

import harness

from tests.distributed.harness import run_ranks

MEASURED = ["model.preset=small", "data.packs_per_step=1", "parallel.cp=2", "parallel.tp=1", "train.steps=3",
            "train.eval_every=0", "checkpoint.every=-1", "tensorboard=false", "plot=false"]
PLANNED = ["model.preset=nemotronh-8b", "model.dtype=bfloat16", "data.packs_per_step=1", "parallel.cp=8",
           "parallel.tp=1", "parallel.activation_checkpointing=full"]


def _rank(rank: int, world: int, overrides: list[str]) -> dict:
    import torch

    from fsdp_memory import storage_bytes
    from hybridpar.config import load_config
    from hybridpar.train.trainer import Trainer

    from hybridpar.train.tensor_peak import step_tensor_peak

    trainer = Trainer(load_config(None, overrides), torch.device("cpu"))
    trainer.train_step(0)  # AdamW state exists from here on
    measured = harness.measure_peak(lambda: trainer.train_step(1)["loss"])
    with step_tensor_peak(trainer.model, trainer.optimizer, torch.device("cpu")) as tensors:  # live tensors only
        trainer.train_step(2)
    params = [p for p in trainer.model.parameters()]
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"peak_bytes": measured["rss_before_bytes"] + measured["peak_bytes"], "step_added_bytes": measured["peak_bytes"],
            "tensor_peak_bytes": tensors.bytes,
            "step_s": measured["wall_s"], "params_bytes": storage_bytes(params),
            "grads_bytes": storage_bytes(p.grad for p in params), "adamw_bytes": storage_bytes(state),
            "trainable": sum(p.numel() for p in params if p.requires_grad)}


def planned(overrides: list[str]) -> float:
    from hybridpar.config import load_config
    from hybridpar.plan import make_plan

    return make_plan(load_config(None, overrides)).memory.peak_bytes / 2**30


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pack-size", type=int, default=8192)
    args = parser.parse_args(argv)
    meta = harness.environment(__file__, argv)
    rows = []
    for method in ("none", "lora"):
        with tempfile.TemporaryDirectory() as out:
            overrides = MEASURED + [f"data.pack_size={args.pack_size}", f"peft.method={method}", f"output_dir={out}"]
            ranks = run_ranks(2, _rank, overrides, timeout_s=3000)
        worst = max(ranks, key=lambda r: r["tensor_peak_bytes"])
        rows.append({"model": "small", "tokens": args.pack_size, "method": method, "measured": worst,
                     "planned_gib": planned(overrides)})
    plans = [{"model": "nemotronh-8b", "tokens": t, "method": m,
              "planned_gib": planned(PLANNED + [f"data.pack_size={t}", f"peft.method={m}"])}
             for t in (32768, 131072) for m in ("none", "lora")]
    gib = 2**30
    lines = harness.header("Peak memory per rank: full fine-tuning vs LoRA", meta) + [
        "Measured: `small` (float32), cp=2 on 2 gloo processes, training steps after a warm-up: the peak of live "
        "tensors of a step (`train/tensor_peak.py`, the allocator's events), the peak RSS of another step "
        "(interpreter, torch and the data included), and the storages each rank holds after the step (gradients "
        "are released by then). The rank with the larger tensor peak is shown. Planned: `hybridpar plan`'s peak "
        "(tensors only).", "",
        "| model | tokens/pack | method | trainable | tensor peak (GiB) | planned peak (GiB) | peak RSS (GiB) | "
        "params (MiB) | AdamW (MiB) | step (s) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        m = row["measured"]
        lines.append(f"| {row['model']} | {row['tokens']:,} | {row['method']} | {m['trainable']:,} | "
                     f"{m['tensor_peak_bytes'] / gib:.2f} | {row['planned_gib']:.2f} | {m['peak_bytes'] / gib:.2f} | "
                     f"{m['params_bytes'] / 2**20:.1f} | {m['adamw_bytes'] / 2**20:.1f} | {m['step_s']:.1f} |")
    lines += ["", "nemotronh-8b, bfloat16, cp=8 on 8 GPUs, full activation checkpointing (planner):", "",
              "| tokens/pack | full fine-tuning (GiB/rank) | LoRA r=8 (GiB/rank) |", "|---:|---:|---:|"]
    for t in (32768, 131072):
        full, lora = (next(p["planned_gib"] for p in plans if p["tokens"] == t and p["method"] == m)
                      for m in ("none", "lora"))
        lines.append(f"| {t:,} | {full:.2f} | {lora:.2f} |")
    harness.write_results("lora_memory", {"meta": meta, "measured": rows, "planned": plans}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
