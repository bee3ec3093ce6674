"""Forward+backward peak memory and time, one fresh process per case, by section.

Each case runs in its own Python process (``harness.run_fresh``): it builds its inputs, warms the
code path up on a small shape, resets the kernel's peak-RSS counter (``/proc/self/clear_refs``),
then runs one forward+backward and reports ``VmHWM - VmRSS(before)``: the peak resident
memory the step added, in a process that holds nothing else. Time is wall and CPU seconds of
that step (the fastest of up to 3 runs when one takes under 2 s). On a shared machine wall
time is noisy; the CPU time is the steadier number.

Section ``attention``: the ``small`` preset's attention shape (``HybridConfig`` "small":
12 query heads, 4 kv heads, head_dim 64), batch 1, float32, ``L`` tokens:

- ``causal``: one document (``packed=None``); ``packed``: 8 equal documents (``PackedSeqParams``);
- ``blockwise``: ``hybridpar.models.attention.mixer.causal_attention`` (the library's core);
  ``dense``: the old implementation kept as the tests' reference
  (``tests/attention_reference.dense_causal_attention``: SDPA ``is_causal`` for one document,
  a dense ``[L, L]`` document mask otherwise), skipped where its estimate exceeds
  ``--max-dense-gib``.

Section ``hf``: a one-layer transformers Llama with that attention shape at cp=1, through the
trainer's loss (``pack_loss_sum``) on a packed row of 8 documents: ``blockwise`` = the
``"hybridpar"`` attention the trainer installs (``train/hf_model.use_blockwise_attention``),
``dense`` = transformers' ``sdpa`` with the ``[L, L]`` document mask it builds from position ids.

Targets (issue 11): memory exponent (least-squares log-log slope, 8K..64K) <= 1.05 for
blockwise causal and packed; packed <= 1.2x causal memory at every L; packed <= 1.2x causal
time at L >= 8K.

    python benchmarks/attention_memory.py [--section attention|hf] [--lengths 2048 4096 ...]

Prints the table and writes benchmarks/results/attention_memory.{json,md}; sections already in
the JSON (run before with another ``--section``) are kept. Another section (e.g. ``loss``)
registers a ``Section`` in ``SECTIONS`` below: cases, the step a child measures, and its report.
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import harness

MIB = 2**20
RESULT_FIELDS = ("peak_bytes", "wall_s", "cpu_s")  # what a child measures; the rest of a row is its case


def measure(step: Callable[[], None]) -> dict:
    """Peak RSS the step adds (bytes) and its wall/CPU seconds; ``step`` must be warmed up."""
    first = harness.measure_peak(step)
    times = [(first["wall_s"], first["cpu_s"])]
    while first["wall_s"] < 2.0 and len(times) < 3:  # short steps: keep the fastest of three
        again = harness.measure_peak(step)
        times.append((again["wall_s"], again["cpu_s"]))
    wall, cpu = min(times)
    return dict(zip(RESULT_FIELDS, (first["peak_bytes"], wall, cpu)))


def run_child(section: str, case: dict) -> dict:
    """In a fresh process: the section's step for ``case``, measured."""
    return measure(SECTIONS[section].step(case))


# ---------------------------------------------------------------- sections


@dataclass
class Section:
    """A family of cases: ``arguments(parser)`` adds its options, ``cases(args)`` lists JSON specs
    (``"skip"`` set = not run), ``step(case)`` (in the child: build inputs, warm up, return the
    forward+backward to measure) and ``report(rows)`` -> (markdown lines, check lines)."""

    title: str
    arguments: Callable[[argparse.ArgumentParser], None]
    cases: Callable[[argparse.Namespace], list[dict]]
    step: Callable[[dict], Callable[[], None]]
    report: Callable[[list[dict]], tuple[list[str], list[str]]]


ATTENTION_SHAPE = dict(num_heads=12, num_kv_heads=4, head_dim=64, documents=8)  # HybridConfig "small"
ATTENTION_LENGTHS = [2048, 4096, 8192, 16384, 32768, 65536]


def _dense_estimate_gib(length: int, kind: str) -> float:
    """The old path: one document is SDPA's linear kernel; packed holds a bool and a float [L, L]."""
    return 0.0 if kind == "causal" else 5.3 * length**2 / 2**30


def attention_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=int, nargs="+", default=ATTENTION_LENGTHS, help="tokens L")
    parser.add_argument("--impls", nargs="+", default=["blockwise", "dense"], choices=["blockwise", "dense"])
    parser.add_argument("--kinds", nargs="+", default=["causal", "packed"], choices=["causal", "packed"])
    parser.add_argument("--max-dense-gib", type=float, default=6.0, help="skip old dense cases estimated above this")


def attention_cases(args) -> list[dict]:
    cases = []
    for impl in args.impls:
        for kind in args.kinds:
            for length in args.lengths:
                case = {"impl": impl, "kind": kind, "L": length}
                need = _dense_estimate_gib(length, kind) if impl == "dense" else 0.0
                if need > args.max_dense_gib:
                    case["skip"] = f"needs ~{need:.0f} GiB > {args.max_dense_gib:g}"
                cases.append(case)
    return cases


def attention_step(case: dict) -> Callable[[], None]:
    import torch

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.models.attention.mixer import causal_attention
    from tests.attention_reference import dense_causal_attention

    core = causal_attention if case["impl"] == "blockwise" else dense_causal_attention
    shape = ATTENTION_SHAPE

    def inputs(length: int):
        torch.manual_seed(0)
        q = torch.randn(1, length, shape["num_heads"], shape["head_dim"], requires_grad=True)
        k, v = (torch.randn(1, length, shape["num_kv_heads"], shape["head_dim"], requires_grad=True) for _ in "kv")
        cu = torch.linspace(0, length, shape["documents"] + 1).round().int()
        return q, k, v, (None if case["kind"] == "causal" else PackedSeqParams.from_cu_seqlens(cu))

    def run(q, k, v, packed):
        core(q, k, v, packed).sum().backward()
        q.grad = k.grad = v.grad = None

    run(*inputs(1024))  # warm-up: libraries, thread pools, the code path
    args = inputs(case["L"])
    return lambda: run(*args)


def _slope(rows: list[dict], key: str, low: int = 8192, high: int = 65536) -> float | None:
    """Least-squares slope of log(value) on log(L) over low <= L <= high (None if < 2 points)."""
    return harness.log_slope((r["L"], r[key]) for r in rows if low <= r["L"] <= high and r.get(key))


def attention_report(rows: list[dict]) -> tuple[list[str], list[str]]:
    by = {(r["impl"], r["kind"], r["L"]): r for r in rows}
    lengths = sorted({r["L"] for r in rows})
    columns = [(impl, kind) for impl in ("blockwise", "dense") for kind in ("causal", "packed")]

    def cell(impl, kind, length, what):
        row = by.get((impl, kind, length))
        if row is None:
            return "-"
        if "skip" in row:
            return "skipped: " + row["skip"]
        if "error" in row:
            return "error: " + row["error"][:60]
        return f"{row['peak_bytes'] / MIB:,.0f}" if what == "mem" else f"{row['wall_s']:.2f} / {row['cpu_s']:.2f}"

    header = "| L | " + " | ".join(f"{i} {k} (MiB)" for i, k in columns) + " | " + " | ".join(
        f"{i} {k} wall / cpu (s)" for i, k in columns) + " |"
    lines = [header, "|---:|" + "---:|" * (2 * len(columns))]
    for length in lengths:
        lines.append(f"| {length / 1024:g}K | " + " | ".join(cell(*c, length, "mem") for c in columns) + " | "
                     + " | ".join(cell(*c, length, "time") for c in columns) + " |")
    measured = [r for r in rows if "peak_bytes" in r]
    checks, fits = [], []
    for impl, kind in columns:
        series = [r for r in measured if (r["impl"], r["kind"]) == (impl, kind)]
        slope = _slope(series, "peak_bytes")
        if slope is not None:
            span = f"{min(r['L'] for r in series if r['L'] >= 8192) // 1024}K..{max(r['L'] for r in series) // 1024}K"
            fits.append(f"{impl} {kind}: memory exponent {slope:.3f}, time exponent "
                        f"{_slope(series, 'cpu_s'):.3f} (cpu s, least squares over {span})")
            if impl == "blockwise":
                checks.append(f"blockwise {kind}: memory exponent {slope:.3f} <= 1.05: {slope <= 1.05}")
    for length in lengths:
        causal, packed = by.get(("blockwise", "causal", length)), by.get(("blockwise", "packed", length))
        if causal and packed and "peak_bytes" in causal and "peak_bytes" in packed:
            ratio = packed["peak_bytes"] / causal["peak_bytes"]
            checks.append(f"L={length // 1024}K: packed / causal memory {ratio:.2f} <= 1.2: {ratio <= 1.2}")
            if length >= 8192:
                ratio = packed["cpu_s"] / causal["cpu_s"]
                checks.append(f"L={length // 1024}K: packed / causal cpu time {ratio:.2f} <= 1.2: {ratio <= 1.2}")
    return lines + [""] + [f"- {f}" for f in fits], checks


HF_LENGTHS = [2048, 4096, 8192, 16384]
HF_IMPLS = {"hybridpar": "blockwise", "sdpa": "dense"}  # the transformers implementation -> the report's column


def hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=int, nargs="+", default=HF_LENGTHS, help="tokens L of the packed row")
    parser.add_argument("--max-dense-gib", type=float, default=6.0, help="skip sdpa cases estimated above this")


def hf_cases(args) -> list[dict]:
    cases = []
    for attention, impl in HF_IMPLS.items():
        for length in args.lengths:
            case = {"impl": impl, "kind": "packed", "attention": attention, "L": length}
            need = _dense_estimate_gib(length, "packed") if attention == "sdpa" else 0.0
            if need > args.max_dense_gib:
                case["skip"] = f"needs ~{need:.0f} GiB > {args.max_dense_gib:g}"
            cases.append(case)
    return cases


def hf_step(case: dict) -> Callable[[], None]:
    """One Llama layer with the small preset's attention (hidden 768, heads 12/4 x 64), vocab 1024,
    through the trainer's loss (``train.trainer.pack_loss_sum``) on one row of 8 documents."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.train.hf_model import use_blockwise_attention
    from hybridpar.train.trainer import pack_loss_sum

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=1,
                                         num_attention_heads=12, num_key_value_heads=4, head_dim=64, vocab_size=1024,
                                         attn_implementation="sdpa", use_cache=False))
    if case["attention"] == "hybridpar":
        use_blockwise_attention(model)

    def inputs(length: int):
        ids = torch.randint(0, 1024, (1, length))
        cu = torch.linspace(0, length, ATTENTION_SHAPE["documents"] + 1).round().int()
        return shard_inputs(input_ids=ids, labels=torch.roll(ids, -1, 1), packed=PackedSeqParams.from_cu_seqlens(cu))

    def run(sharded):
        pack_loss_sum(model, sharded)[0].backward()
        model.zero_grad(set_to_none=True)

    run(inputs(1024))  # warm-up
    sharded = inputs(case["L"])
    return lambda: run(sharded)


SECTIONS: dict[str, Section] = {
    "attention": Section(
        title="Attention core: forward+backward, small preset heads 12/4 x 64, float32, batch 1",
        arguments=attention_arguments, cases=attention_cases, step=attention_step, report=attention_report,
    ),
    "hf": Section(
        title="A transformers Llama layer (heads 12/4 x 64, hidden 768, vocab 1024) at cp=1, forward+backward of "
              "the trainer's loss on a packed row of 8 documents, float32: blockwise = hybridpar attention "
              "(what the trainer now runs), dense = transformers' sdpa with its [L, L] document mask",
        arguments=hf_arguments, cases=hf_cases, step=hf_step, report=attention_report,
    ),
    # Another section registers here, e.g. "loss": Section(title=..., arguments=..., cases=..., step=..., report=...)
    # (benchmarks/loss_memory.py); `--section loss` then runs it with the same fresh-process harness.
}


# ---------------------------------------------------------------- driver


def run_case(section: str, case: dict, timeout_s: float) -> dict:
    """Run one case in a fresh ``python`` process (``harness.run_fresh``)."""
    try:
        return {**case, **harness.run_fresh(run_child, section, case, timeout_s=timeout_s)}
    except harness.CaseError as error:
        return {**case, "error": str(error)}


def markdown(results: dict) -> str:
    lines = ["# Forward+backward peak memory and time, one fresh process per case", ""]
    for name, entry in results.items():
        meta = entry["meta"]
        table, _ = SECTIONS[name].report(entry["rows"]) if name in SECTIONS else ([], [])
        lines += [f"## {name}: {SECTIONS[name].title if name in SECTIONS else ''}", "",
                  f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ",
                  f"Machine: {meta['machine']}, Python {meta['python']}, torch {meta['torch']}, "
                  f"load average at start {meta['load_average']}  ",
                  "Memory: peak RSS added by the step (VmHWM - VmRSS before). Time: wall / CPU seconds "
                  "(noisy on a shared machine: re-run the command on a quiet one). Each row in the JSON has "
                  "its own date: runs with --skip-done add to earlier ones.", "", *table, "",
                  "Checks:", "", *[f"- {c}" for c in meta["checks"]], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", choices=sorted(SECTIONS), default="attention")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per case")
    parser.add_argument("--skip-done", action="store_true", help="keep cases the saved JSON already measured")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    SECTIONS[parser.parse_known_args(argv)[0].section].arguments(parser)
    args = parser.parse_args(argv)

    section = SECTIONS[args.section]
    meta = harness.environment(__file__, argv)
    meta["load_average"] = " ".join(f"{x:.1f}" for x in meta["load_average"])
    path = args.out / "attention_memory.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    saved = {_key(row): row for row in results.get(args.section, {}).get("rows", [])}  # earlier runs' cases
    for case in section.cases(args):
        done = saved.get(_key(case))
        if args.skip_done and done is not None and "error" not in done and "skip" not in done:
            continue
        row = case if "skip" in case else run_case(args.section, case, args.timeout)
        print(json.dumps(row), flush=True)
        saved[_key(case)] = {**row, "date": datetime.datetime.now().isoformat(timespec="seconds")}
        rows = list(saved.values())  # save after every case: a long run can be resumed with --skip-done
        _, meta["checks"] = section.report(rows)
        results[args.section] = {"meta": meta, "rows": rows}
        harness.write_results("attention_memory", results, markdown(results), args.out, echo=False)
    table, checks = section.report(list(saved.values()))
    print("\n".join(table + ["", "Checks:"] + [f"- {c}" for c in checks]))


def _key(case: dict) -> str:
    """A case's identity: its spec without results (rows of one section share the spec keys)."""
    spec = {k: v for k, v in case.items() if k not in ("skip", "error", "date", *RESULT_FIELDS)}
    return json.dumps(spec, sort_keys=True)


if __name__ == "__main__":
    main()
