"""Bytes per Mamba2 layer under context parallelism: "a2a" (z local), the seed's a2a (z travels), "state".

Closed forms (one rank, one Mamba layer, forward; the backward sends the same again), for
the 8B-like preset (``HybridConfig.from_preset("nemotronh-8b")``), one dense row (B=1, one
document), bf16 activations (e=2), at L in {16K, 128K, 1M} and L/P = 16K::

    a2a, z local     e * B * (L/P) * (P-1)/P * (2*d_inner + 2*G_eff*N + H)
    a2a, z travels   e * B * (L/P) * (P-1)/P * (3*d_inner + 2*G_eff*N + H)      (seed / Megatron)
    state            (P-1) * 2*B*n_docs * ((K-1)*(d_inner + 2*G*N)*e + (H*p*N + H)*e_s)

``state`` is shown with fp32 states (e_s=4, what the strategy sends for bf16 activations) and
with e_s=2 (the issue's "same element size" comparison). The crossover is the ``L/P`` at
which a2a and state send the same bytes. The closed forms are checked against
``comm.CommStats`` by running both strategies on 2 gloo processes with a tiny mixer
(float32, dense and packed). Last, the wall time of one tiny-model Mamba mixer forward +
backward at L=16K: one process (cp=1) against two processes (cp=2), one thread each.

    python benchmarks/cp_comm.py [--seq 16384] [--repeats 3]

Prints the tables and writes benchmarks/results/cp_comm.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import harness
import torch
import torch.distributed as dist

from hybridpar.models.hybrid import HybridConfig
from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.mamba.mixer import Mamba2Mixer
from hybridpar.parallel.comm.collectives import CommStats
from hybridpar.parallel.context.recurrent.mamba import a2a_bytes_per_layer, apply_mamba_cp
from hybridpar.parallel.context.recurrent.mamba_state import state_bytes_per_layer
from hybridpar.parallel.context.inputs import shard_inputs
from tests.distributed.harness import run_ranks

SEQ_LENS = (16 * 1024, 128 * 1024, 1024 * 1024)
CP_SIZES = (2, 8)


def shape_of(config: HybridConfig) -> dict:
    return dict(
        d_inner=config.mamba_num_heads * config.mamba_head_dim, num_heads=config.mamba_num_heads,
        head_dim=config.mamba_head_dim, n_groups=config.mamba_n_groups, state_size=config.ssm_state_size,
        conv_kernel=config.conv_kernel,
    )


def closed_form(s: dict, seq: int, cp: int, batch: int = 1, n_docs: int = 1, e: int = 2, e_state: int = 4) -> dict:
    """Forward bytes one rank sends per layer, for each scheme."""
    a2a_args = (batch, seq, cp, s["d_inner"], s["num_heads"], s["n_groups"], s["state_size"], e)
    state_args = (batch, n_docs, cp, s["d_inner"], s["num_heads"], s["head_dim"], s["n_groups"], s["state_size"], s["conv_kernel"], e)
    return {
        "a2a": a2a_bytes_per_layer(*a2a_args),
        "a2a_z_travels": a2a_bytes_per_layer(*a2a_args, z_travels=True),
        "state": state_bytes_per_layer(*state_args, e_state),
        "state_same_e": state_bytes_per_layer(*state_args, e),
    }


def comm_table(s: dict) -> list[dict]:
    rows = []
    for cp in CP_SIZES:
        for seq in sorted({*SEQ_LENS, 16 * 1024 * cp}):  # and L/P = 16K
            b = closed_form(s, seq, cp)
            per_token = closed_form(s, cp, cp)["a2a"]  # a2a bytes per local token (L/P = 1)
            rows.append({
                "cp": cp, "seq_len": seq, "local_len": seq // cp, **b,
                "a2a_over_z_travels": b["a2a"] / b["a2a_z_travels"],
                "a2a_over_state": b["a2a"] / b["state"], "a2a_over_state_same_e": b["a2a"] / b["state_same_e"],
                "crossover_local_len": b["state"] / per_token, "crossover_local_len_same_e": b["state_same_e"] / per_token,
            })
    return rows


# ---------------------------------------------------------------- measured on 2 gloo processes


def _tiny_mixer(config: HybridConfig, n_groups: int, dtype=torch.float32) -> Mamba2Mixer:
    torch.manual_seed(0)
    return Mamba2Mixer(
        config.hidden_size, config.mamba_num_heads, config.mamba_head_dim, n_groups, config.ssm_state_size,
        config.conv_kernel, config.chunk_size,
    ).to(dtype)


def _count_bytes(group, config: HybridConfig) -> list[dict]:
    """CommStats of each strategy, forward and backward, dense and packed, next to the closed form."""
    cp = dist.get_world_size(group)
    rows = []
    for strategy in ("a2a", "state"):
        for n_groups in (1, config.mamba_n_groups):
            for kind, batch, docs in (("dense", 2, [64]), ("packed", 1, [16, 32, 8, 8])):
                mixer = apply_mamba_cp(_tiny_mixer(config, n_groups), group, strategy)
                packed = None
                if kind == "packed":
                    cu = torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist(), dtype=torch.int32)
                    packed = PackedSeqParams.from_cu_seqlens(cu)
                u = torch.randn(batch, sum(docs), config.hidden_size)
                sharded = shard_inputs(inputs_embeds=u, packed=packed, cp_group=group)
                x = sharded.inputs_embeds.requires_grad_(True)
                with CommStats() as fwd:
                    out = mixer(x, sharded.packed)
                with CommStats() as bwd:
                    out.square().sum().backward()
                s = {**shape_of(config), "n_groups": n_groups}
                form = closed_form(s, sum(docs), cp, batch, len(docs), e=4, e_state=4)[strategy]
                rows.append({
                    "strategy": strategy, "kind": kind, "n_groups": n_groups, "batch": batch, "seq_len": sum(docs),
                    "closed_form": form, "forward": sum(fwd.bytes_sent.values()), "backward": sum(bwd.bytes_sent.values()),
                    "ops": {k: v for k, v in fwd.bytes_sent.items() if v},
                })
    return rows


def _step_seconds(mixer: Mamba2Mixer, x: torch.Tensor, packed) -> float:
    """Seconds of one forward + backward."""
    x = x.detach().requires_grad_(True)
    start = time.perf_counter()
    mixer(x, packed).square().mean().backward()
    return time.perf_counter() - start


def _rank_measure(rank: int, world: int, seq: int, repeats: int) -> dict:
    """Counts bytes, then times cp=1 (rank 0 alone, rank 1 waiting) and both cp=2 strategies,
    interleaved per repeat so the three layouts see the same background load."""
    group = dist.new_group(list(range(world)))
    config = HybridConfig.from_preset("tiny")
    result = {"bytes": _count_bytes(group, config), "times": {"cp1": [], "a2a": [], "state": []}}
    torch.manual_seed(1)
    u = torch.randn(1, seq, config.hidden_size)
    single = _tiny_mixer(config, config.mamba_n_groups)
    layouts = {}
    for strategy in ("a2a", "state"):
        sharded = shard_inputs(inputs_embeds=u, cp_group=group)
        mixer = apply_mamba_cp(_tiny_mixer(config, config.mamba_n_groups), group, strategy)
        layouts[strategy] = (mixer, sharded.inputs_embeds, sharded.packed)
    for step in range(repeats + 1):  # step 0 warms up
        dist.barrier(group)
        seconds = _step_seconds(single, u, None) if rank == 0 else 0.0
        if step and rank == 0:
            result["times"]["cp1"].append(seconds)
        for strategy, (mixer, x, packed) in layouts.items():
            dist.barrier(group)
            seconds = _step_seconds(mixer, x, packed)
            if step:
                result["times"][strategy].append(seconds)
    return result


def measure(seq: int, repeats: int) -> dict:
    results = run_ranks(2, _rank_measure, seq, repeats, timeout_s=1800)
    times = {"cp1": results[0]["times"]["cp1"]}
    for k in ("a2a", "state"):  # a cp=2 step takes as long as its slower rank
        times[f"cp2_{k}"] = [max(a, b) for a, b in zip(results[0]["times"][k], results[1]["times"][k])]
    return {
        "bytes": results[0]["bytes"],
        "wall": {k: statistics.median(v) for k, v in times.items()},
        "wall_samples": times,
        "tiny": shape_of(HybridConfig.from_preset("tiny")),
    }


# ---------------------------------------------------------------- report


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def markdown(rows: list[dict], measured: dict, meta: dict) -> str:
    s = meta["shape"]
    lines = [
        *harness.header("Mamba2 context parallelism: bytes per layer", meta),
        f"Shape: nemotronh-8b preset, d_inner={s['d_inner']}, H={s['num_heads']}, p={s['head_dim']}, "
        f"G={s['n_groups']}, N={s['state_size']}, K={s['conv_kernel']}; B=1, one document; bf16 activations (e=2). "
        "MB = 1e6 bytes one rank sends, forward, one layer (the backward sends the same again).", "",
        "| cp | L | L/P | a2a z local (MB) | a2a z travels (MB) | ratio | state fp32 states (MB) | a2a / state | "
        "state bf16 states (MB) | a2a / state (same e) | crossover L/P (fp32 / same e) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cp']} | {r['seq_len']:,} | {r['local_len']:,} | {mb(r['a2a'])} | {mb(r['a2a_z_travels'])} | "
            f"{r['a2a_over_z_travels']:.3f} | {mb(r['state'])} | {r['a2a_over_state']:.1f}x | {mb(r['state_same_e'])} | "
            f"{r['a2a_over_state_same_e']:.1f}x | {r['crossover_local_len']:,.0f} / {r['crossover_local_len_same_e']:,.0f} |"
        )
    lines += [
        "", "\"state\" sends per segment (2 per document per row), so a packed row of n documents sends n times "
        "the one-document figure; the crossover L/P scales the same way (it is per document).",
    ]
    lines += ["", "Checks:", ""] + [f"- {c}" for c in meta["checks"]]
    lines += [
        "", "## Closed forms against CommStats (2 gloo processes, tiny mixer, float32)", "",
        "| strategy | batch | G | B | L | closed form (B) | CommStats forward (B) | CommStats backward (B) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for b in measured["bytes"]:
        lines.append(
            f"| {b['strategy']} | {b['kind']} | {b['n_groups']} | {b['batch']} | {b['seq_len']} | {b['closed_form']:.0f} | "
            f"{b['forward']} | {b['backward']} |"
        )
    w = measured["wall"]
    t = measured["tiny"]
    lines += [
        "", f"## Wall time, tiny mixer (d_inner={t['d_inner']}, H={t['num_heads']}, G={t['n_groups']}, N={t['state_size']}), "
        f"L={meta['seq']:,}, float32, forward + backward", "",
        f"{meta['machine']}, load average {meta['load_average'][0]:.1f} (1 min) when it ran; one thread per process; "
        f"median of {meta['repeats']} after a warm-up, the three layouts interleaved in each repeat (cp=1: rank 0 "
        "alone while rank 1 waits; cp=2: the slower rank of each step). gloo on shared CPU cores: "
        "other jobs on the same cores move these numbers a lot, and none of it says anything about NVLink.", "",
        "| layout | seconds | speed-up vs cp=1 |", "|---|---:|---:|",
        f"| cp=1, one process | {w['cp1']:.3f} | 1.00 |",
        f"| cp=2 \"a2a\", two processes | {w['cp2_a2a']:.3f} | {w['cp1'] / w['cp2_a2a']:.2f} |",
        f"| cp=2 \"state\", two processes | {w['cp2_state']:.3f} | {w['cp1'] / w['cp2_state']:.2f} |",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16 * 1024, help="sequence length of the wall-time run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)

    shape = shape_of(HybridConfig.from_preset("nemotronh-8b"))
    rows = comm_table(shape)
    load_average = list(os.getloadavg())  # other jobs on the same cores distort the wall times
    measured = measure(args.seq, args.repeats)
    at_16k = [r for r in rows if r["local_len"] == 16 * 1024]
    checks = [
        f"a2a / z-travelling = {max(r['a2a_over_z_travels'] for r in rows):.3f} <= 0.72: "
        f"{all(r['a2a_over_z_travels'] <= 0.72 for r in rows)}",
        "state >= 10x below a2a at L/P = 16K, same element size: "
        + ", ".join(f"cp={r['cp']} {r['a2a_over_state_same_e']:.1f}x" for r in at_16k)
        + f" -> {all(r['a2a_over_state_same_e'] >= 10 for r in at_16k)}",
        "state >= 10x below a2a at L/P = 16K, fp32 states: "
        + ", ".join(f"cp={r['cp']} {r['a2a_over_state']:.1f}x" for r in at_16k)
        + f" -> {all(r['a2a_over_state'] >= 10 for r in at_16k)}",
        "state bytes independent of L: " + str(len({(r['cp'], r['state']) for r in rows}) == len(CP_SIZES)),
        "CommStats forward == closed form on every tiny run: "
        + str(all(b["forward"] == round(b["closed_form"]) for b in measured["bytes"])),
        "CommStats backward == forward on every tiny run: "
        + str(all(b["backward"] == b["forward"] for b in measured["bytes"])),
    ]
    meta = {
        **harness.environment(__file__, argv), "shape": shape, "seq": args.seq,
        "repeats": args.repeats, "checks": checks, "load_average": load_average,
    }
    record = {"meta": meta, "closed_form": rows, "measured": measured}
    harness.write_results("cp_comm", record, markdown(rows, measured, meta), args.out)


if __name__ == "__main__":
    main()
