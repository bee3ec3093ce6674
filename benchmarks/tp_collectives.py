"""Whole-hidden-state collectives per step of the transformers TP plans at tp=2, with and without SP, before and after.

Every model of ``tests/distributed/tensor/test_tp_collectives.IDEAL`` runs one step (one row of two
packed documents, T = 37 tokens without SP, 38 with, float64) through ``parallelize`` at tp=2 on 2 gloo
ranks; ``CommStats`` counts the all-reduces, reduce-scatters and all-gathers of the whole hidden state
(``[T, D]``, an all-gather's ``[T/2, D]``; Zamba2's shared block: ``2D``) in forward and in backward, next
to the ideal (without SP: one all-reduce per norm output that feeds a TP block, plus the LM head, each
way; with SP the same count of reduce-scatters each way and no all-reduce). The same count runs on the
plans of ``--base`` (a git revision: its ``src/``, this checkout's tests and models) for the before column.

    python benchmarks/tp_collectives.py [--base 37c837c] [--models mixtral falcon_h1 ...]

Writes benchmarks/results/tp_collectives.{json,md}. Bytes are what one rank sends, as ``CommStats``
counts them (an all-reduce over P ranks: 2(P-1)/P x its buffer, so T x D x 8 at P = 2; a reduce-scatter
or an all-gather half that). At another size the saving scales with T x D x bytes per element, per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import harness

KINDS = ("reduce_scatter", "all_gather", "all_reduce")


def _run(src: str, names: list[str], sequence_parallel: bool) -> dict:
    """``counts(names)`` with ``src`` first on the path (a fresh interpreter: nothing of another src loaded)."""
    code = ("import sys, json; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"  # not harness: it puts our src/ first
            "from tests.distributed.tensor.test_tp_collectives import counts\n"
            "if __name__ == '__main__':\n"
            "    print('RESULT' + json.dumps(counts(sys.argv[4:], sequence_parallel=sys.argv[3] == 'sp')))")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    out = subprocess.run([sys.executable, "-c", code, src, str(harness.ROOT), "sp" if sequence_parallel else "tp",
                          *names], env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    if not lines:
        raise RuntimeError(f"count failed for {src}: {out.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT"):])


def _change(before, after) -> str:
    return f"{after}" if before == after else f"{before} -> {after}"


def _bytes(before: dict, after: dict, key: str) -> str:
    return _change(f"{before[key]:,}", f"{after[key]:,}")


def _kinds(got: dict, phase: str) -> str:
    """``reduce-scatters / all-gathers / all-reduces`` of one phase."""
    return "/".join(str(got[phase][k]) for k in KINDS)


def _tables(models: list[str], runs: dict) -> list[str]:
    (b, a), (sb, sa) = runs[False], runs[True]
    lines = ["", "## Without SP: whole-hidden-state all-reduces", "",
             "| model | D | forward | backward | ideal (each way) | backward bytes | all backward collectives |",
             "|---|---|---|---|---|---|---|"]
    for m in models:
        lines.append(f"| {m} | {a[m]['hidden']} | {_change(b[m]['forward']['all_reduce'], a[m]['forward']['all_reduce'])} "
                     f"| {_change(b[m]['backward']['all_reduce'], a[m]['backward']['all_reduce'])} | {a[m]['ideal']} | "
                     f"{_bytes(b[m], a[m], 'backward_bytes')} | "
                     f"{_change(b[m]['backward_all_collectives'], a[m]['backward_all_collectives'])} |")
    lines += ["", "## With SP: whole-hidden-state reduce-scatters / all-gathers / all-reduces", "",
              "| model | forward | backward | ideal (reduce-scatters each way) | forward bytes | backward bytes |",
              "|---|---|---|---|---|---|"]
    for m in models:
        if "refused" in sa[m]:
            lines.append(f"| {m} | refused: {sa[m]['refused'][:90]} | | | | |")
            continue
        lines.append(f"| {m} | {_change(_kinds(sb[m], 'forward'), _kinds(sa[m], 'forward'))} | "
                     f"{_change(_kinds(sb[m], 'backward'), _kinds(sa[m], 'backward'))} | {sa[m]['ideal']} | "
                     f"{_bytes(sb[m], sa[m], 'forward_bytes')} | {_bytes(sb[m], sa[m], 'backward_bytes')} |")
    return lines


def main() -> None:
    from tests.distributed.tensor.test_tp_collectives import IDEAL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="37c837c", help="git revision whose plans give the before column")
    parser.add_argument("--models", nargs="*", default=list(IDEAL))
    args = parser.parse_args()
    meta = harness.environment(__file__, sys.argv[1:])
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", args.base, "src"], cwd=harness.ROOT, capture_output=True,
                                 check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        for sp in (False, True):
            runs[sp] = (_run(os.path.join(tmp, "src"), args.models, sp), _run(str(harness.ROOT / "src"), args.models, sp))
    rows = [{"model": m, **{f"{'sp' if sp else 'tp'}_{when}": runs[sp][i][m] for sp in (False, True)
                            for i, when in enumerate(("before", "after"))}} for m in args.models]
    lines = harness.header("Whole-hidden-state collectives per step, transformers TP plans at tp=2, with and without SP",
                           meta)
    lines += ["", f"One step, T = 37 tokens (38 under SP), float64, 2 gloo ranks; before = plans of `{args.base}`.",
              "Ideal without SP: one all-reduce per norm output feeding a TP block, plus the LM head, in backward;",
              "in forward one per norm's blocks (two branches added in one layer reduced once), plus the embedding.",
              "Under SP the same counts of reduce-scatters (forward: the blocks' exits and the embedding; backward:",
              "the norms' all-gathers and the LM head's) and no all-reduce. Bytes: sent by one rank. The last",
              "column counts every backward collective: small ones too (routing weights [T, k], a shared expert",
              "gate [T, 1], replicated parameters' gradients). Arcee runs transformers' own plan (no SP).",
              "Cohere adds the residual first: under SP DTensor reduce-scatters each branch as it meets the",
              "residual shard (without SP its sum is all-reduced once)."]
    lines += _tables(args.models, runs)
    harness.write_results("tp_collectives", {"meta": meta, "base": args.base, "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
