"""Two paths of the same models compared, ours against transformers': time, fresh-process peak, table.

``benchmarks/hf_hybrids.py``, ``gdn.py`` and ``kda.py`` share it. A script defines a module-level
``step_fn(arch, path, tokens)`` returning a closure of one forward + backward (``packed_or_rows_step``
and ``rule_step`` build the two closures of ``gdn.py`` and ``kda.py``); then

- ``time_and_peak(step_fn, arch, path, tokens, repeats, threads)``: the median wall time of the
  closure (``harness.timed``, one warm-up) and the peak RSS one call adds, measured in a fresh
  process (``harness.run_fresh`` + ``harness.measure_peak``: imports and the model build do not count);
- ``run_grid(args, measure)``: every (length, arch, path) of the command line, one printed line each;
- ``paths_table(rows, lengths, archs, ours, theirs)``: the Markdown rows, one line per (arch, T);
  ``write_report``: the environment, the rows and their table with the script's notes, saved.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable

import harness

__all__ = ["add_grid_arguments", "packed_or_rows_step", "paths_table", "rule_step", "run_grid", "time_and_peak",
           "write_report"]


def packed_or_rows_step(model, install_core: Callable, path: str, tokens: int, docs: int = 4) -> Callable:
    """One forward + backward of the summed logits on ``docs`` equal documents of ``tokens`` in all:
    ``ours`` one packed row with ``install_core(model)`` and hybridpar's attention, else one document
    per row through transformers' own path (correct, and here without padding)."""
    import torch

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.hf import use_hybridpar_attention

    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    if path == "ours":
        packed = PackedSeqParams.from_cu_seqlens(torch.arange(0, tokens + 1, tokens // docs, dtype=torch.int32))
        install_core(model)
        use_hybridpar_attention(model)
        inputs = {"input_ids": ids, "position_ids": packed.position_ids, "packed_seq_params": packed, "use_cache": False}
    else:
        inputs = {"input_ids": ids.view(docs, tokens // docs), "use_cache": False}

    def step():
        model.zero_grad(set_to_none=True)
        model(**inputs).logits.sum().backward()

    return step


def rule_step(ours: Callable, theirs: Callable, inputs: list, path: str, tokens: int, docs: int = 4) -> Callable:
    """One forward + backward of a linear-attention rule alone on ``inputs`` ``[1, tokens, ...]``:
    ``ours(*inputs, doc_ids=...)`` on the packed row, else ``theirs`` on ``docs`` rows, chunk 64."""
    import torch

    inputs = [x.requires_grad_() for x in inputs]
    doc_ids = (torch.arange(tokens) // (tokens // docs))[None]

    def step():
        if path == "ours":
            out = ours(*inputs, doc_ids=doc_ids, chunk_size=64)[0]
        else:
            out = theirs(*(x.view(docs, tokens // docs, *x.shape[2:]) for x in inputs), chunk_size=64)[0]
        out.sum().backward()

    return step


def peak_in_child(script: str, fn_name: str, args: list, threads: int) -> dict:
    """(in a fresh process) the peak RSS one step of ``script``'s ``fn_name(*args)`` adds, MiB."""
    import torch

    torch.set_num_threads(threads)
    spec = importlib.util.spec_from_file_location(f"_paths_{fn_name}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    step = getattr(module, fn_name)(*args)
    return {"peak_mib": harness.measure_peak(step)["peak_bytes"] / 2**20}


def time_and_peak(step_fn: Callable, arch: str, path: str, tokens: int, repeats: int, threads: int,
                  peak: bool = True) -> dict:
    """``{"arch", "path", "tokens", "seconds", "peak_mib", "error"}`` of one (arch, path, tokens)."""
    seconds = harness.timed(step_fn(arch, path, tokens), repeats=repeats, warmup=1)["median_s"]
    mib, error = None, None
    if peak:
        script = sys.modules[step_fn.__module__].__file__
        try:
            mib = harness.run_fresh(peak_in_child, script, step_fn.__name__, [arch, path, tokens], threads,
                                    threads=threads)["peak_mib"]
        except harness.CaseError as failure:
            error = str(failure)[:200]
    return {"arch": arch, "path": path, "tokens": tokens, "seconds": seconds, "peak_mib": mib, "error": error}


def add_grid_arguments(parser: argparse.ArgumentParser, lengths: list[int], archs: list[str], out: str,
                       archs_help: str | None = None) -> None:
    """``--lengths --archs --repeats --threads --paths --out``, with this script's defaults."""
    parser.add_argument("--lengths", type=int, nargs="+", default=lengths)
    parser.add_argument("--archs", nargs="+", default=archs, help=archs_help)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--paths", nargs="+", default=["ours", "transformers"])
    parser.add_argument("--out", default=out)


def run_grid(args: argparse.Namespace, measure: Callable[[str, str, int], dict],
             paths_at: Callable[[int], list[str]] | None = None) -> list[dict]:
    """``measure(arch, path, tokens)`` for every length, arch and path (``paths_at(tokens)``, default
    ``args.paths``), printing a line per row as it lands."""
    rows = []
    for tokens in args.lengths:
        for arch in args.archs:
            for path in (paths_at(tokens) if paths_at else args.paths):
                row = measure(arch, path, tokens)
                rows.append(row)
                print(f"{arch:<12} {path:<13} T={tokens:>6}  {row['seconds']:8.2f} s  peak {row['peak_mib']} MiB",
                      flush=True)
    return rows


def paths_table(rows: list[dict], lengths, archs, ours: str, theirs: str) -> list[str]:
    """Markdown header and one line per (arch, T): seconds and peak MiB of ``ours`` and ``transformers``."""
    fmt = lambda v, f="{:.0f}": "not run" if v is None else f.format(v)  # noqa: E731
    lines = [f"| arch | T | {ours} s | {theirs} s | ours peak MiB | transformers peak MiB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for tokens in lengths:
        for arch in archs:
            found = {r["path"]: r for r in rows if (r["arch"], r["tokens"]) == (arch, tokens)}
            a, b = found.get("ours", {}), found.get("transformers", {})
            lines.append(f"| {arch} | {tokens} | {fmt(a.get('seconds'), '{:.2f}')} | {fmt(b.get('seconds'), '{:.2f}')} | "
                         f"{fmt(a.get('peak_mib'))} | {fmt(b.get('peak_mib'))} |")
    return lines


def write_report(script: str, title: str, args: argparse.Namespace, rows: list[dict], ours: str, theirs: str,
                 notes: list[str]) -> None:
    """``benchmarks/results/<args.out>.{json,md}``: the environment, ``rows`` and their table, then ``notes``."""
    meta = {**harness.environment(script), "threads": args.threads}
    lines = harness.header(title, meta) + [""] + paths_table(rows, args.lengths, args.archs, ours, theirs) + [""] + notes
    harness.write_results(args.out, {"meta": meta, "rows": rows}, "\n".join(lines))
