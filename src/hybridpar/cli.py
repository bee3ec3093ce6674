"""Command line: ``hybridpar train | check | plan | generate`` (also ``python -m hybridpar``).

    hybridpar train --config configs/tiny-hybrid.yaml --nproc-per-node 2 train.steps=100
    hybridpar train --config configs/tiny-hybrid.yaml --nproc-per-node 2 --dry-run
    torchrun --nproc-per-node 2 -m hybridpar train --config configs/tiny-hybrid.yaml
    hybridpar generate --hf-path runs/tuned --prompt "def add(" --max-new-tokens 64

Each verb has its own flags (``hybridpar VERB --help``); flags and ``section.key=value``
overrides may come in any order after the verb. Under torchrun the launched world is used;
``--nproc-per-node N`` runs torchrun's agent in this process (``hybridpar.launch``). gloo is
used on CPU and nccl on CUDA. ``generate`` runs in this one process (``hybridpar.generate``).
``--dry-run`` makes every check the verb makes before it starts a process, then exits.

From Python, ``hybridpar.cli.main(["train", ...])`` returns the exit status and may be called again in the same
process (a notebook, a sweep): each call leaves the process as it found it (``worker.process_state_kept``).

Exit status: 0 done; 1 the run failed (non-finite values, a rank that died or stalled, a
``check`` out of tolerance); 2 bad input (config, data, files, flags), with one message and
before any process starts where it can be known then; 128+N stopped by signal N.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys

from hybridpar.config import ConfigError, load_config
from hybridpar.config_rules import did_you_mean, shorten
from hybridpar.environment import check_environment, import_torch
from hybridpar.worker import (INPUT_ERRORS, Terminated, check_world, checked_layout, error_message,
                              launched_by_torchrun, process_state_kept, run, sigterm_unwinds, worker_main, write_failure)

VERBS = {"train": "train a model (the config's layout, on --nproc-per-node processes)",
         "check": "run one step under the layout and in one process; compare loss and every gradient",
         "plan": "memory, traffic and a step-time estimate per rank, before anything runs; --fit: layouts that fit",
         "generate": "continue a prompt with a trained model, in this process"}
COMMANDS = tuple(VERBS)
MAX_TOLERANCE = 1.0  # the largest --tolerance check takes (bf16's default: 5e-2)


class _Parser(argparse.ArgumentParser):
    """A flag argparse cannot read is one bounded ``hybridpar: error:`` line and exit 2, like any bad
    input (argparse printed its whole usage, then ``hybridpar VERB: error:``)."""

    def error(self, message):
        if flag := re.fullmatch(r"argument (--[\w-]+)\S*: expected one argument", message):  # --prompt -k, --temperature -1e-3
            message += (f" (a value that starts with '-', such as a negative number or text, reads as a flag: write it as "
                        f"{flag[1]}=VALUE)")
        if verb := re.match(r"argument VERB: invalid choice: '(.*?)'", message):  # TRAIN, trian, export: no guess
            message += ("; did you mean train, whose model.export_hf=DIR writes the export?" if verb[1].lower() == "export"
                        else did_you_mean(verb[1], COMMANDS))
        sys.stderr.write(f"hybridpar: error: {shorten(message, 400)} ('{self.prog} --help' lists the flags).\n")
        sys.exit(2)


def _run_config_arguments(parser: argparse.ArgumentParser, launches: bool) -> None:
    parser.add_argument("--config", help="YAML run config (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. train.steps=100 parallel.cp=2")
    if launches:
        parser.add_argument("--nproc-per-node", type=int, default=None, help="start this many processes with torchrun")
        parser.add_argument("--dry-run", action="store_true", help="check the config, layout, data and output_dir as "
                            "the run would, then exit: no process starts, nothing is written")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """``hybridpar`` and one subparser per verb, each with only its own flags."""
    from hybridpar.plan.command import add_plan_arguments

    parser = _Parser(prog="hybridpar", description="Exact context, tensor and data parallel training "
                                     "of hybrid Mamba2/attention LMs and transformers models.",
                                     epilog="hybridpar VERB --help lists the flags of VERB.")
    from hybridpar import __version__  # --version was "the following arguments are required: VERB"

    parser.add_argument("--version", action="version", version=f"hybridpar {__version__}")
    verbs = parser.add_subparsers(dest="command", metavar="VERB", required=True)
    subs = {name: verbs.add_parser(name, help=text, description=text) for name, text in VERBS.items()}
    for name in ("train", "check"):
        _run_config_arguments(subs[name], launches=True)
    subs["check"].add_argument("--tolerance", type=float, default=None,
                               help="largest allowed difference (default by dtype: 1e-9 float64, 1e-4 float32)")
    subs["check"].add_argument("--packing", action="store_true",
                               help="instead of the layout: compare packed rows with the same documents one per row "
                                    "(one process per rank, no parallelism)")
    _run_config_arguments(subs["plan"], launches=False)
    subs["plan"].add_argument("--nproc-per-node", type=int, default=None, help=argparse.SUPPRESS)  # = --world-size
    add_plan_arguments(subs["plan"])
    gen = subs["generate"]
    gen.add_argument("--checkpoint", help="a training checkpoint (step_* folder) or a run's output_dir")
    gen.add_argument("--hf-path", help="a Hugging Face checkpoint directory (e.g. a run's model.export_hf)")
    gen.add_argument("--base", help="--checkpoint of a model.hf_path run whose base folder moved: where it is now")
    gen.add_argument("--prompt", help="the text to continue (required)")
    gen.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate at most (required)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampling")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest set reaching this mass")
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampling generator")
    gen.add_argument("--tokenizer", default="auto", help="auto (the checkpoint's own) | bytes | a tokenizer directory")
    gen.add_argument("--backend", default="auto", help="--hf-path: auto | hybrid | transformers (as model.backend)")
    gen.add_argument("--dtype", default=None, help="float32 | float64 | bfloat16 (default: as stored / as trained)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with the token ids")
    gen.add_argument("--dry-run", action="store_true", help="check the arguments, then exit without loading the model")
    return parser, subs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """``hybridpar VERB [flags] [KEY=VALUE ...]``: flags and overrides in any order after the verb."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, subs = build_parser()
    if not argv or argv[0] not in subs:
        return parser.parse_args(argv)  # --help, or an error naming the verbs
    args = subs[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def repeated_arguments(argv: list[str]) -> list[str]:
    """A notice for each flag given again with another value (argparse keeps the last one; two
    ``--config`` files are not merged). Overrides apply in order, so a key's last value wins, silently."""
    parser = build_parser()[1].get(argv[0]) if argv else None
    options, seen, notes = getattr(parser, "_option_string_actions", {}), {}, []
    items = iter(argv[1:])
    for item in items:
        flag, _, value = item.partition("=")
        match = [o for o in options if o.startswith(flag)] if flag not in options else [flag]
        if not item.startswith("--") or len(match) != 1 or options[match[0]].nargs == 0:
            continue
        name, item = match[0], f"{match[0]} {value if '=' in item else next(items, '')}"
        if seen.get(name, item) != item:
            notes.append(f"{name} is given twice ({shorten(seen[name])}, then {shorten(item)}); the last one is used"
                         + (": config files are not merged" if name == "--config" else ""))
        seen[name] = item
    return notes


def check_arguments(args: argparse.Namespace) -> None:
    """What argparse cannot say: required pairs and value ranges (ConfigError: one line, exit 2)."""
    if args.command == "generate":
        missing = [f"--{a.replace('_', '-')}" for a in ("prompt", "max_new_tokens") if getattr(args, a) is None]
        if missing:
            raise ConfigError(f"generate needs {' and '.join(missing)}; e.g. hybridpar generate --hf-path DIR "
                              "--prompt 'Once upon a time' --max-new-tokens 32.")
        return
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node {args.nproc_per_node} is invalid: it must be an integer >= 1.")
    tolerance = getattr(args, "tolerance", None)
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance > 0):
        raise ConfigError(f"--tolerance {tolerance} is invalid: it must be a finite number > 0; e.g. --tolerance "
                          "1e-6, or leave it out for the dtype's default (1e-9 in float64).")
    if tolerance is not None and tolerance > MAX_TOLERANCE:  # check would pass a wrong layout: it cannot pass falsely
        raise ConfigError(f"--tolerance {tolerance:g} is invalid: it must be at most {MAX_TOLERANCE:g} (bf16's default is "
                          "5e-2); a larger one lets losses and gradients differ by more than 1, enough for a wrong layout "
                          "to pass; leave it out for the dtype's default.")


def dry_run(args: argparse.Namespace) -> int:
    """``--dry-run``: every check the command makes before it starts a process or loads a model, then exit.

    train/check: the config and overrides, the layout against the process count and the devices, and
    ``validate_run`` (model shape, data, export target, output_dir and resume), writing nothing.
    generate: the arguments, sampling settings and paths (the model is not loaded)."""
    if args.command == "generate":
        from hybridpar.generate import check_generate_arguments, check_generate_paths

        check_generate_arguments(args)
        if (args.hf_path is None) == (args.checkpoint is None):
            raise ConfigError("pass exactly one of --hf-path DIR (a Hugging Face checkpoint) or --checkpoint DIR (a "
                              "hybridpar training checkpoint).")
        check_generate_paths(args)
        print("dry run: generate arguments valid (the model was not loaded)", flush=True)
        return 0
    from hybridpar.train.preflight import parallel_dims, validate_run

    config = load_config(args.config, args.overrides)
    nproc = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else args.nproc_per_node
    if nproc and not launched_by_torchrun():
        _say_ignored_rendezvous()
    config = checked_layout(config, args, nproc)  # check --packing: parallel.* plays no part
    check_world(config, nproc)
    check_devices(int(os.environ.get("LOCAL_WORLD_SIZE", nproc)) if launched_by_torchrun() else nproc)  # this machine's
    validate_run(config, args.command, nproc or 1, dry_run=True)
    world = parallel_dims(config).world_size
    print(f"dry run: config and layout valid for {world} process{'es' if world > 1 else ''}", flush=True)
    return 0


def _say_ignored_rendezvous() -> None:
    """``--nproc-per-node``: a ``MASTER_ADDR``/``MASTER_PORT`` of the environment is said to be unused
    (and dropped here, so no check of a one-process rendezvous reads it)."""
    from hybridpar.launch import ignored_rendezvous

    if note := ignored_rendezvous():
        print(f"hybridpar: warning: {note}", file=sys.stderr, flush=True)
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)


def check_devices(nproc: int | None) -> None:
    """Each process of a CUDA machine takes its own GPU (``cuda:LOCAL_RANK``): refuse more
    processes than GPUs before any starts."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and (nproc or 1) > gpus:
        raise ConfigError(f"--nproc-per-node {nproc} needs {nproc} GPUs (one per process) but this machine has {gpus}; "
                          f"pass --nproc-per-node {gpus} or less with a smaller layout, or hide the GPUs "
                          "(CUDA_VISIBLE_DEVICES=) to run every process on the CPU with gloo.")


def main(argv: list[str] | None = None) -> int:
    if launched_by_torchrun():  # a worker: torchrun's agent signals it, and the launcher says what ended it
        return _start(argv)
    try:  # from the first second (importing torch takes several): SIGTERM and Ctrl-C are one line, not a traceback
        with sigterm_unwinds():
            return _start(argv)
    except KeyboardInterrupt as error:
        return _interrupted(error)


def _interrupted(error: KeyboardInterrupt) -> int:
    sig = signal.SIGTERM if isinstance(error, Terminated) else signal.SIGINT
    print(f"hybridpar: interrupted ({sig.name}).", file=sys.stderr, flush=True)
    return 128 + sig


def _start(argv: list[str] | None) -> int:
    try:
        notes = check_environment()  # before torch is imported (parse_args does) and reads OMP_NUM_THREADS
        import_torch()  # a variable torch refuses as it loads: one line, not its traceback
    except ConfigError as error:
        print(f"hybridpar: error: {error}", file=sys.stderr, flush=True)
        return 2
    args = parse_args(argv)
    if launched_by_torchrun() and not getattr(args, "dry_run", False):
        return worker_main(args)
    with process_state_kept():  # a second main() in this process runs as in a fresh one
        return _main(args, argv, notes)


def _main(args: argparse.Namespace, argv: list[str] | None, notes: list[str]) -> int:
    from hybridpar.train.nonfinite import NonFiniteError
    from hybridpar.train.run.checkpoint import OutputWriteError

    prefix = "hybridpar: error"
    for note in repeated_arguments(sys.argv[1:] if argv is None else list(argv)) + notes:
        print(f"hybridpar: warning: {note}", file=sys.stderr, flush=True)
    try:
        check_arguments(args)
        if getattr(args, "dry_run", False):
            return dry_run(args)
        if args.command == "generate":
            from hybridpar.generate import run_generate

            return run_generate(args)
        config = load_config(args.config, args.overrides)
        if args.command == "plan":
            return run(args, config)
        import torch.distributed as dist

        if dist.is_initialized():  # a caller's group (tests): the trainer checks on every rank
            prefix += f" (rank {dist.get_rank()})"
        else:
            if args.nproc_per_node:
                _say_ignored_rendezvous()
            checked = checked_layout(config, args, args.nproc_per_node)  # check --packing: parallel.* plays no part
            check_world(checked, args.nproc_per_node)
            check_devices(args.nproc_per_node)
            from hybridpar.train.preflight import validate_run

            validate_run(checked, args.command, args.nproc_per_node or 1)  # before any process starts
        if args.nproc_per_node:
            from hybridpar.launch import launch

            worker_args = [args.command] + (["--config", args.config] if args.config else []) + \
                (["--tolerance", repr(args.tolerance)] if getattr(args, "tolerance", None) is not None else []) + \
                (["--packing"] if getattr(args, "packing", False) else []) + list(args.overrides)
            return launch(args.nproc_per_node, worker_args, config.train.collective_timeout_s)
        with sigterm_unwinds():  # a one-process run: SIGTERM ends it as SIGINT does (below)
            return run(args, config)
    except (*INPUT_ERRORS, OSError) as error:  # any other OSError (a path too long, ...): one line, not a traceback
        refused_write = write_failure(error)
        print(f"{prefix}: {refused_write or error_message(error)}", file=sys.stderr, flush=True)
        return 1 if refused_write else 2
    except (NonFiniteError, OutputWriteError) as error:
        print(f"{prefix}: {error}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as error:
        return _interrupted(error)


if __name__ == "__main__":
    sys.exit(main())
