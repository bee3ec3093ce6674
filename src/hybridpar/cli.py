"""Command line: ``hybridpar train | check | plan`` (also ``python -m hybridpar``).

    hybridpar train --config configs/tiny-hybrid.yaml --nproc-per-node 4 train.steps=100
    torchrun --nproc-per-node 4 -m hybridpar train --config configs/tiny-hybrid.yaml

Under torchrun the launched world is used; ``--nproc-per-node N`` starts torchrun itself.
gloo is used on CPU and nccl on CUDA. Bad input exits with status 2 and one message per
rank, before any collective can wait on a rank that failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import warnings

from hybridpar.config import RunConfig, load_config
from hybridpar.parallel.dims import ParallelDims

COMMANDS = ("train", "check", "plan")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hybridpar", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=COMMANDS, help="train a model, check a layout's exactness, or print a plan")
    parser.add_argument("--config", help="YAML run config (default: built-in defaults)")
    parser.add_argument("--nproc-per-node", type=int, default=None, help="start this many processes with torchrun")
    parser.add_argument("--tolerance", type=float, default=None, help="check: largest allowed difference (default by dtype)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 parallel.cp=2")
    return parser.parse_intermixed_args(argv)


def launched_by_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch_with_torchrun(args: argparse.Namespace, config: RunConfig) -> int:
    """Start ``args.nproc_per_node`` local processes running this same command."""
    p = config.parallel
    needed = ParallelDims(p.dp_replicate, p.dp_shard, p.cp, p.tp).world_size
    if needed != args.nproc_per_node:
        raise ValueError(
            f"--nproc-per-node {args.nproc_per_node} does not fit the layout dp_replicate*dp_shard*cp*tp = "
            f"{p.dp_replicate}*{p.dp_shard}*{p.cp}*{p.tp} = {needed}; pass --nproc-per-node {needed} or change parallel.*."
        )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc_per_node}", "-m", "hybridpar", args.command]
    if args.config:
        command += ["--config", args.config]
    if args.tolerance is not None:
        command += ["--tolerance", str(args.tolerance)]
    command += args.overrides
    environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))}
    return subprocess.call(command, env=environment)


def init_distributed() -> tuple:
    """Join the torchrun world, or make a one-process world.

    Returns ``(device, owns_group)``; a caller that already set up a group keeps it.
    """
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    owns_group = not dist.is_initialized()
    if owns_group:
        if launched_by_torchrun():
            if cuda:
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("nccl" if cuda else "gloo")
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if not cuda:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"), owns_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_known_warnings() -> None:
    """Silence two torch notices that do not apply: the trainer never edits the logits in
    place (FSDP's view warning), and the 2-D gradient-norm reduction is deliberate."""
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def run(args: argparse.Namespace, config: RunConfig) -> int:
    quiet_known_warnings()
    if args.command == "plan":
        from hybridpar.plan import print_plan

        print_plan(config)
        return 0
    device, owns_group = init_distributed()
    import torch.distributed as dist

    try:
        if args.command == "train":
            from hybridpar.train.trainer import Trainer

            Trainer(config, device).fit()
            return 0
        from hybridpar.train.check import run_check

        return run_check(config, device, args.tolerance)
    finally:
        if owns_group:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = os.environ.get("RANK", "0")
    try:
        config = load_config(args.config, args.overrides)
        if args.nproc_per_node and not launched_by_torchrun():
            return relaunch_with_torchrun(args, config)
        return run(args, config)
    except (ValueError, FileNotFoundError) as error:
        print(f"hybridpar: error (rank {rank}): {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
