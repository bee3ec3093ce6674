"""Loss-path memory and time: the blockwise ``lm_head_loss`` against the materialized logits.

One process (float32, CPU), forward + backward of the summed cross entropy of
``hidden [T, D] @ weight[V, D].T`` with labels, at V=131072, D=256 and T in {1K, ..., 16K}:

- ``old``: ``F.cross_entropy(hidden @ weight.T, labels, reduction="sum", ignore_index=-100)``, what
  the trainer did (measured about 12 bytes per logit: the logits, log-softmax and its gradient);
- ``new``: ``hybridpar.train.loss.lm_head_loss(hidden, weight, labels, chunk_size=4096)``.

Every case runs in a fresh Python process. Memory is what the loss adds to its inputs (hidden,
weight, labels), gradients included, measured two ways during the one timed run:

- ``rss``: peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` just before)
  minus the resident set before, in the timed run;
- ``tensors``: peak of live tensor bytes from the profiler's memory timeline (every tensor
  created or freed by any op, inside the custom op too) in a second, profiled run.

The exponent ``a`` in ``memory ~ T^a`` is a least-squares fit of log memory on log T. Old cases
whose estimated peak (12 bytes per logit plus the weight gradient) exceeds ``--old-max-gib``
are skipped and marked so (the default 6 runs T=1K and 2K; 8K needs about 12.4 GiB).
Targets: new loss-path peak at T=8K <= 1.2 GiB and exponent <= 1.05.

    python benchmarks/loss_memory.py [--tokens 1024 2048 ...] [--old-max-gib 6] [--chunk-size 4096]

Prints a table and writes benchmarks/results/loss_memory.{json,md}. The cases can also run as a
section of another script: ``add_loss_arguments(parser)``, ``run_loss_section(args)`` (fresh
process per case) and ``loss_markdown(section)``. Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import harness

VOCAB, HIDDEN = 131072, 256
TOKENS = (1024, 2048, 4096, 8192, 16384)
OLD_BYTES_PER_LOGIT = 12
TARGET_TOKENS, TARGET_PEAK_GIB, TARGET_EXPONENT = 8192, 1.2, 1.05
GIB, MIB = 2**30, 2**20


# ---------------------------------------------------------------- cases


def add_loss_arguments(parser: argparse.ArgumentParser) -> None:
    """The loss section's options (prefixed, so they can sit next to another section's)."""
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts T")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--chunk-size", type=int, default=4096, help="lm_head_loss chunk_size")
    parser.add_argument("--old-max-gib", type=float, default=6.0,
                        help="skip old (materialized logits) cases whose estimated peak exceeds this")


def loss_cases(args) -> list[dict]:
    """One dict per (path, T); ``skip`` holds the reason a case is not run, else None."""
    cases = []
    for path in ("old", "new"):
        for tokens in args.tokens:
            case = dict(path=path, tokens=tokens, vocab=args.vocab, hidden=args.hidden, chunk_size=args.chunk_size,
                        skip=None)
            estimate = OLD_BYTES_PER_LOGIT * tokens * args.vocab + 4 * args.vocab * args.hidden  # + grad_weight
            if path == "old" and estimate > args.old_max_gib * GIB:
                case["skip"] = (f"skipped: ~{estimate / GIB:.1f} GiB estimated "
                                f"({OLD_BYTES_PER_LOGIT} B/logit) > --old-max-gib {args.old_max_gib:g}")
            cases.append(case)
    return cases


# ---------------------------------------------------------------- one case, in this process


def _peak_live_tensor_bytes(prof) -> int | None:
    """Peak of live tensor bytes over the profiled region, from the profiler's memory timeline."""
    try:
        timeline = prof._memory_profile().timeline  # (time, action, (key, version), bytes), time-ordered
    except Exception:  # noqa: BLE001 - a private API; the RSS measure still stands
        return None
    live = peak = 0
    for _, action, _, size in sorted(timeline, key=lambda event: event[0]):
        name = getattr(action, "name", str(action))  # PREEXISTING (the inputs) and version bumps: no change
        live += size if name == "CREATE" else -size if name == "DESTROY" else 0
        peak = max(peak, live)
    return peak


def run_loss_case(case: dict) -> dict:
    """Forward + backward of one case in this process; bytes are above the inputs."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from hybridpar.train.loss import lm_head_loss

    torch.manual_seed(0)
    tokens, vocab, hidden_size = case["tokens"], case["vocab"], case["hidden"]
    hidden = torch.randn(tokens, hidden_size).requires_grad_()
    weight = (0.02 * torch.randn(vocab, hidden_size)).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    labels[::7] = -100

    def step(h, w, y):
        if case["path"] == "old":
            loss = F.cross_entropy(h @ w.T, y, reduction="sum", ignore_index=-100)
        else:
            loss, _ = lm_head_loss(h, w, y, chunk_size=case["chunk_size"])
        loss.backward()
        return float(loss)

    # one-time costs (lazy imports of the first custom-op call, autograd threads) stay out of the numbers
    step(hidden[:8].detach().requires_grad_(), weight[:64].detach().requires_grad_(), labels[:8] % 64)

    timed = harness.measure_peak(lambda: step(hidden, weight, labels))

    hidden.grad = weight.grad = None  # a second run, profiled, for the tensor-level peak
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step(hidden, weight, labels)
    return {**case, "loss": timed["value"], "seconds": timed["wall_s"], "rss_bytes": timed["peak_bytes"],
            "rss_method": "VmHWM after clear_refs" if timed["hwm_reset"] else "ru_maxrss (lifetime peak)",
            "tensor_bytes": _peak_live_tensor_bytes(prof), "threads": torch.get_num_threads()}


def measure_in_fresh_process(case: dict, timeout_s: float = 3600) -> dict:
    """``run_loss_case`` in a new Python process (nothing allocated before it counts)."""
    try:
        return harness.run_fresh(run_loss_case, case, timeout_s=timeout_s)
    except harness.CaseError as error:
        return {**case, "error": str(error)}


def run_loss_section(args, echo=print) -> dict:
    """Run every case in a fresh process; rows, fitted exponents and target checks."""
    rows = []
    for case in loss_cases(args):
        row = case if case["skip"] else measure_in_fresh_process(case)
        rows.append(row)
        if echo is not None:
            echo(_row_line(row))
    fits = {}
    for path in ("old", "new"):
        measured = [r for r in rows if r["path"] == path and not r.get("skip") and not r.get("error")]
        fits[path] = {key: harness.log_slope([(r["tokens"], r[key]) for r in measured])
                      for key in ("rss_bytes", "tensor_bytes", "seconds")}
    return {"rows": rows, "fits": fits, "checks": _checks(rows, fits)}


def _checks(rows: list[dict], fits: dict) -> list[str]:
    checks = []
    at_target = [r for r in rows if r["path"] == "new" and r["tokens"] == TARGET_TOKENS and "rss_bytes" in r]
    for row in at_target:
        for key in ("rss_bytes", "tensor_bytes"):
            if row.get(key) is not None:
                gib = row[key] / GIB
                checks.append(f"new loss-path peak ({key}) at T={TARGET_TOKENS}: {gib:.3f} GiB <= "
                              f"{TARGET_PEAK_GIB} GiB: {gib <= TARGET_PEAK_GIB}")
    for key in ("rss_bytes", "tensor_bytes"):
        exponent = fits["new"][key]
        if exponent is not None:
            checks.append(f"new memory exponent in T ({key}): {exponent:.3f} <= {TARGET_EXPONENT}: "
                          f"{exponent <= TARGET_EXPONENT}")
    return checks


def _row_line(row: dict) -> str:
    if row.get("skip"):
        return f"{row['path']:>3} T={row['tokens']:>6}: {row['skip']}"
    if row.get("error"):
        return f"{row['path']:>3} T={row['tokens']:>6}: failed: {row['error']}"
    tensors = "n/a" if row["tensor_bytes"] is None else f"{row['tensor_bytes'] / MIB:.0f}"
    return (f"{row['path']:>3} T={row['tokens']:>6}: rss {row['rss_bytes'] / MIB:8.0f} MiB  tensors {tensors:>8} MiB  "
            f"{row['seconds']:7.1f} s")


def loss_markdown(section: dict) -> str:
    """The section's table, exponents and checks as Markdown (no title)."""
    lines = ["| path | T | V | D | chunk | loss-path peak RSS (MiB) | peak live tensors (MiB) | fwd+bwd (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in section["rows"]:
        head = f"| {row['path']} | {row['tokens']} | {row['vocab']} | {row['hidden']} | " \
               f"{row['chunk_size'] if row['path'] == 'new' else '-'} |"
        if row.get("skip") or row.get("error"):
            lines.append(f"{head} {row.get('skip') or 'failed: ' + str(row['error'])} | | |")
            continue
        tensors = "n/a" if row["tensor_bytes"] is None else f"{row['tensor_bytes'] / MIB:,.0f}"
        lines.append(f"{head} {row['rss_bytes'] / MIB:,.0f} | {tensors} | {row['seconds']:.1f} |")
    lines += ["", "Fitted exponent a in y ~ T^a (least squares on log-log, measured cases):", "",
              "| path | RSS | tensors | time |", "|---|---:|---:|---:|"]
    for path, fit in section["fits"].items():
        cells = ["n/a" if fit[k] is None else f"{fit[k]:.3f}" for k in ("rss_bytes", "tensor_bytes", "seconds")]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    lines += ["", "Checks:", ""] + [f"- {check}" for check in section["checks"]]
    return "\n".join(lines)


# ---------------------------------------------------------------- standalone


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_loss_arguments(parser)
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    section = run_loss_section(args)
    meta = harness.environment(__file__, argv)
    text = "\n".join([
        *harness.header("Loss-path memory: blockwise lm_head_loss against materialized logits", meta),
        f"Load average at the end {', '.join(f'{x:.1f}' for x in meta['load_average'])} (shared machine: times are "
        "noisy)  ",
        "Float32, forward + backward, a fresh process per case; memory is what the loss adds to its inputs "
        "(gradients of hidden and weight included). 'old' is F.cross_entropy(hidden @ weight.T), 'new' is "
        f"lm_head_loss. Targets: new peak at T={TARGET_TOKENS} <= {TARGET_PEAK_GIB} GiB, exponent <= "
        f"{TARGET_EXPONENT}.", "",
        loss_markdown(section), "",
    ])
    harness.write_results("loss_memory", {"meta": meta, **section}, text, args.out)


if __name__ == "__main__":
    main()
