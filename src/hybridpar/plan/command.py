"""The ``hybridpar plan`` command line: options, the plan, the ``--fit`` table."""

from __future__ import annotations

import argparse
import json
import math

from hybridpar.config import ConfigError, RunConfig
from hybridpar.plan.planner import GPU_BASELINE_GIB, H100, DeviceFigures, TransformersPlan, cpu_baseline_gib, make_plan
from hybridpar.plan.report import duration, plan_dict, plan_text

__all__ = ["add_plan_arguments", "run_plan", "check_device_figures"]

DEVICE_OPTIONS = (("--device-tflops", "bf16_tflops", "bf16 dense TFLOP/s"),
                  ("--device-efficiency", "efficiency", "fraction of peak FLOP/s reached"),
                  ("--hbm-tbps", "hbm_tbps", "HBM TB/s"), ("--link-gbps", "link_gbps", "intra-node GB/s"),
                  ("--network-gbps", "network_gbps", "inter-node GB/s per GPU"),
                  ("--gpus-per-node", "gpus_per_node", "GPUs per node"))


SHOWN = 25  # lines of each list in the text output (a world of 1,024 has about 2,000 candidates)


def _more(count: int) -> None:
    if count > SHOWN:
        print(f"  ... and {count - SHOWN} more (--json lists every one)")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("plan", "hybridpar plan: memory, traffic and a time estimate per rank")
    group.add_argument("--json", action="store_true", help="plan and generate: print one JSON object")
    group.add_argument("--fit", type=float, metavar="GIB", help="plan: list the layouts that fit GIB per rank")
    group.add_argument("--world-size", "--nproc", dest="world_size", type=int, metavar="N",
                       help="plan: ranks (default: the layout's product; --fit needs it)")
    group.add_argument("--target", choices=("gpu", "cpu"), default="gpu",
                       help="plan: baseline stated apart from the peak: gpu (CUDA context, estimate) or cpu")
    group.add_argument("--docs-per-pack", type=int, default=1, help="plan: documents per pack (cp_mamba=state traffic)")
    for name, field, text in DEVICE_OPTIONS:
        kind = int if field == "gpus_per_node" else float
        group.add_argument(name, dest=field, type=kind, default=None,
                           help=f"plan: {text} (default {getattr(H100, field)}, an H100 SXM: the estimate's assumption)")


def _device(args: argparse.Namespace) -> DeviceFigures:
    fields = {f: getattr(args, f) for _, f, _ in DEVICE_OPTIONS if getattr(args, f, None) is not None}
    check_device_figures(fields)
    named = H100.name if not fields else "custom device (" + ", ".join(f"{k}={v}" for k, v in fields.items()) + ")"
    return DeviceFigures(**{**H100.__dict__, **fields, "name": named})


def check_device_figures(fields: dict) -> None:
    """ConfigError naming the option of any device figure that is not finite and positive
    (``efficiency``: in (0, 1]; ``gpus_per_node``: an integer in [1, 2**20])."""
    flags = {field: flag for flag, field, _ in DEVICE_OPTIONS}
    for name, value in fields.items():
        flag, default = flags.get(name, f"--{name.replace('_', '-')}"), getattr(H100, name)
        if name == "efficiency":
            if not (math.isfinite(value) and 0 < value <= 1):
                raise ConfigError(f"{flag} {value} is invalid: it must be a fraction in (0, 1]; e.g. {flag} {default}.")
        elif name == "gpus_per_node":
            if not 1 <= value <= 2**20:
                raise ConfigError(f"{flag} {value} is invalid: it must be an integer in [1, 2**20]; e.g. {flag} {default}.")
        elif not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} {value} is invalid: it must be a finite number > 0; e.g. {flag} {default} (an "
                              "H100 SXM), or leave it out.")


def run_plan(args: argparse.Namespace, config: RunConfig) -> int:
    world = args.world_size if args.world_size is not None else args.nproc_per_node
    if world is not None and not 1 <= world <= 2**31 - 1:
        raise ConfigError(f"--world-size {world} is invalid: it must be an integer in [1, 2**31-1].")
    if not 1 <= args.docs_per_pack <= config.data.pack_size:  # a document holds one token at least
        raise ConfigError(f"--docs-per-pack {args.docs_per_pack} is invalid: it must be an integer in [1, "
                          f"data.pack_size={config.data.pack_size}] (a document holds a token at least).")
    if args.fit is not None and not (math.isfinite(args.fit) and args.fit > 0):
        raise ConfigError(f"--fit {args.fit} is invalid: give the memory per rank in GiB, a finite number > 0, e.g. "
                          "--fit 80.")
    from hybridpar.train.preflight import parallel_dims

    device = _device(args)
    if args.fit is None:
        if world is not None and world != (needed := parallel_dims(config).world_size):  # was ParallelDims' own words
            p = config.parallel
            raise ConfigError(f"--world-size {world} does not fit the layout dp_replicate*dp_shard*cp*tp = {p.dp_replicate}*"
                              f"{p.dp_shard}*{p.cp}*{p.tp} = {needed}; pass --world-size {needed} (or leave it out), or "
                              "change parallel.*.")
        plan = make_plan(config, world, device, args.docs_per_pack)
        if isinstance(plan, TransformersPlan):
            print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.text())
            return 0
        print(json.dumps(plan_dict(plan, args.target), indent=2) if args.json else plan_text(plan, args.target))
        return 0
    from hybridpar.plan.search import search_layouts

    if world is None:
        world = parallel_dims(config).world_size
    baseline = cpu_baseline_gib() if args.target == "cpu" else GPU_BASELINE_GIB
    if args.fit <= baseline:  # every layout needs the baseline before its first tensor: none could fit
        raise ConfigError(f"--fit {args.fit:g} is invalid: it must be more than the {baseline:.2f} GiB every rank holds "
                          f"before any tensor ({'this process' if args.target == 'cpu' else 'the CUDA context'}), so "
                          "no layout can fit it; give the device's memory per rank in GiB, e.g. --fit 80 (an H100).")
    candidates = search_layouts(config, world, args.fit, device, baseline, args.docs_per_pack)
    fitting = [c for c in candidates if c.fits(args.fit)]
    if args.json:
        print(json.dumps({"budget_gib": args.fit, "world_size": world, "fitting": [
            {"parallel": c.parallel, "needs_gib": c.needs_gib, "step_s_estimate": c.plan.time.step_s}
            for c in fitting], "failing": [
            {"parallel": c.parallel, "needs_gib": c.needs_gib, "refused": c.refused}
            for c in candidates if not c.fits(args.fit)]}, indent=2))
        return 0
    print(f"{config.model.preset if not config.model.hf_path else config.model.hf_path}, "
          f"{config.data.pack_size:,} tokens per pack, world {world}, budget {args.fit:g} GiB per rank "
          f"(peak + baseline {baseline:.2f} GiB); time is an ESTIMATE ({device.name})")
    print(f"fits ({len(fitting)}), fastest first:" if fitting else "no layout fits.")
    for c in fitting[:SHOWN]:
        print(f"  {c.needs_gib:8.2f} GiB  {duration(c.plan.time.step_s):>13}/step  {c.label()}")
    _more(len(fitting))
    failing = [c for c in candidates if not c.fits(args.fit)]
    print(f"does not fit ({len(failing)}), closest first:")
    for c in failing[:SHOWN]:
        why = c.refused if c.refused else f"needs {c.needs_gib:.2f} GiB > {args.fit:g} GiB ({c.plan.memory.peak_moment})"
        print(f"  {c.label()}: {why}")
    _more(len(failing))
    if fitting:
        print(f"recommended: {fitting[0].label()}")
    return 0
