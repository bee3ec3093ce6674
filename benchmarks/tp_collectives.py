"""Whole-hidden-state all-reduces per step of the transformers TP plans at tp=2 without SP, before and after.

Every model of ``tests/distributed/tensor/test_tp_collectives.IDEAL`` runs one step (one row of two
packed documents, T = 37 tokens, float64) through ``parallelize`` at tp=2 on 2 gloo ranks;
``CommStats`` counts the all-reduces of ``[T, D]`` (Zamba2's shared block: ``[T, 2D]``) in forward and
in backward, next to the ideal (one backward all-reduce per norm output that feeds a TP block, plus
the LM head's input). The same count runs on the plans of ``--base`` (a git revision: its ``src/``,
this checkout's tests and models) for the before column.

    python benchmarks/tp_collectives.py [--base 37c837c] [--models mixtral falcon_h1 ...]

Writes benchmarks/results/tp_collectives.{json,md}. Bytes are what one rank sends, as ``CommStats``
counts them (an all-reduce over P ranks: 2(P-1)/P x its buffer, so T x D x 8 at P = 2). At another size
the saving scales as (before - after) x 2(P-1)/P x T x D x bytes per element, per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import harness


def _run(src: str, names: list[str]) -> dict:
    """``counts(names)`` with ``src`` first on the path (a fresh interpreter: nothing of another src loaded)."""
    code = ("import sys, json; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"  # not harness: it puts our src/ first
            "from tests.distributed.tensor.test_tp_collectives import counts\n"
            "if __name__ == '__main__':\n    print('RESULT' + json.dumps(counts(sys.argv[3:])))")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    out = subprocess.run([sys.executable, "-c", code, src, str(harness.ROOT), *names], env=env,
                         capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    if not lines:
        raise RuntimeError(f"count failed for {src}: {out.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT"):])


def main() -> None:
    from tests.distributed.tensor.test_tp_collectives import IDEAL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="37c837c", help="git revision whose plans give the before column")
    parser.add_argument("--models", nargs="*", default=list(IDEAL))
    args = parser.parse_args()
    meta = harness.environment(__file__, sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", args.base, "src"], cwd=harness.ROOT, capture_output=True,
                                 check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        before = _run(os.path.join(tmp, "src"), args.models)
    after = _run(str(harness.ROOT / "src"), args.models)
    rows = []
    for name in args.models:
        b, a = before[name], after[name]
        rows.append({"model": name, "hidden": a["hidden"], "tokens": a["tokens"], "ideal_backward": a["ideal"],
                     "before": {k: b[k] for k in ("forward", "backward", "forward_bytes", "backward_bytes")},
                     "after": {k: a[k] for k in ("forward", "backward", "forward_bytes", "backward_bytes")},
                     "all_collectives_backward": {"before": b["backward_all_collectives"],
                                                  "after": a["backward_all_collectives"]}})
    lines = harness.header("Whole-hidden-state all-reduces per step, transformers TP plans at tp=2 without SP", meta)
    lines += ["", f"One step, T = 37 tokens, float64, 2 gloo ranks; before = plans of `{args.base}`. Backward",
              "ideal: one all-reduce per norm output feeding a TP block, plus the LM head; the forward's ideal is",
              "the same count (one row-parallel exit per norm, plus the embedding). Bytes: sent by one rank.",
              "The last column counts every backward collective: small ones too (routing weights [T, k], a shared",
              "expert gate [T, 1], replicated parameters' gradients). Falcon-H1, Granite 4.0-H, Phi and Cohere",
              "all-reduce two branches of one norm apart in the forward; Arcee runs transformers' own plan.", "",
              "| model | D | backward before | backward after | ideal | bytes before | bytes after | forward | "
              "all backward collectives before -> after |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, a = r["before"], r["after"]
        forward = f"{a['forward']}" if a["forward"] == b["forward"] else f"{b['forward']} -> {a['forward']}"
        lines.append(f"| {r['model']} | {r['hidden']} | {b['backward']} | {a['backward']} | {r['ideal_backward']} | "
                     f"{b['backward_bytes']:,} | {a['backward_bytes']:,} | {forward} | "
                     f"{r['all_collectives_backward']['before']} -> {r['all_collectives_backward']['after']} |")
    harness.write_results("tp_collectives", {"meta": meta, "base": args.base, "rows": rows}, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
