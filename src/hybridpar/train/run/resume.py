"""Resume or refuse: which checkpoint a run loads, and what an earlier run left in its directory.

``plan_resume`` picks the checkpoint to load (``auto``: the newest
complete one whose every file matches its sha256, printing every newer one it skips and
why), checks that it was written by the same model shape, the same data stream (naming
every differing key) and the same data content (``fingerprints.py``, ``data.on_change``), and
lists what an earlier run left in the directory (checkpoints of another run or later
steps, a ``metrics.jsonl`` of a fresh start). Those are never touched silently:
``checkpoint.if_exists`` = ``refuse`` (default) stops, ``overwrite`` deletes them,
``new_subdir`` writes this run to ``<output_dir>/run-NNN``.

The launcher calls ``plan_resume`` before torchrun starts (``preflight_resume``: with a LoRA checkpoint's
base; ``--dry-run`` prints its notes), so the error exits 2 at once; rank 0 calls it again as the authority,
under the output directory's lock (``directory.py``), and shares the result (``prepare_output_dir``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from hybridpar.config import ConfigError, RunConfig
from hybridpar.config_rules import quoted, shorten
from hybridpar.train.run.checkpoint import (CheckpointError, checkpoint_step, incomplete_reason, list_checkpoints,
                                        newest_complete, read_run_info, remove_checkpoint)
from hybridpar.train.run.directory import METRICS_FILE, OutputDirLock, check_run_paths, remove_stale_saves
from hybridpar.train.run.fingerprints import data_sources, moved_sources, source_changes
from hybridpar.train.run.model_change import function_change_notes, same_parameters
from hybridpar.train.run.numerics import numeric_changes

DATA_STREAM_KEYS = ("task", "path", "tokenizer", "seed", "pack_size", "packs_per_step", "task_options")


@dataclass
class ResumePlan:
    """Where this run writes, what it loads, and what it must print or delete first."""

    output_dir: str
    checkpoint: str | None = None
    start_step: int = 0
    run_id: str | None = None  # the run a resumed checkpoint belongs to
    pad_to_multiple_of: int | None = None  # the recorded padding of a resumed checkpoint
    notes: list[str] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)


def data_stream(config: RunConfig, pad_multiple: int, sources: dict | None = None) -> dict:
    """Everything that decides the batch of each step (recorded in every checkpoint), with the
    content fingerprints of the data sources (``sources``: computed when the data was read)."""
    data = config.data
    stream = {key: getattr(data, key) for key in DATA_STREAM_KEYS}
    stream["pad_to_multiple_of"] = pad_multiple
    stream["sources"] = data_sources(config) if sources is None else sources
    return json.loads(json.dumps(stream))  # the form it has after a round trip through run.json


def model_signature(model_config) -> dict:
    """A model config (``HybridConfig`` or a transformers ``PretrainedConfig``) as JSON values
    (dtype as its name), for run.json and comparison."""
    if dataclasses.is_dataclass(model_config):
        values = {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config)}
    else:
        values = {key: value for key, value in model_config.to_diff_dict().items() if key != "transformers_version"}
    values["dtype"] = str(values.get("dtype")).removeprefix("torch.")
    return json.loads(json.dumps(values, default=str))


def changed_keys(recorded: dict, current: dict, skip: tuple = ()) -> list[str]:
    """The keys whose values differ between two records (a key one lacks counts), sorted."""
    return [key for key in sorted(set(recorded) | set(current)) if key not in skip and recorded.get(key) != current.get(key)]


def _differences(recorded: dict, current: dict, prefix: str, skip: tuple = ()) -> list[str]:
    return [f"{prefix}{key} {json.dumps(recorded.get(key))} -> {json.dumps(current.get(key))}"
            for key in changed_keys(recorded, current, skip)]


def _model_kind(signature: dict) -> str:
    """A recorded model signature in words: a transformers ``model_type``, or a HybridLM."""
    names = signature.get("architectures")
    kind = (names[0] if isinstance(names, list) and names else None) or signature.get("model_type")
    return f"{shorten(str(kind), 60)} (transformers)" if kind else "a HybridLM"


def _choose_checkpoint(config: RunConfig, directory: Path) -> tuple[Path | None, list[str], set[Path]]:
    """The checkpoint to load, the notes on the newer ones skipped, and those skipped."""
    resume = config.checkpoint.resume
    if resume is None:
        return None, [], set()
    if resume != "auto":
        path = Path(resume)
        reason = incomplete_reason(path)
        if reason is not None:
            hint = " (it holds step_* folders: point at one of them)" if list_checkpoints(path) else ""
            if "did not finish" in reason:  # no manifest: said of a folder of another kind too
                reason, hint = _not_a_checkpoint(path, Path(config.output_dir)) or (reason, hint)
            fix = "" if hint.startswith("; ") else "; point it at a complete step_* folder, use checkpoint.resume=auto"
            raise CheckpointError(f"checkpoint.resume={resume!r} cannot be loaded: {reason}{hint}{fix}, or start fresh "
                                  "with checkpoint.resume=null.")
        return path, [], set()
    chosen, skipped = newest_complete(directory)
    notes = [f"skipping checkpoint {path}: {reason}" for path, reason in skipped.items()]
    if notes and chosen is None:
        notes.append("no complete checkpoint found; starting from step 0")
    return chosen, notes, set(skipped)


CHECKPOINT_FILES = ("manifest.json", "run.json", "trainer.pt", ".metadata")


def _not_a_checkpoint(path: Path, out: Path) -> tuple[str, str] | None:
    """``(reason, hint)`` for a resume path that is a run's output_dir (this run's own ``out`` included), or a folder
    holding nothing a checkpoint has (it was said to be a save that "did not finish"), else None."""
    if not path.is_dir() or any((path / name).exists() for name in CHECKPOINT_FILES):
        return None
    for folder, what in ((path, "a run's checkpoints folder"), (path / "checkpoints", "a run's output_dir")):
        if steps := list_checkpoints(folder):
            run = path.parent if folder is path else path
            if run.resolve() == out.resolve():  # "set output_dir=<the output_dir>" helped no one
                return (f"it is {what.replace('a run', 'this run', 1)}, not one checkpoint (its "
                        f"newest: {shorten(str(steps[-1]), 200)})", "; checkpoint.resume=auto resumes its newest "
                        "complete one")
            return (f"it is {what}, not one checkpoint (its newest: {shorten(str(steps[-1]), 200)})",
                    f"; resume that step_* folder, or set output_dir={shorten(str(run), 200)!r} with "
                    "checkpoint.resume=auto")
    names = sorted(p.name for p in path.iterdir())[:3] if os.access(path, os.R_OK) else []
    return (f"it holds no hybridpar checkpoint (none of {list(CHECKPOINT_FILES)}, no step_* folder"
            + (f"; it holds {quoted(names)}" if names else "; it is empty") + ")", "")


PEFT_SHAPE_KEYS = ("method", "r", "alpha", "target_modules", "target_parameters")


def _check_peft(path: Path, info: dict, config: RunConfig) -> None:
    """Refuse a checkpoint of another ``peft.*`` adapter layout before any process starts (the
    workers refused it only after building the model and reading the data)."""
    recorded = (info.get("config") or {}).get("peft")
    if not isinstance(recorded, dict):
        return
    current = json.loads(json.dumps(dataclasses.asdict(config.peft)))
    kind = {"none": "a full fine-tune", "lora": "a LoRA run"}
    if recorded.get("method", "none") != current["method"]:
        raise CheckpointError(f"checkpoint {str(path)!r} is from {kind.get(recorded.get('method'), 'another peft.method')}, "
                              f"but this run has peft.method={current['method']}; resume with peft.method="
                              f"{recorded.get('method', 'none')} (it holds {'adapters' if recorded.get('method') == 'lora' else 'full weights'}), or "
                              "start fresh with checkpoint.resume=null.")
    if current["method"] == "none":
        return
    keys = [k for k in PEFT_SHAPE_KEYS if k in recorded and None not in (recorded[k], current[k])]  # null: resolved later
    as_set = lambda v: sorted(set(v)) if isinstance(v, list) else v  # noqa: E731 - target lists: order and repeats
    changed = _differences({k: as_set(recorded[k]) for k in keys}, {k: as_set(current[k]) for k in keys}, "peft.")
    if changed:
        raise CheckpointError(f"checkpoint {str(path)!r} holds adapters of another layout ({'; '.join(changed)}; recorded "
                              "-> now); resume with the checkpoint's peft.r, peft.alpha and peft.target_modules, or "
                              "start fresh with checkpoint.resume=null.")


def _cps_for(pad: int) -> str:
    """The ``parallel.cp`` values whose ``2*cp`` divides a recorded padding, in words (``1``, ``1 or 2``)."""
    cps = [str(cp) for cp in range(1, min(pad // 2, 2**16) + 1) if pad % (2 * cp) == 0][:8]
    if not cps:  # an odd padding (a checkpoint from before the even rule): no cp takes it
        return f"a value whose 2*cp divides {pad} (none does)"
    return " or ".join([", ".join(cps[:-1]), cps[-1]] if len(cps) > 1 else cps)


def _check_backend(path: Path, info: dict, config: RunConfig, kinds: list[str]) -> None:
    """Name ``model.backend`` when it alone made the other model (a Bamba checkpoint trained as a HybridLM resumed as
    the transformers model): the shape message said "use the model.preset/model.overrides/model.hf_path it was
    trained with", all three unchanged."""
    recorded = ((info.get("config") or {}).get("model") or {})
    if recorded.get("backend") not in (None, config.model.backend) and recorded.get("hf_path") == config.model.hf_path:
        raise CheckpointError(f"checkpoint {str(path)!r} was trained as {kinds[0]} (model.backend={recorded['backend']}), "
                              f"but model.backend={config.model.backend} builds {kinds[1]}, under other parameter names; "
                              f"resume with model.backend={recorded['backend']}, or start fresh (checkpoint.resume=null).")


def _check_compatible(path: Path, info: dict, config: RunConfig, model: dict | None, cp: int) -> tuple[int, list[str]]:
    """Refuse a checkpoint of another model shape or data stream; returns the padding to use and
    the notes (a changed data source under ``data.on_change=warn``)."""
    notes = []
    if model is not None and "model" in info:
        changed = _differences(info["model"], model, "", skip=("dtype",))
        kinds = [_model_kind(m) for m in (info["model"], model)]
        if kinds[0] != kinds[1]:  # another model altogether: its own field names, not a list of every field
            _check_backend(path, info, config, kinds)
            changed = [f"{kinds[0]} -> {kinds[1]}, {len(changed)} fields differ"]
        elif changed and same_parameters(info["model"], model):  # chunk_size, rope_theta: it loads whole
            keys = changed_keys(info["model"], model, skip=("dtype",))
            notes, changed = function_change_notes(path, info["model"], model, keys), []
        if changed:
            raise CheckpointError(f"checkpoint {str(path)!r} was written by another model shape ({'; '.join(changed)}; "
                                  "recorded -> now); resuming would load only part of it. Use the model.preset/"
                                  "model.overrides/model.hf_path it was trained with, or start fresh "
                                  "(checkpoint.resume=null).")
    _check_peft(path, info, config)
    recorded = info.get("data", {})
    pad = recorded.get("pad_to_multiple_of")
    wanted = config.data.pad_to_multiple_of
    if pad is not None and wanted is not None and wanted != pad:
        raise CheckpointError(f"data.pad_to_multiple_of={wanted} differs from the {pad} checkpoint {str(path)!r} was "
                              "trained with, so the batches would change; leave data.pad_to_multiple_of unset (null) "
                              "to continue with the recorded padding.")
    pad = pad if pad is not None else (wanted or 2 * cp)
    if pad % (2 * cp):
        raise CheckpointError(f"checkpoint {str(path)!r} was trained with documents padded to multiples of {pad}; at "
                              f"parallel.cp={cp} every document must pad to a multiple of 2*cp={2 * cp}, so the batches "
                              f"would change. Resume at parallel.cp={_cps_for(pad)}, or start fresh (checkpoint.resume=null).")
    notes += numeric_changes(path, info, config)
    if recorded:
        recorded = {"tokenizer": "auto", **recorded}  # checkpoints from before data.tokenizer read with bytes: auto
        current = data_stream(config, pad)
        legacy_bytes, recorded_sources = recorded.pop("file_bytes", None), recorded.pop("sources", None)
        moved = moved_sources(recorded, current, recorded_sources, notes)  # same content elsewhere: the same batches
        recorded_hf = ((info.get("config") or {}).get("model") or {}).get("hf_path")
        if config.model.hf_path is None and recorded_hf is None and {recorded["tokenizer"], current["tokenizer"]} <= {
                "auto", "bytes"}:  # without model.hf_path, auto reads bytes: the same batches (it was refused)
            recorded["tokenizer"] = current["tokenizer"]
        changed = _differences(recorded, current, "data.", skip=("pad_to_multiple_of", "sources", *moved))
        if changed:
            raise CheckpointError(f"resuming from {str(path)!r} would change the training batches ({'; '.join(changed)}; "
                                  "recorded -> now); set those keys back to the recorded values, or start a fresh run "
                                  "(checkpoint.resume=null).")
        content = source_changes(recorded_sources, current["sources"], legacy_bytes)
        if content and config.data.on_change == "refuse":
            raise CheckpointError(f"the data changed since checkpoint {str(path)!r} was written: {'; '.join(content)}; "
                                  "the batches after its step would differ from the ones the run started with. Restore "
                                  "the file, or set data.on_change=warn to continue on the new content, or start fresh "
                                  "(checkpoint.resume=null).")
        notes += [f"warning: data.on_change=warn: {change}; resuming from {path} on the new content (the next "
                  "checkpoint records it)" for change in content]
    return pad, notes


def nothing_left_note(step: int, steps: int) -> str:
    """What a resume from ``step`` says when ``train.steps`` is not above it (the run trains nothing)."""
    return (f"the checkpoint is at step {step}, and train.steps={steps}: nothing is left to train; raise train.steps "
            "to continue this run, or start fresh (checkpoint.resume=null)")


def plan_resume(config: RunConfig, model: dict | None = None) -> ResumePlan:
    """What this run loads and where it writes; raises ConfigError/CheckpointError to refuse.

    ``model`` is ``model_signature`` of this run's model (None skips the shape check).
    """
    out = Path(config.output_dir)
    directory = out / "checkpoints"
    chosen, notes, skipped = _choose_checkpoint(config, directory)
    plan = ResumePlan(output_dir=str(out), notes=notes)
    if chosen is not None:
        info = read_run_info(chosen)
        named = checkpoint_step(chosen)
        if named is not None and "step" in info and named != info["step"]:  # renamed: newest by name, not by step
            raise CheckpointError(f"checkpoint {str(chosen)!r} is named for step {named} but holds step {info['step']} "
                                  "(its run.json): it was renamed, so resume=auto and retention (both by the name's "
                                  f"step) would take it for another; rename it back to step_{info['step']:08d}.")
        plan.checkpoint, plan.start_step, plan.run_id = str(chosen), int(info.get("step", checkpoint_step(chosen) or 0)), info.get("run_id")
        plan.pad_to_multiple_of, changes = _check_compatible(chosen, info, config, model, config.parallel.cp)
        plan.notes += changes
    earlier = []
    for path in list_checkpoints(directory):
        if path in skipped and chosen is None:  # damaged, of a run nothing resumes: overwrite deletes it too
            earlier.append(path)
            continue
        if path == chosen or path in skipped or incomplete_reason(path, verify=False) is not None:
            continue
        step = checkpoint_step(path)
        run_id = _run_id_of(path)
        if plan.run_id is None or run_id != plan.run_id or step > plan.start_step:
            earlier.append(path)
    metrics = out / METRICS_FILE
    if metrics.is_file() and (chosen is None or chosen.parent.resolve() != directory.resolve()):
        earlier.append(metrics)
    if not earlier:
        return plan
    names = ", ".join(p.name for p in earlier[:4]) + (f" and {len(earlier) - 4} more" if len(earlier) > 4 else "")
    policy = config.checkpoint.if_exists
    if policy == "refuse" and chosen is None and skipped:  # resume=auto found checkpoints, none usable
        newest = shorten(plan.notes[0].removeprefix("skipping checkpoint "), 300)
        raise CheckpointError(f"output_dir {str(out)!r} holds an earlier run, but none of its {len(skipped)} checkpoint(s) "
                              f"can be resumed (newest: {newest}); restore them from a copy, or start afresh with "
                              "checkpoint.if_exists=overwrite (deletes them) or checkpoint.if_exists=new_subdir, or "
                              "choose another output_dir.")
    if policy == "refuse":
        start = "a fresh run" if chosen is None else f"a run resumed from step {plan.start_step}"
        resumable = any(p.name.startswith("step_") for p in earlier) and config.checkpoint.resume != "auto"
        advice = "resume it with checkpoint.resume=auto, or " if resumable else \
            "it saved no checkpoint to resume (checkpoint.resume=auto found none): " if chosen is None else ""
        raise ConfigError(f"output_dir {str(out)!r} holds outputs of an earlier run ({names}) that {start} would "
                          f"overwrite or mix with; {advice}set "
                          "checkpoint.if_exists=overwrite to delete them, or checkpoint.if_exists=new_subdir to write "
                          f"this run to a fresh {out}/run-NNN, or choose another output_dir.")
    if policy == "overwrite":
        plan.remove = [str(p) for p in earlier]
        plan.notes.append(f"checkpoint.if_exists=overwrite: deleting {names} of an earlier run in {out}")
        return plan
    number = 1
    while os.path.lexists(out / f"run-{number:03d}"):  # a dangling link too: mkdir would meet it
        number += 1
    plan.output_dir = str(out / f"run-{number:03d}")
    plan.notes.append(f"{out} holds an earlier run ({names}); checkpoint.if_exists=new_subdir: writing this run to "
                      f"{plan.output_dir}")
    return plan


def preflight_resume(config: RunConfig, shape, dry_run: bool) -> None:
    """The launcher's resume check: ``plan_resume`` and a LoRA checkpoint's recorded base (``check_same_base``):
    a preset's recipe always; a ``model.hf_path`` base, a hash of its weights (rank 0 hashes them again at start),
    under ``dry_run`` only. ``dry_run`` prints the notes the run would print."""
    from hybridpar.train.run.adapters import base_reference, check_same_base
    from hybridpar.train.run.metrics import notice

    plan = plan_resume(config, model_signature(shape))
    if plan.checkpoint and config.peft.method != "none" and (dry_run or not config.model.hf_path):
        check_same_base(plan.checkpoint, base_reference(config))
    if dry_run:  # what the run would print, in the conditional where the run acts
        print_notes([note.replace(": deleting ", ": the run would delete ", 1) for note in plan.notes])
        if plan.checkpoint and plan.start_step >= config.train.steps:  # a run says it once loaded
            notice(nothing_left_note(plan.start_step, config.train.steps))


def print_notes(notes: list[str]) -> None:
    """A plan's notes as rank 0 prints them: a ``warning: `` one as a warning (stderr), the rest on stdout."""
    from hybridpar.train.run.metrics import notice

    for note in notes:
        if note.startswith("warning: "):
            notice(note.removeprefix("warning: "))
        else:
            print(note, flush=True)


def _run_id_of(path: Path) -> str | None:
    try:
        return read_run_info(path).get("run_id")
    except (OSError, ValueError):
        return None


def prepare_output_dir(config: RunConfig, model: dict | None) -> tuple[ResumePlan, OutputDirLock | None]:
    """Rank 0 locks ``output_dir``, plans the resume and deletes what ``overwrite`` allows;
    every rank gets the same plan, or raises the same error (one broadcast, no hang)."""
    import uuid

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    outcome: list = [None]
    lock = None
    if rank == 0:
        try:
            check_run_paths(config)
            lock = OutputDirLock(config.output_dir)
            warning = lock.acquire()
            plan = plan_resume(config, model)
            stale = [f"warning: {note}" for note in remove_stale_saves(config.output_dir)]  # locked: no live save
            plan.notes[:0] = ([f"warning: {warning}"] if warning else []) + stale
            plan.run_id = plan.run_id or uuid.uuid4().hex[:12]
            for path in map(Path, plan.remove):
                remove_checkpoint(path) if path.is_dir() else path.unlink(missing_ok=True)
            Path(plan.output_dir).mkdir(parents=True, exist_ok=True)
            outcome = [plan]
        except (ValueError, OSError) as error:
            if lock is not None:
                lock.release()
            lock = None
            outcome = [error if isinstance(error, ValueError) else ConfigError(f"output_dir {config.output_dir!r}: {error}")]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0], lock
