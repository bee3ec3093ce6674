"""Where an eager bf16 step's memory traffic goes: bytes per part of the model, with the fused kernels.

Eager on a GPU every op is a kernel that reads its inputs from memory and writes its outputs back;
outside the matmuls and the fused kernels a step is memory-bound, so bytes moved are time. This runs
one step (forward and backward) of a preset in bf16 mixed precision (``parallel.mixed_precision=bf16``
on one process: ``torch.autocast``, float32 master weights and residual stream) on the fused path
the GPU takes, and counts, with a dispatch mode, every aten op and the bytes of its tensor inputs and
outputs (views and ``empty`` move nothing, ``zeros_like``-like ops only write, an ``out=`` tensor is
written, not read; an in-place scatter touches only the elements it indexes; a broadcast input is
read once; a ``reshape`` that copies is a copy), by the part of the model it belongs to:

- forward: the innermost module running (forward hooks);
- backward: the module whose forward recorded the autograd node running (a walk of each module's new
  graph, innermost first);
- our own custom ops (``hybridpar::fused_conv_scan``, the LM head loss) are opened: their eager insides
  run as separate kernels on a GPU too;
- FLA's kernels (the Mamba2 scan ``chunk_simple_gla``, ``causal_conv1d``, the gated norm), torch's
  fused RMSNorm, FlashAttention and the steps compiled inside our custom ops on CUDA
  (``models/cuda_compile.py``) run as stand-ins (``kernel_io.py``) that count one read of their
  inputs and one write of their outputs (their insides, e.g. the scan's chunk states, are not counted:
  a lower bound there); matmuls are counted the same way and not computed (shapes only).

Counts depend on shapes only, so a CPU gives the GPU's figure. To keep the CPU run short the model has
one block of each kind at the preset's widths; each block's bytes are multiplied by the number of such
blocks in the preset's pattern. The milliseconds are bytes at the device's memory bandwidth (H200:
4.8 TB/s), a lower bound on time, not a measurement; the matmul rows are compute-bound on a GPU.

    python benchmarks/step_traffic.py [--cases 1b:8192 small:131072]

Writes ``step_traffic.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts this checkout's src/ first on sys.path)

from gpu_throughput import doc_lengths, packed_batch  # noqa: E402
from hybridpar.models.hybrid import HybridConfig, HybridLM  # noqa: E402
from kernel_io import kernel_stand_ins  # noqa: E402
from hybridpar.parallel.dims import ParallelDims  # noqa: E402
from hybridpar.parallel.parallelize import parallelize  # noqa: E402

BANDWIDTH = 4.8e12  # bytes/s, NVIDIA H200 HBM3e
MATMULS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "linear", "matmul"}
VIEWS = {"_unsafe_view", "promote_types"}  # a view without alias annotation; a dtype query
FACTORIES = {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"}  # write, read nothing
EMPTY = {"empty", "new_empty", "empty_like", "empty_strided"}  # allocate only
SCATTERS = {"scatter_", "scatter_add_", "index_add_", "index_copy_", "index_put_"}  # touch the indexed elements only
KINDS = {"M": "Mamba2Mixer", "*": "Attention", "-": "MLP"}


def nbytes(tensors) -> int:
    """Bytes of the distinct elements: a broadcast (stride-0) dimension is read once, not per index."""
    return sum(t.element_size() * math.prod(n for n, step in zip(t.shape, t.stride()) if step != 0)
               for t in tensors if isinstance(t, torch.Tensor) and t.numel())


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.numel()}


class Traffic(TorchDispatchMode):
    """Ops and bytes per ``(phase, part, kind)``; ``part`` from ``where()``."""

    def __init__(self, where):
        super().__init__()
        self.where, self.pinned = where, None
        self.rows = defaultdict(lambda: [0, 0])

    def record(self, kind: str, tensors, op: str = "fused kernel") -> None:
        phase, part = self.pinned or self.where()
        row = self.rows[(phase, part, kind, op)]
        row[0] += 1
        row[1] += nbytes(tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("hybridpar::"):
            outer, self.pinned = self.pinned, self.pinned or self.where()
            try:
                with self:  # its insides are kernels of their own on a GPU: run its Python body here
                    return torch._library.custom_ops._maybe_get_opdef(func)._init_fn(*args, **kwargs)
            finally:
                self.pinned = outer
        base = name.split("::")[-1]
        kind = "matmul" if base.rstrip("_") in MATMULS else "other ops"
        out = func(*args, **kwargs) if kind == "other ops" else shapes_only(func, args, kwargs)
        if base in VIEWS or any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            if storages(outputs) <= storages(torch.utils._pytree.tree_leaves((args, kwargs))):
                return out  # a view of an input
            # a composite that may return a view copied instead (``reshape`` of an expanded tensor, reached
            # directly where autograd's keys are excluded, as inside a custom op): a read and a write
            self.record(kind, torch.utils._pytree.tree_leaves((args, kwargs)) + outputs, base)
            return out
        if base in EMPTY:
            return out
        if base in SCATTERS:  # reads its index and values, writes as many elements of its target
            touched = torch.utils._pytree.tree_leaves((args[1:], kwargs))
            self.record(kind, touched + [t for t in touched[-1:] if isinstance(t, torch.Tensor)], base)
            return out
        read = () if base in FACTORIES else (args, {k: v for k, v in kwargs.items() if k != "out"})
        self.record(kind, torch.utils._pytree.tree_leaves((read, out)), base)
        return out


def shapes_only(func, args, kwargs):
    """``func``'s outputs as zeros of their shapes, not computed (its meta kernel gives the shapes): a
    matmul's bytes depend on shapes alone, and this CPU's bf16 matmuls are slow (0.3 GFLOP/s).
    An in-place op (``addmm_``) returns its target as it was."""
    if any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns):
        return args[0]
    meta = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    out = func(*meta[0], **meta[1])
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype), out)


class Parts:
    """Which part of the model runs: a module stack in the forward, the owner of each autograd node
    in the backward (``torch._C._current_autograd_node``)."""

    def __init__(self, model: torch.nn.Module):
        self.stack, self.owner, self.handles = ["step"], {}, []
        kinds = {}
        for name, module in model.named_modules():
            match = re.match(r"backbone\.layers\.(\d+)$", name)
            if match:
                kinds[match.group(1)] = type(module.mixer).__name__
        for name, module in model.named_modules():
            part = self.part_name(name, kinds)
            self.handles.append(module.register_forward_pre_hook(self._enter(part), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._leave(part), with_kwargs=True))

    @staticmethod
    def part_name(name: str, kinds: dict[str, str]) -> str:
        match = re.match(r"backbone\.layers\.(\d+)(\.(.*))?$", name)
        if match:
            return f"{kinds[match.group(1)]} block: {match.group(3) or 'residual'}"  # norm, mixer, mixer.in_proj...
        return {"": "LM head + loss", "backbone": "backbone", "lm_head": "LM head + loss"}.get(
            name, name.removeprefix("backbone."))

    def _enter(self, part):
        def hook(module, args, kwargs):
            self.stack.append(part)
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            module._traffic_inputs = {t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn}
        return hook

    def _leave(self, part):
        def hook(module, args, kwargs, output):
            self.stack.pop()
            boundary = module.__dict__.pop("_traffic_inputs")
            todo = [t.grad_fn for t in torch.utils._pytree.tree_leaves(output)
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            seen = set()
            while todo:
                node = todo.pop()
                if node in seen or node in boundary:
                    continue
                seen.add(node)
                self.owner.setdefault(node, part)  # innermost module first
                todo += [n for n, _ in node.next_functions if n is not None]
        return hook

    def where(self) -> tuple[str, str]:
        node = torch._C._current_autograd_node()
        if node is None:
            return "forward", self.stack[-1]
        return "backward", self.owner.get(node, "step")

    def close(self):
        for handle in self.handles:
            handle.remove()


def one_of_each(preset: str) -> tuple[HybridConfig, dict[str, int]]:
    """The preset's widths with one block of each kind, and how many of each the preset has."""
    config = HybridConfig.from_preset(preset)
    kinds = sorted(set(config.pattern), key=config.pattern.index)
    counts = {KINDS[k]: config.pattern.count(k) for k in kinds}
    return dataclasses.replace(config, pattern="".join(kinds)), counts


def measure(preset: str, tokens: int) -> list[dict]:
    config, counts = one_of_each(preset)
    torch.manual_seed(0)
    model = parallelize(HybridLM(config), ParallelDims(), mixed_precision="bf16")
    ids, labels, packed = packed_batch(config.vocab_size, doc_lengths(tokens), torch.device("cpu"))
    parts = Parts(model)
    traffic = Traffic(parts.where)
    with kernel_stand_ins(traffic), traffic:
        loss_sum, count = model(ids, packed=packed, labels=labels)
        (loss_sum / count).backward()
    parts.close()
    rows = []
    for (phase, part, kind, op), (ops, size) in sorted(traffic.rows.items()):
        block = next((name for name in counts if part.startswith(f"{name} block")), None)
        times = counts[block] if block else 1
        rows.append({"phase": phase, "part": part, "kind": kind, "op": op, "per_step": times, "ops": ops * times,
                     "gb": size * times / 1e9, "ms": 1e3 * size * times / BANDWIDTH})
    return rows


def optimizer_row(preset: str) -> dict:
    """Fused AdamW on float32 masters: reads parameter, gradient and both moments, writes back three."""
    with torch.device("meta"):
        params = HybridLM(HybridConfig.from_preset(preset)).num_parameters()
    size = 7 * 4 * params
    return {"phase": "optimizer", "part": "AdamW (fused)", "kind": "fused kernels", "op": "fused kernel",
            "per_step": 1, "ops": 1,
            "gb": size / 1e9, "ms": 1e3 * size / BANDWIDTH}


def parts_table(rows: list[dict]) -> list[dict]:
    """Per part: forward and backward GB of the non-matmul ops (other ops + fused kernels) and the matmuls."""
    table = defaultdict(lambda: defaultdict(float))
    for row in rows:
        entry = table[row["part"]]
        column = "matmul_gb" if row["kind"] == "matmul" else f"{row['phase']}_gb"
        entry[column] += row["gb"]
        if row["kind"] == "other ops":
            entry["other_ops"] += row["ops"]
            entry["other_gb"] += row["gb"]
    out = [{"part": part, **{k: entry.get(k, 0.0) for k in ("forward_gb", "backward_gb", "optimizer_gb", "matmul_gb",
                                                             "other_ops", "other_gb")}} for part, entry in table.items()]
    for entry in out:
        entry["memory_bound_gb"] = entry["forward_gb"] + entry["backward_gb"] + entry["optimizer_gb"]
        entry["ms"] = 1e3 * entry["memory_bound_gb"] * 1e9 / BANDWIDTH
    return sorted(out, key=lambda e: -e["memory_bound_gb"])


def summary(rows: list[dict], table: list[dict]) -> dict:
    """Totals of a case: GB outside the matmuls, its lower bound in ms, the matmuls' GB and the op counts."""
    total = sum(e["memory_bound_gb"] for e in table)
    ops = {kind: sum(r["ops"] for r in rows if r["kind"] == kind) for kind in ("other ops", "matmul", "fused kernels")}
    return {"gb": total, "ms": 1e3 * total * 1e9 / BANDWIDTH, "matmul_gb": sum(e["matmul_gb"] for e in table),
            "other_ops": ops["other ops"], "matmul_ops": ops["matmul"], "kernel_ops": ops["fused kernels"]}


def case_lines(case: dict) -> list[str]:
    head = case["summary"]
    blocks = ", ".join(f"{n} x {k}" for k, n in case["blocks"].items())
    lines = ["", f"## {case['preset']} at {case['tokens']:,} tokens ({blocks})", "",
             f"Outside the matmuls: **{head['gb']:,.1f} GB, >= {head['ms']:,.0f} ms** at 4.8 TB/s, "
             f"{head['other_ops']:,} other ops, {head['kernel_ops']:,} fused kernels; the {head['matmul_ops']:,} "
             f"matmuls' operands and results: {head['matmul_gb']:,.1f} GB.", "",
             "| part | forward GB | backward GB | optimizer GB | ms at 4.8 TB/s | other ops (count) | other ops GB "
             "| matmul GB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    return lines + [f"| {e['part']} | {e['forward_gb']:.2f} | {e['backward_gb']:.2f} | {e['optimizer_gb']:.2f} | "
                    f"{e['ms']:.1f} | {e['other_ops']:,.0f} | {e['other_gb']:.2f} | {e['matmul_gb']:.2f} |"
                    for e in case["parts"]]


def markdown(meta: dict, cases: list[dict]) -> str:
    lines = harness.header("Memory traffic of one eager bf16 step, by part of the model", meta)
    lines += ["", "One block of each kind measured, times the preset's count. GB read + written by the ops outside "
              "the matmuls (aten ops, and the fused kernels' inputs and outputs once; views excluded), forward and "
              "backward, and the fused AdamW's; ms: those bytes at 4.8 TB/s (H200), a lower bound on time, not a "
              "measurement. `other ops`: the aten ops that are neither matmuls nor fused kernels (each a kernel "
              "launch on a GPU)."]
    for case in cases:
        lines += case_lines(case)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["1b:8192", "small:131072"], help="preset:tokens")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    meta = harness.environment(__file__, argv)
    cases = []
    for spec in args.cases:
        preset, tokens = spec.split(":")
        rows = measure(preset, int(tokens)) + [optimizer_row(preset)]
        table = parts_table(rows)
        cases.append({"preset": preset, "tokens": int(tokens), "blocks": one_of_each(preset)[1],
                      "summary": summary(rows, table), "parts": table, "rows": rows})
        print(cases[-1]["summary"], flush=True)
    harness.write_results("step_traffic", {"meta": meta, "cases": cases}, markdown(meta, cases), out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
