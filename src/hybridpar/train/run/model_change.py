"""A changed model field at resume: another model, or the same parameters computing otherwise.

A checkpoint records its model's signature (``resume.model_signature``). When a resumed run's
signature differs, two cases stand apart:

- the parameters differ (a name or a shape): the checkpoint would load only in part, so resuming is
  refused (``resume._check_compatible``);
- every parameter is the same, name for name and shape for shape: only how they compute changed
  (``chunk_size`` only rounds otherwise; ``rope_theta``, ``norm_eps`` or ``time_step_limit`` change
  the function). The checkpoint loads whole, so the run goes on, and says once per field that its
  losses are no longer those of the uninterrupted run, as ``model.dtype`` does (``numerics.py``).

Which case holds is decided by building both models on the meta device (no memory, no weights) and
comparing ``{name: shape}``; a signature that cannot be built (a ``trust_remote_code`` class, an old
record) counts as the first case.
"""

from __future__ import annotations

import dataclasses
import json

import torch

SignatureShapes = dict[str, tuple[int, ...]]


def parameter_shapes(signature: dict) -> SignatureShapes | None:
    """``{name: shape}`` of every parameter of the model ``signature`` describes, built on the meta
    device; None when it cannot be built."""
    from hybridpar.models.hybrid import HybridConfig

    hybrid = {f.name for f in dataclasses.fields(HybridConfig)}
    try:
        with torch.device("meta"):
            model = _hybrid_model(signature) if set(signature) <= hybrid else _hf_model(signature)
    except Exception:  # noqa: BLE001 - any failure to rebuild: treated as another model
        return None
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _hybrid_model(signature: dict):
    from hybridpar.models.hybrid import HybridConfig, HybridLM

    values = dict(signature, dtype=getattr(torch, str(signature.get("dtype", "float32"))))
    return HybridLM(HybridConfig(**values))


def _hf_model(signature: dict):
    """The transformers class the signature's ``architectures`` names, from its config fields."""
    import transformers

    model_class = getattr(transformers, signature["architectures"][0])
    values = {key: value for key, value in signature.items() if key not in ("dtype", "transformers_version")}
    return model_class(model_class.config_class(**values))


def same_parameters(recorded: dict, current: dict) -> bool:
    """Whether the two signatures build models with the same parameter names and shapes."""
    shapes = parameter_shapes(recorded)
    return shapes is not None and shapes == parameter_shapes(current)


def function_change_notes(path, recorded: dict, current: dict, keys: list[str]) -> list[str]:
    """One warning per changed field ``keys`` of checkpoint ``path``, whose parameters all load."""
    how = {"chunk_size": "rounds otherwise (the same function, summed in other chunks)"}
    return [f"warning: checkpoint {path} was trained with model.{key}={json.dumps(recorded.get(key))}; resuming with "
            f"{json.dumps(current.get(key))} loads every parameter, but the model {how.get(key, 'computes otherwise')}, "
            "so the losses will not be those of the uninterrupted run" for key in keys]
