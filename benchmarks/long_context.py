"""Long-context memory on CPU, by section (``saved``, ``step``).

``saved``: bytes each block keeps for backward, per token, at ``nemotronh-8b`` widths (hidden
4096; Mamba2 128 heads x 64, 8 groups, state 128, conv 4, chunk 128; attention 32/8 heads x
128; MLP 21504 relu2), float32, one block of each kind (Mamba2 on a packed row of documents and
on one document, MLP, attention) at L = 1024 and 2048, for each activation-checkpointing policy
(``none``, ``full``, ``selective``: ``parallel/checkpointing.py``). Two measurements:

- saved-tensor hooks (``none`` only): every tensor autograd packs, storage bytes counted once
  per storage, parameters excluded;
- live storages (every policy): a ``TorchDispatchMode`` records a weak reference to the
  storage of every tensor the forward creates; after the forward the ones still alive, minus
  the block's output, are what backward keeps (checkpoint inputs and selective caches
  included), plus the block's input, which every policy keeps (the first norm saves it, a
  checkpoint keeps it).

Then the whole model per token under each policy as the sum over the preset's pattern (Mamba
blocks counted packed), and the same for the ``small`` preset's widths.

    python benchmarks/long_context.py --section saved [--lengths 1024 2048] [--presets nemotronh-8b small]

Each (preset, block, L) runs in a fresh process. By default the blocks run on the ``meta``
device: every kernel, custom op and autograd node runs with its real shapes but no data, so
the bytes are those of a CPU run (what is kept depends on shapes only) at no compute cost --
one 8B-width block takes minutes of CPU per policy otherwise. Attention always runs on the CPU:
``scaled_dot_product_attention`` picks its kernel (and so what it keeps) by device. ``--device
cpu`` runs everything for real; with ``meta`` the script cross-checks one case (the ``small``
preset at the first length) on the CPU and records both. Prints tables and writes benchmarks/results/long_context_saved.{json,md}.

``step``: one training step (forward, backward, AdamW) of the ``tiny`` preset on one packed row
of L tokens at cp=4 on 4 processes of this machine, float32, through the documented CLI:

    hybridpar train --config configs/tiny-hybrid.yaml --nproc-per-node 4 data.pack_size=131072 \
        data.packs_per_step=1 data.seed=1 data.task_options.min_len=1024 data.task_options.max_len=32768 \
        parallel.cp=4 parallel.tp=1 parallel.sequence_parallel=false train.steps=1 \
        train.eval_every=0 checkpoint.every=-1 output_dir=runs/long-context plot=false tensorboard=false

(MQAR documents of uniform random length in [1024, 32768], packed best-fit decreasing, so a
row holds documents of similar length; ``data.seed=1`` gives a first row of 9 documents of
1.5K-16.6K tokens at L=131072, 2 at 32768 and 4 at 65536. Attention CP
``allgather``, Mamba CP ``a2a``, as the default job). Each L (default 32768, 65536, 131072, and
a 4096-token baseline that measures what does not depend on L: torch, the model, AdamW, the
process group) runs as its own ``hybridpar train`` job, one after another. The script polls
``VmHWM`` (peak resident set) of every worker process under the launcher, by ``RANK``, and
reads the step time from ``metrics.jsonl``. Growth from 32K to 128K is the log-log slope of
the per-rank peak (and of the peak above the baseline).

    python benchmarks/long_context.py --section step [--step-lengths 32768 65536 131072]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import harness
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

POLICIES = ("none", "full", "selective")
BLOCKS = {"mamba_packed": "M", "mamba_one_doc": "M", "mlp": "-", "attention": "*"}
BLOCK_NAMES = {"mamba_packed": "Mamba2, packed (document resets)", "mamba_one_doc": "Mamba2, one document",
               "mlp": "MLP", "attention": "attention (one document)"}
DOCS_PER_PACK = 8
# The measurement before this work (nemotronh-8b widths, float32, no checkpointing), KiB per token.
BEFORE_NONE = {"mamba_packed": 724, "mamba_one_doc": 605, "mlp": 216, "attention": 112}
TARGETS = {"mamba_packed_none_kib": 200, "selective_over_none": 0.35}


class _StorageTracker(TorchDispatchMode):
    """Weak references to the storage of every tensor an op returns (no strong reference kept)."""

    def __init__(self):
        super().__init__()
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                storage = t.untyped_storage()
                self.storages.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        return out


def _packed_params(seqlen: int):
    from hybridpar.data.thd import PackedSeqParams

    gen = torch.Generator().manual_seed(1)
    cuts = torch.randperm(seqlen - 1, generator=gen)[: DOCS_PER_PACK - 1].sort().values + 1
    return PackedSeqParams.from_cu_seqlens(torch.cat([torch.tensor([0]), cuts, torch.tensor([seqlen])]).int())


def measure_block(preset: str, block: str, seqlen: int, device: str = "meta") -> dict:
    """KiB per token kept for backward by one block, under each policy (this process)."""
    from hybridpar.models.hybrid import HybridConfig, build_block
    from hybridpar.parallel.checkpointing import apply_activation_checkpointing

    torch.manual_seed(0)
    config = HybridConfig.from_preset(preset)
    packed = _packed_params(seqlen) if block == "mamba_packed" else None
    results = {}
    if packed is not None:
        packed = packed.to(device) if hasattr(packed, "to") else packed
    for policy in POLICIES:
        holder = torch.nn.Module()
        holder.layers = torch.nn.ModuleList([build_block(config, BLOCKS[block])]).to(device)
        apply_activation_checkpointing(holder, policy)
        params = {p.untyped_storage()._cdata for p in holder.parameters()}
        x = torch.randn(1, seqlen, config.hidden_size, device=device, requires_grad=True)
        hooked = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage._cdata not in params:
                hooked[storage._cdata] = storage.nbytes()
            return t

        if policy == "selective":  # the policy learns the block's matmul count in its first forward
            holder.layers[0](x, packed).sum().backward()
        tracker = _StorageTracker()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tracker:
            out = holder.layers[0](x, packed)
        gc.collect()
        skip = {out.untyped_storage()._cdata, x.untyped_storage()._cdata, *params}  # views of these are recorded too
        live = sum(n for key, (ref, n) in tracker.storages.items() if not ref.expired() and key not in skip)
        kept = live + x.untyped_storage().nbytes()
        results[policy] = {"kib_per_token": kept / 1024 / seqlen}
        if policy == "none":
            results[policy]["hooks_kib_per_token"] = sum(hooked.values()) / 1024 / seqlen
        out.sum().backward()  # the graph is complete and runs
        del out, holder, x
        gc.collect()
    return results


def run_worker(preset: str, block: str, seqlen: int, device: str) -> dict:
    """``measure_block`` in a fresh process, one thread."""
    return harness.run_fresh(measure_block, preset, block, seqlen, device, threads=1)


def model_totals(preset: str, per_block: dict) -> dict:
    """KiB per token of the whole model (blocks only) under each policy: the pattern's weighted sum."""
    from hybridpar.models.hybrid import HybridConfig

    pattern = HybridConfig.from_preset(preset).pattern
    counts = {"mamba_packed": pattern.count("M"), "mlp": pattern.count("-"), "attention": pattern.count("*")}
    totals = {p: sum(n * per_block[b][p]["kib_per_token"] for b, n in counts.items()) for p in POLICIES}
    return {"pattern": pattern, "counts": counts, "kib_per_token": totals,
            "selective_over_none": totals["selective"] / totals["none"], "full_over_none": totals["full"] / totals["none"]}


def before_totals(model: dict) -> dict:
    """The whole model with ``none`` as the issue measured it before this work, and selective against it."""
    none = sum(n * BEFORE_NONE[b] for b, n in model["counts"].items())
    return {"none_kib_per_token": none, "selective_over_before_none": model["kib_per_token"]["selective"] / none}


def section_saved(args) -> None:
    record = {**_started(),
              "dtype": "float32", "device": args.device, "docs_per_pack": DOCS_PER_PACK, "presets": {}}
    for preset in args.presets:
        blocks = {}
        for block in BLOCKS:
            blocks[block] = {}
            for seqlen in args.lengths:
                print(f"{preset} {block} L={seqlen} ...", flush=True)
                device = "cpu" if block == "attention" else args.device
                blocks[block][seqlen] = run_worker(preset, block, seqlen, device)
        longest = max(args.lengths)
        record["presets"][preset] = {"blocks": blocks, "model": model_totals(preset, {b: v[longest] for b, v in blocks.items()})}
    if args.device == "meta":  # the same case computed for real must give the same bytes
        preset, seqlen = args.presets[-1], args.lengths[0]
        cross = {b: run_worker(preset, b, seqlen, "cpu") for b in BLOCKS if b != "attention"}
        meta = {b: record["presets"][preset]["blocks"][b][seqlen] for b in BLOCKS}
        record["cpu_cross_check"] = {"preset": preset, "seqlen": seqlen, "cpu": cross,
                                     "equal": all(cross[b][p]["kib_per_token"] == meta[b][p]["kib_per_token"]
                                                  for b in cross for p in POLICIES)}
    record["machine"]["load_avg_end"] = os.getloadavg()
    eight_b = record["presets"].get("nemotronh-8b")
    if eight_b:
        mamba = max(v["none"]["kib_per_token"] for v in eight_b["blocks"]["mamba_packed"].values())
        ratio = eight_b["model"]["selective_over_none"]
        record["targets"] = {
            "mamba_packed_none_kib": {"value": mamba, "target": "<= 200", "met": mamba <= 200},
            "selective_over_none": {"value": ratio, "target": "<= 0.35", "met": ratio <= 0.35},
        }
        record["before_this_work"] = before_totals(eight_b["model"])
    harness.write_results("long_context_saved", record, to_markdown(record))


def _started() -> dict:
    """The command, date and machine of a section's record."""
    env = harness.environment(__file__)
    return {"command": env["command"], "date": env["date"],
            "machine": {"platform": platform.platform(), "cpus": env["cpus"], "torch": env["torch"],
                        "load_avg_start": env["load_average"]}}


def to_markdown(record: dict) -> str:
    lines = ["# Long context: bytes kept for backward per token (CPU, float32)", "",
             f"Command: `{record['command']}`  ", f"Date: {record['date']}  ",
             f"Machine: {record['machine']['cpus']} CPUs, torch {record['machine']['torch']} (tensor bytes: load does not matter)  ",
             f"Packed rows: {record['docs_per_pack']} documents of random lengths. Live-storage measurement; "
             "`hooks` = saved-tensor hooks (policy none).  ",
             f"Device: {record['device']}" + (f" (cross-check on cpu, {record['cpu_cross_check']['preset']} L="
                                              f"{record['cpu_cross_check']['seqlen']}: "
                                              f"{'identical bytes' if record['cpu_cross_check']['equal'] else 'DIFFERENT bytes'})"
                                              if "cpu_cross_check" in record else ""), ""]
    for preset, data in record["presets"].items():
        lines += [f"## {preset}", "", "| block | L | none (KiB/token) | hooks | full | selective | none before this work |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for block, by_len in data["blocks"].items():
            for seqlen, r in by_len.items():
                before = BEFORE_NONE[block] if preset == "nemotronh-8b" else ""
                lines.append(f"| {BLOCK_NAMES[block]} | {seqlen} | {r['none']['kib_per_token']:.1f} | "
                             f"{r['none']['hooks_kib_per_token']:.1f} | {r['full']['kib_per_token']:.1f} | "
                             f"{r['selective']['kib_per_token']:.1f} | {before} |")
        model = data["model"]
        totals = model["kib_per_token"]
        lines += ["", f"Whole model (pattern `{model['pattern']}`: {model['counts']['mamba_packed']} Mamba2 packed, "
                  f"{model['counts']['mlp']} MLP, {model['counts']['attention']} attention), blocks only, per token:", "",
                  "| policy | KiB per token | MiB per token | / none |", "|---|---:|---:|---:|"]
        for policy in POLICIES:
            lines.append(f"| {policy} | {totals[policy]:.0f} | {totals[policy] / 1024:.2f} | {totals[policy] / totals['none']:.2f} |")
        lines.append("")
    for name, item in record.get("targets", {}).items():
        lines.append(f"- {name}: {item['value']:.2f} (target {item['target']}): {'met' if item['met'] else 'MISSED'}")
    if "before_this_work" in record:
        before = record["before_this_work"]
        lines.append(f"- nemotronh-8b with `none` before this work: {before['none_kib_per_token']:.0f} KiB "
                     f"({before['none_kib_per_token'] / 1024:.1f} MiB) per token; `selective` now is "
                     f"{before['selective_over_before_none']:.2f}x of that")
    return "\n".join(lines) + "\n"


STEP_BASELINE = 4096
STEP_TARGETS = {"peak_gib_at_131072": 3.0, "exponent_32k_to_128k": 1.05}


def step_command(seqlen: int, output_dir: str) -> list[str]:
    """The ``hybridpar train`` arguments of one long-context step (the documented invocation)."""
    return ["train", "--config", "configs/tiny-hybrid.yaml", "--nproc-per-node", "4", "model.preset=tiny",
            f"data.pack_size={seqlen}", "data.packs_per_step=1", "data.seed=1", "data.task_options.min_len=1024",
            f"data.task_options.max_len={min(32768, seqlen)}", "parallel.cp=4", "parallel.tp=1",
            "parallel.sequence_parallel=false", "train.steps=1", "train.eval_every=0", "checkpoint.every=-1",
            f"output_dir={output_dir}", "plot=false", "tensorboard=false"]


def _children() -> dict[int, list[int]]:
    tree = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            tree.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    return tree


def _descendants(root: int) -> list[int]:
    tree, found, todo = _children(), [], [root]
    while todo:
        kids = tree.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _rank_and_peak(pid: int) -> tuple[int, int] | None:
    """``(RANK, VmHWM bytes)`` of a worker process, None for other processes."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    rank = next((int(v[5:]) for v in env if v.startswith(b"RANK=")), None)
    hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), None)
    return None if rank is None or hwm is None else (rank, hwm)


def run_step(seqlen: int, workdir: Path) -> dict:
    """One ``hybridpar train`` step of ``seqlen`` tokens: per-rank peak RSS, step time, documents."""
    output_dir = workdir / f"step_{seqlen}"
    command = [sys.executable, "-m", "hybridpar", *step_command(seqlen, str(output_dir))]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=harness.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=harness.child_env())
    peaks: dict[int, int] = {}
    while process.poll() is None:
        for pid in _descendants(process.pid):
            found = _rank_and_peak(pid)
            if found:
                peaks[found[0]] = max(peaks.get(found[0], 0), found[1])
        time.sleep(0.5)
    output = process.stdout.read()
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n{output}")
    metrics = json.loads((output_dir / "metrics.jsonl").read_text().splitlines()[0])
    return {"seqlen": seqlen, "peak_rss_gib_by_rank": {r: peaks[r] / 2**30 for r in sorted(peaks)},
            "step_s": seqlen / metrics["tokens_per_s"], "job_s": time.perf_counter() - started,
            "loss": metrics["loss"], "documents": _document_lengths(seqlen), "log": output.strip().splitlines()[-1]}


def _document_lengths(seqlen: int) -> list[int]:
    """Document lengths of the step's packed row (before padding), rebuilt from the same config."""
    from hybridpar.config import load_config
    from hybridpar.train.batches import PackStream

    config = load_config(harness.ROOT / "configs/tiny-hybrid.yaml", step_command(seqlen, "unused")[5:])
    stream = PackStream(config.data, config.parallel.cp, 256)
    return stream.step_packs(0)[0]["seq_lens"].tolist()


def section_step(args) -> None:
    import tempfile

    record = {**_started(), "cli": "hybridpar " + " ".join(step_command(131072, "runs/long-context")),
              "layout": "cp=4 (allgather attention, a2a Mamba), 4 processes, float32, tiny preset", "cases": []}
    with tempfile.TemporaryDirectory(prefix="hybridpar-long-context-") as workdir:
        for seqlen in [STEP_BASELINE, *args.step_lengths]:
            print(f"step L={seqlen} ...", flush=True)
            case = run_step(seqlen, Path(workdir))
            print(f"  peak {max(case['peak_rss_gib_by_rank'].values()):.2f} GiB, step {case['step_s']:.0f} s", flush=True)
            record["cases"].append(case)
    record["machine"]["load_avg_end"] = os.getloadavg()
    base = max(record["cases"][0]["peak_rss_gib_by_rank"].values())
    long = [c for c in record["cases"][1:]]
    peaks = [max(c["peak_rss_gib_by_rank"].values()) for c in long]
    lengths = [c["seqlen"] for c in long]
    if len(long) >= 2:
        record["growth"] = {"exponent_peak": harness.log_slope(zip(lengths, peaks)),
                            "exponent_above_baseline": harness.log_slope(zip(lengths, [p - base for p in peaks])),
                            "exponent_step_time": harness.log_slope(zip(lengths, [c["step_s"] for c in long]))}
    if 131072 in lengths and len(long) >= 2:
        peak = peaks[lengths.index(131072)]
        record["targets"] = {
            "peak_gib_at_131072": {"value": peak, "target": "<= 3", "met": peak <= 3.0},
            "exponent_32k_to_128k": {"value": record["growth"]["exponent_peak"], "target": "<= 1.05",
                                     "met": record["growth"]["exponent_peak"] <= 1.05},
        }
    harness.write_results("long_context_step", record, step_markdown(record))


def step_markdown(record: dict) -> str:
    lines = ["# Long context: one training step of the tiny preset, one packed row, cp=4 (CPU, float32)", "",
             f"Command: `{record['command']}`  ", f"Date: {record['date']}  ",
             f"Machine: {record['machine']['cpus']} CPUs shared with other jobs (load average "
             f"{record['machine']['load_avg_start'][0]:.1f} at the start, {record['machine']['load_avg_end'][0]:.1f} at the end), "
             f"torch {record['machine']['torch']}: times are noisy  ", f"Layout: {record['layout']}  ", "",
             "Each case is this CLI job (L = pack_size; baseline: max_len 4096):", "", f"    {record['cli']}", "",
             "| L (tokens) | documents (lengths) | peak RSS per rank (GiB), ranks 0-3 | max | step time (s) | loss |",
             "|---:|---|---|---:|---:|---:|"]
    for case in record["cases"]:
        peaks = case["peak_rss_gib_by_rank"]
        docs = case["documents"]
        shown = f"{len(docs)}: " + ", ".join(str(d) for d in docs) if len(docs) <= 12 else f"{len(docs)} (min {min(docs)}, max {max(docs)})"
        name = f"{case['seqlen']} (baseline)" if case is record["cases"][0] else str(case["seqlen"])
        lines.append(f"| {name} | {shown} | {' / '.join(f'{v:.2f}' for v in peaks.values())} | "
                     f"{max(peaks.values()):.2f} | {case['step_s']:.0f} | {case['loss']:.3f} |")
    if "growth" in record:
        growth = record["growth"]
        lines += ["", f"Growth over L (log-log slope): peak RSS {growth['exponent_peak']:.2f}, peak above the baseline "
                  f"{growth['exponent_above_baseline']:.2f}, step time {growth['exponent_step_time']:.2f}."]
    lines.append("")
    for name, item in record.get("targets", {}).items():
        lines.append(f"- {name}: {item['value']:.2f} (target {item['target']}): {'met' if item['met'] else 'MISSED'}")
    return "\n".join(lines) + "\n"


SECTIONS = {"saved": section_saved, "step": section_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=sorted(SECTIONS), default="saved")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--presets", nargs="+", default=["nemotronh-8b", "small"])
    parser.add_argument("--step-lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--device", default="meta", choices=["meta", "cpu"], help="meta: real shapes, no compute (default)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    SECTIONS[args.section](args)


if __name__ == "__main__":
    main()
