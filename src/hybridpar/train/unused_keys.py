"""Keys set to a value that the rest of the config makes unused: one notice each, at start.

A key that changes nothing is a mistake the user cannot see (an export that never happens, an
adapter rank with no adapters). ``data.path`` and ``data.tokenizer`` of a synthetic task are
refused instead (``train/batches.validate_data``): the run would train on other data than named.
"""

from __future__ import annotations

from hybridpar.config import ModelConfig, ParallelConfig, PeftConfig, RunConfig, TrainConfig, show_value


def unused_key_notices(config: RunConfig, command: str = "train") -> list[str]:
    """One line per key set away from its default that this config (``command``: train or check) never reads."""
    notes = []
    given = {"model.export_hf": config.model.export_hf, "train.sample": config.train.sample,
             "checkpoint.resume": config.checkpoint.resume not in ("auto", None) and config.checkpoint.resume}
    if command == "check" and (ignored := [key for key, value in given.items() if value]):  # were silently ignored
        notes.append(f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} not used by check: it compares one "
                     "step of the starting weights (model.hf_path's, or the preset's at train.seed) under the layout; "
                     "it loads no checkpoint, exports and samples nothing")
    if config.model.export_architecture and not config.model.export_hf:
        notes.append(f"model.export_architecture={show_value(config.model.export_architecture)} is not used: nothing is "
                     "exported without model.export_hf (set it to a new directory to export the trained model)")
    if config.model.hf_path and config.model.preset != ModelConfig().preset:
        notes.append(f"model.preset={show_value(config.model.preset)} is not used: model.hf_path loads the checkpoint's "
                     "own config (drop model.preset, or model.hf_path to train the preset)")
    if config.peft.method == "none":
        changed = [name for name in ("r", "alpha", "dropout", "target_modules", "target_parameters", "merge")
                   if getattr(config.peft, name) != getattr(PeftConfig(), name)]
        if changed:
            notes.append(f"{', '.join('peft.' + n for n in changed)} {'is' if len(changed) == 1 else 'are'} not used: "
                         "peft.method=none trains every weight (set peft.method=lora to train adapters)")
    elif config.peft.merge != PeftConfig().merge and not config.model.export_hf:
        notes.append(f"peft.merge={show_value(config.peft.merge)} is not used: it chooses how model.export_hf writes the "
                     "adapters, and nothing is exported without model.export_hf (set it to a new directory)")
    if config.train.on_nonfinite == "stop" and config.train.max_nonfinite_skips != TrainConfig().max_nonfinite_skips:
        notes.append(f"train.max_nonfinite_skips={config.train.max_nonfinite_skips} is not used: train.on_nonfinite=stop "
                     "stops at the first non-finite step (set train.on_nonfinite=skip to skip up to that many)")
    p = config.parallel
    if p.sequence_parallel and p.tp == 1:  # check printed "sp=True" of a layout without it
        notes.append("parallel.sequence_parallel=true is not used: it splits the sequence over the tensor-parallel "
                     "group, and parallel.tp=1 (set parallel.tp > 1 for sequence parallelism)")
    strategies = [f"parallel.{key}={show_value(getattr(p, key))}" for key in ("cp_attention", "cp_mamba")
                  if getattr(p, key) != getattr(ParallelConfig(), key)]
    if strategies and p.cp == 1:
        notes.append(f"{' and '.join(strategies)} {'is' if len(strategies) == 1 else 'are'} not used: a context-parallel "
                     "strategy runs at parallel.cp > 1 only, and parallel.cp=1 (set parallel.cp > 1 to use it)")
    sample = config.train.sample or {}
    unused = [key for key in ("seed", "top_p") if key in sample and not sample.get("temperature")]
    if unused:
        notes.append(f"train.sample's {' and '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used: its "
                     "temperature 0 is greedy (set train.sample.temperature > 0 to sample)")
    return notes
