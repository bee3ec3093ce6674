"""What a resumed run changes in the numerics of its checkpoint without changing its shape.

``model.dtype`` and ``parallel.mixed_precision`` may change on resume (the weights and the
optimizer state are cast on load), but then the run is no longer the uninterrupted one: its
losses differ from those it would have had. That is said, once, as a warning. So are the
optimizer settings (``train.lr``, ``betas``, ``weight_decay``, ``warmup_steps``,
``min_lr_ratio``): a checkpoint's optimizer state holds the old ones, and loading it used to keep
them silently; the run applies the new ones after loading (``optim.apply_settings``) and says so.
And the other settings each step reads afresh (``train.grad_clip``, ``peft.dropout``, and
``train.seed``, which keys the dropout masks), whose change moves the losses as much; ``parallel.tf32`` for a
float32 model on CUDA (the matmuls' precision). And ``train.steps``, when the cosine decay it ends moves the
learning rate of the steps still to run (a run extended from 10 to 20 steps climbs back from its final rate).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from hybridpar.config import RunConfig
from hybridpar.models.token_dropout import random_fields
from hybridpar.train.optim import warmup_cosine

KEYS = (("model", "dtype"), ("parallel", "mixed_precision"))
OPTIMIZER_KEYS = (("train", "lr"), ("train", "betas"), ("train", "weight_decay"), ("train", "warmup_steps"),
                  ("train", "min_lr_ratio"))
STEP_KEYS = (("train", "grad_clip"), ("peft", "dropout"))  # read by every step: the new value applies


def numeric_changes(path: str | Path, info: dict, config: RunConfig) -> list[str]:
    """One warning per numeric setting that differs from the one checkpoint ``path`` recorded."""
    recorded, notes = info.get("config") or {}, []
    for section, key in KEYS + OPTIMIZER_KEYS + STEP_KEYS:
        now = json.loads(json.dumps(getattr(getattr(config, section), key)))
        before = (recorded.get(section) or {}).get(key, now)  # not recorded: nothing to compare
        if before != now:
            what = "casts its weights and optimizer state" if (section, key) in KEYS else \
                f"applies {json.dumps(now)} from the next step on"
            notes.append(f"warning: checkpoint {path} was trained with {section}.{key}={json.dumps(before)}; resuming "
                         f"with {json.dumps(now)} {what}, so the losses will not be those of the uninterrupted run")
    seed = (recorded.get("train") or {}).get("seed", config.train.seed)
    if seed != config.train.seed and (drawn := random_draws(config)):
        notes.append(f"warning: checkpoint {path} was trained with train.seed={seed}; resuming with "
                     f"{config.train.seed} draws other dropout masks from the next step on ({drawn}), "
                     "so the losses will not be those of the uninterrupted run")
    return notes + [note for note in (tf32_change(path, recorded, config), schedule_change(path, info, config)) if note]


def tf32_change(path: str | Path, recorded: dict, config: RunConfig) -> str | None:
    """A warning when ``parallel.tf32`` differs from the checkpoint's where it sets the precision of the run's
    matmuls: a float32 model (without ``parallel.mixed_precision``) on CUDA (TF32 keeps 10 mantissa bits, IEEE 23)."""
    import torch

    before = (recorded.get("parallel") or {}).get("tf32", config.parallel.tf32)
    if before == config.parallel.tf32 or config.model.dtype != "float32" or config.parallel.mixed_precision \
            or not torch.cuda.is_available():
        return None
    return (f"warning: checkpoint {path} was trained with parallel.tf32={json.dumps(before)}; resuming with "
            f"{json.dumps(config.parallel.tf32)} computes float32 matmuls on CUDA in "
            f"{'TF32' if config.parallel.tf32 else 'full float32'} from the next step on, so the losses will not be "
            "those of the uninterrupted run")


def schedule_change(path: str | Path, info: dict, config: RunConfig) -> str | None:
    """A warning when ``train.steps`` differs from checkpoint ``path``'s and so changes the learning rate of the next
    step (the cosine decay ends at ``train.steps``; a constant rate, ``min_lr_ratio=1``, does not change)."""
    train, step = config.train, info.get("step")
    before = ((info.get("config") or {}).get("train") or {}).get("steps")
    if not isinstance(before, int) or not isinstance(step, int) or before == train.steps or step >= train.steps:
        return None
    old, new = (train.lr * warmup_cosine(step, train.warmup_steps, total, train.min_lr_ratio) for total in (before, train.steps))
    if math.isclose(old, new, rel_tol=1e-6):
        return None
    return (f"warning: checkpoint {path} was trained with train.steps={before}; resuming with {train.steps} recomputes the "
            f"learning-rate decay over {train.steps} steps, so step {step + 1} trains at lr {new:.3g} where the "
            f"{before}-step schedule {'gives' if step < before else 'had ended at'} {old:.3g}, and the losses will not be "
            "those of the uninterrupted run (train.min_lr_ratio=1.0 keeps a constant rate)")


def random_draws(config: RunConfig) -> str | None:
    """What draws random numbers in training, keyed by ``train.seed``: LoRA's dropout, the fields of
    ``model.hf_path``'s config.json (``models/token_dropout.random_fields``: a dropout or router jitter
    above 0; the file itself when it cannot be read); None when nothing does."""
    drawn = [f"peft.dropout={config.peft.dropout:g}"] if config.peft.method == "lora" and config.peft.dropout > 0 else []
    if config.model.hf_path:
        try:
            fields = random_fields(json.loads(Path(config.model.hf_path, "config.json").read_text()))
            drawn += [f"{k}={v:g}" for k, v in fields.items()]
        except (OSError, ValueError, AttributeError):  # unread: it may have dropout
            drawn.append(f"any dropout of {config.model.hf_path}/config.json")
    return ", ".join(drawn) or None
