"""Memory traffic of the pure norms against the fused kernels, per step of a preset in bf16 mixed precision.

Eager on a GPU every elementwise op reads its inputs from memory and writes its outputs back, so a
norm written as a dozen float32 ops moves its ``[T, d]`` activations a dozen times. This runs one
norm of each kind at the preset's shapes, forward and backward, in the dtypes a bf16 mixed-precision
step gives it (``parallel.mixed_precision=bf16`` without FSDP):

- ``RMSNorm``: input and output float32 (the residual stream), the gradient float32;
- Mamba2's ``GatedRMSNorm``: the scan output ``y`` and the gate ``z`` in bf16 (the fused scan's
  output and ``in_proj``'s, under autocast), the gradient float32 (the pure norm's output is float32);

and counts, with a dispatch mode, each aten op and the bytes of its tensor inputs and outputs (views
move nothing and are left out). A fused kernel reads its inputs and writes its outputs once: those
bytes are counted from the same tensors (``models/norm_kernels.py``: torch's ``_fused_rms_norm``
and FLA's gated group norm, forward and backward, plus FLA's ``[NS, d]`` weight-gradient partials,
taken as one SM row each of 132). Counts depend on shapes only, so a CPU gives the GPU's figure.
The milliseconds are those bytes at the device's memory bandwidth (H200: 4.8 TB/s), a lower bound
on the time, not a measurement.

    python benchmarks/norm_traffic.py [--cases 1b:8192 1b:32768 small:131072]

Writes ``norm_traffic.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts this checkout's src/ first on sys.path)

from hybridpar.models.blocks import RMSNorm, gated_rms_norm  # noqa: E402
from hybridpar.models.hybrid import HybridConfig  # noqa: E402

BANDWIDTH = 4.8e12  # bytes/s, NVIDIA H200 HBM3e
SMS = 132  # FLA's backward writes one [d] float32 row of weight-gradient partials per program (~SM count)


class Traffic(TorchDispatchMode):
    """Every op dispatched inside, and the bytes of its tensor inputs and outputs (views: none)."""

    def __init__(self):
        super().__init__()
        self.ops, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            return out  # a view of an input
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        self.ops += 1
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rms_norm_case(tokens: int, width: int) -> dict:
    x = torch.randn(tokens, width, requires_grad=True)  # the float32 residual stream
    norm = RMSNorm(width)
    with Traffic() as forward:
        y = norm(x)
    dy = torch.randn_like(y)
    with Traffic() as backward:
        y.backward(dy)
    rstd = tokens * 4
    fused = (nbytes(x, norm.weight, y) + rstd) + (nbytes(dy, x, norm.weight, x.grad, norm.weight.grad) + rstd)
    return {"pure_ops": forward.ops + backward.ops, "pure_bytes": forward.bytes + backward.bytes,
            "fused_ops": 2, "fused_bytes": fused}


def gated_norm_case(tokens: int, width: int, group: int) -> dict:
    x = torch.randn(tokens, width).bfloat16().requires_grad_()  # the scan output
    z = torch.randn(tokens, width).bfloat16().requires_grad_()  # the gate (in_proj's output)
    weight = torch.ones(width, requires_grad=True)
    with Traffic() as forward:
        y = gated_rms_norm(x, z, weight, group, 1e-5)
    dy = torch.randn(y.shape, dtype=torch.float32)
    with Traffic() as backward:
        y.backward(dy)
    rstd = tokens * (width // group) * 4
    y_fused = tokens * width * 2  # FLA writes y in x's dtype
    partials = SMS * width * 4
    fused = (nbytes(x, z, weight) + y_fused + rstd) + (
        nbytes(dy, x, z, weight) + rstd + nbytes(x.grad, z.grad) + 2 * partials + nbytes(weight.grad))
    return {"pure_ops": forward.ops + backward.ops, "pure_bytes": forward.bytes + backward.bytes,
            "fused_ops": 3, "fused_bytes": fused}  # forward, backward, the partials' sum


def rows_for(preset: str, tokens: int) -> list[dict]:
    c = HybridConfig.from_preset(preset)
    d_inner = c.mamba_num_heads * c.mamba_head_dim
    kinds = [("RMSNorm", len(c.pattern) + 1, lambda: rms_norm_case(tokens, c.hidden_size)),
             ("GatedRMSNorm", c.pattern.count("M"), lambda: gated_norm_case(tokens, d_inner, d_inner // c.mamba_n_groups))]
    rows = []
    for name, per_step, run in kinds:
        row = {"preset": preset, "tokens": tokens, "norm": name, "per_step": per_step, **run()}
        saved = per_step * (row["pure_bytes"] - row["fused_bytes"])
        row.update(step_pure_gb=per_step * row["pure_bytes"] / 1e9, step_fused_gb=per_step * row["fused_bytes"] / 1e9,
                   step_saved_ms=1e3 * saved / BANDWIDTH)
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["1b:8192", "1b:32768", "small:131072"], help="preset:tokens")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    meta = harness.environment(__file__, argv)
    rows = []
    for case in args.cases:
        preset, tokens = case.split(":")
        rows += rows_for(preset, int(tokens))
    lines = harness.header("Memory traffic of the norms per bf16 mixed-precision step: pure ops against fused kernels", meta)
    lines += ["", "Per norm, forward and backward: aten ops and bytes read + written (dispatch mode, views excluded); "
              "per step: that times the norms of the preset. The last column is the bytes saved at 4.8 TB/s "
              "(H200), a lower bound on time, not measured.", "",
              "| preset | tokens | norm | per step | pure ops | pure MB | fused kernels | fused MB | step pure GB | "
              "step fused GB | saved ms at 4.8 TB/s |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['preset']} | {r['tokens']:,} | {r['norm']} | {r['per_step']} | {r['pure_ops']} | "
              f"{r['pure_bytes'] / 1e6:,.0f} | {r['fused_ops']} | {r['fused_bytes'] / 1e6:,.0f} | "
              f"{r['step_pure_gb']:.1f} | {r['step_fused_gb']:.1f} | {r['step_saved_ms']:.1f} |" for r in rows]
    harness.write_results("norm_traffic", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n", out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
