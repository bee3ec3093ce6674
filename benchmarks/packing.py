"""Padding cost of sequence packing against pad-to-longest batching.

Documents with log-normal lengths (mean ~600 tokens) are either packed into rows of
``pack_size`` tokens by ``pack_documents`` (each document padded to a multiple of 2*cp) or
batched ``batch_size`` at a time in random order and padded to the longest document of the
batch, rounded up to a multiple of 2*cp (``collate_padded``). Documents longer than the
pack are cut into pack-sized pieces for both. Reports the pad fraction (share of token
slots holding no real token), rows and token slots per 1M real tokens, and packing time.

    python benchmarks/packing.py [--tokens 4000000] [--cp 1 2 8]

Prints a table and writes benchmarks/results/packing.{json,md}.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import harness
import numpy as np
import torch

from hybridpar.data.packing import collate_padded, document_pad_multiple, pack_documents, padding_fraction


def lognormal_lengths(total_tokens: int, mean: float, sigma: float, seed: int) -> list[int]:
    """Document lengths (>= 1) drawn until they sum to ``total_tokens``; E[length] = ``mean``."""
    rng = np.random.default_rng(seed)
    mu = np.log(mean) - sigma**2 / 2
    lengths: list[int] = []
    while sum(lengths) < total_tokens:
        lengths.extend(np.maximum(1, np.rint(rng.lognormal(mu, sigma, 4096))).astype(int).tolist())
    out, running = [], 0
    for n in lengths:
        if running >= total_tokens:
            break
        out.append(n)
        running += n
    return out


def split_long(lengths: list[int], pack_size: int) -> list[int]:
    return [min(pack_size, n - s) for n in lengths for s in range(0, n, pack_size)]


def measure(lengths: list[int], pack_size: int, cp: int, batch_size: int, seed: int) -> list[dict]:
    docs = [torch.ones(n, dtype=torch.long) for n in lengths]
    real = sum(lengths)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # overlong documents are split on purpose
        packs = pack_documents(docs, pack_size, cp_size=cp)
    pack_seconds = time.perf_counter() - start
    packed_pad = padding_fraction(packs)

    pieces = [torch.ones(n, dtype=torch.long) for n in split_long(lengths, pack_size)]
    order = np.random.default_rng(seed).permutation(len(pieces))
    batches = [
        collate_padded([pieces[j] for j in order[i:i + batch_size]], pad_to_multiple_of=document_pad_multiple(cp))
        for i in range(0, len(pieces), batch_size)
    ]
    padded_pad = padding_fraction(batches)
    padded_slots = sum(b["input_ids"].numel() for b in batches)
    per_million = 1e6 / real
    return [
        {
            "method": "packing (best-fit decreasing)", "cp": cp, "pad_fraction": packed_pad,
            "rows_per_1M_tokens": len(packs) * per_million, "slots_per_1M_tokens": len(packs) * pack_size * per_million,
            "row_length": pack_size, "seconds": pack_seconds,
        },
        {
            "method": f"pad-to-longest (batch {batch_size})", "cp": cp, "pad_fraction": padded_pad,
            "rows_per_1M_tokens": len(pieces) * per_million, "slots_per_1M_tokens": padded_slots * per_million,
            "row_length": padded_slots / len(pieces), "seconds": None,
        },
    ]


def markdown(rows: list[dict], meta: dict) -> str:
    lines = harness.header("Packing vs pad-to-longest", meta) + [
        f"Documents: {meta['num_documents']} log-normal lengths (mean {meta['mean_length_measured']:.1f}, "
        f"sigma {meta['sigma']}, max {meta['max_length']}), {meta['real_tokens']} real tokens; pack size "
        f"{meta['pack_size']}; target pad fraction <= 2% for packing at cp=1 and cp=8.",
        "",
        "| method | cp | pad fraction | rows / 1M tokens | token slots / 1M tokens | mean row length | pack time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        seconds = "" if r["seconds"] is None else f"{r['seconds']:.2f}"
        lines.append(
            f"| {r['method']} | {r['cp']} | {100 * r['pad_fraction']:.2f}% | {r['rows_per_1M_tokens']:.1f} | "
            f"{r['slots_per_1M_tokens']:.0f} | {r['row_length']:.0f} | {seconds} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4_000_000, help="real tokens to generate")
    parser.add_argument("--mean", type=float, default=600.0)
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal shape")
    parser.add_argument("--pack-size", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--batch-size", type=int, default=8, help="documents per pad-to-longest batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)

    lengths = lognormal_lengths(args.tokens, args.mean, args.sigma, args.seed)
    rows = [r for cp in args.cp for r in measure(lengths, args.pack_size, cp, args.batch_size, args.seed)]
    meta = {
        **harness.environment(__file__, argv),
        "num_documents": len(lengths), "real_tokens": sum(lengths), "mean_length_measured": float(np.mean(lengths)),
        "max_length": max(lengths), "sigma": args.sigma, "pack_size": args.pack_size, "batch_size": args.batch_size,
        "seed": args.seed,
    }
    harness.write_results("packing", {"meta": meta, "results": rows}, markdown(rows, meta), args.out)
    for r in rows:
        if r["method"].startswith("packing") and r["cp"] in (1, 8) and r["pad_fraction"] > 0.02:
            print(f"WARNING: packing pad fraction {r['pad_fraction']:.2%} at cp={r['cp']} is above the 2% target")


if __name__ == "__main__":
    main()
