"""How many aten ops the pure chunked SSD core dispatches, forward and backward, per Mamba layer.

On a GPU every op is a kernel launch, and a few microseconds of host dispatch each: when a layer
dispatches thousands of small ops, the host bounds the step and the GPU waits. The diagonal blocks
(``models/mamba/ssd_chunked.py``, step 1) run a slice of chunks at a time, as many as fit
``DIAGONAL_SLICE_BYTES`` of ``[k, G, R, Q, Q]`` float32; each slice is a dozen ops or more. This
counts, with ``tests/op_outputs.OpOutputs`` (a dispatch mode), the ops of ``ssd_chunked.forward``
and ``backward`` on float32 CPU tensors of each preset's Mamba shapes (8 documents), for each slice
budget. The count depends on the shapes only, not on the device, so a CPU gives the GPU's figure.
Wall time is not measured.

    python benchmarks/ssd_ops.py [--budgets-mib 16 256] [--cases 1b:8192 small:32768]

Writes ``ssd_ops.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts this checkout's src/ first on sys.path)

from hybridpar.models.hybrid import HybridConfig  # noqa: E402
from hybridpar.models.mamba import ssd_chunked  # noqa: E402
from tests.op_outputs import OpOutputs  # noqa: E402  (every dispatched op, in order)


def count(preset: str, tokens: int, docs: int = 8) -> tuple[int, int]:
    """``(forward ops, backward ops)`` of one layer's SSD core at ``tokens`` tokens."""
    c = HybridConfig.from_preset(preset)
    heads, p, g, n = c.mamba_num_heads, c.mamba_head_dim, c.mamba_n_groups, c.ssm_state_size
    gen = torch.Generator().manual_seed(0)
    x, dt = torch.randn(1, tokens, heads, p, generator=gen), torch.rand(1, tokens, heads, generator=gen)
    A, D = -torch.rand(heads, generator=gen), torch.randn(heads, generator=gen)
    B, C = (torch.randn(1, tokens, g, n, generator=gen) for _ in range(2))
    cu = torch.linspace(0, tokens, docs + 1).long() // 8 * 8
    layout = ssd_chunked.make_layout(1, tokens, min(c.chunk_size, tokens), cu, None, None)
    with OpOutputs() as outputs:
        y, _ = ssd_chunked.forward(x, dt, A, B, C, D, layout, None, True, False)
        forward = len(outputs.ops)
        ssd_chunked.backward(x, dt, A, B, C, D, layout, None, torch.ones_like(y), None)
    return forward, len(outputs.ops) - forward


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets-mib", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--cases", nargs="+", default=["1b:8192", "1b:32768", "small:32768"],
                        help="preset:tokens (the op count grows linearly in tokens once slices bind)")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    meta = harness.environment(__file__, argv)
    current, host = ssd_chunked.DIAGONAL_SLICE_BYTES, ssd_chunked.HOST_DIAGONAL_SLICE_BYTES
    rows = []
    try:
        for case in args.cases:
            preset, tokens = case.split(":")
            for mib in args.budgets_mib:
                # this CPU runs the budget a GPU would (the accelerator's is "current")
                ssd_chunked.DIAGONAL_SLICE_BYTES = ssd_chunked.HOST_DIAGONAL_SLICE_BYTES = mib << 20
                forward, backward = count(preset, int(tokens))
                rows.append({"preset": preset, "tokens": int(tokens), "slice_mib": mib, "forward_ops": forward,
                             "backward_ops": backward, "current": mib << 20 == current})
                print(rows[-1], flush=True)
    finally:
        ssd_chunked.DIAGONAL_SLICE_BYTES, ssd_chunked.HOST_DIAGONAL_SLICE_BYTES = current, host
    lines = harness.header("Aten ops of the pure SSD core per Mamba layer (forward, backward)", meta)
    lines += ["", "| preset | tokens | slice budget | forward ops | backward ops | total |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['preset']} | {r['tokens']:,} | {r['slice_mib']} MiB{' (current)' if r['current'] else ''} | "
              f"{r['forward_ops']:,} | {r['backward_ops']:,} | {r['forward_ops'] + r['backward_ops']:,} |" for r in rows]
    harness.write_results("ssd_ops", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n", out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
