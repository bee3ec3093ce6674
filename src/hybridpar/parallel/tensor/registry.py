"""The tensor-parallel plan registry.

A plan is a dict ``{module path pattern: ParallelStyle}`` (patterns as in torch's
``parallelize_module``: dotted names, ``*`` matches one level). Plan functions have the
signature ``plan_fn(model, sequence_parallel) -> dict``. The registry is keyed by the
model class's ``f"{cls.__module__}.{cls.__qualname__}"`` (a string survives class
re-wrapping, unlike the class object), with short aliases such as ``"LlamaForCausalLM"``.

Register a plan for a new model class::

    @register_tp_plan("my_pkg.model.MyLM", aliases=("MyLM",))
    def my_lm_plan(model, sequence_parallel): ...

or lazily, by dotted path, so importing the registry does not import the plan's module:
``register_tp_plan("my_pkg.model.MyLM", "my_pkg.tp:my_lm_plan")``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle

PlanFn = Callable[[nn.Module, bool], dict[str, ParallelStyle]]
ValidateFn = Callable[[nn.Module, int], None]

__all__ = ["PlanEntry", "register_tp_plan", "unregister_tp_plan", "lookup_tp_plan", "known_plan_names", "class_key"]


def class_key(cls_or_obj) -> str:
    """``module.qualname`` of a class (or of an instance's class)."""
    cls = cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class PlanEntry:
    """One registered plan: ``fn`` (or a lazy ``"module:attr"`` path) plus capabilities.

    ``validate(model, tp)`` raises ValueError for sizes the plan cannot shard; None means
    the Hugging Face config check in ``tp.validate_tp_sizes``.
    """

    key: str
    fn: PlanFn | str
    aliases: tuple[str, ...] = ()
    sequence_parallel: bool = True
    validate: ValidateFn | None = None
    doc: str = field(default="", repr=False)

    def resolve(self) -> PlanFn:
        if isinstance(self.fn, str):
            module_name, _, attr = self.fn.partition(":")
            try:
                self.fn = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as err:
                raise ValueError(
                    f"TP plan {self.key!r} points to {self.fn!r}, which cannot be imported ({err}); "
                    "pass an explicit plan dict to apply_tp until that plan exists"
                ) from err
        return self.fn


_REGISTRY: dict[str, PlanEntry] = {}
_ALIASES: dict[str, str] = {}


def register_tp_plan(key: str, fn: PlanFn | str | None = None, *, aliases=(), sequence_parallel: bool = True,
                     validate: ValidateFn | None = None, replace: bool = False):
    """Register ``fn`` under ``key`` (a class ``module.qualname`` or a plan name); decorator if fn is None."""

    def add(plan_fn):
        names = (key, *aliases)
        if not replace:
            taken = [n for n in names if n in _REGISTRY or _ALIASES.get(n, key) != key]
            if taken:
                raise ValueError(f"TP plan name(s) {taken} already registered; pass replace=True to override")
        _REGISTRY[key] = PlanEntry(key, plan_fn, tuple(aliases), sequence_parallel, validate)
        for alias in aliases:
            _ALIASES[alias] = key
        return plan_fn

    return add if fn is None else add(fn)


def unregister_tp_plan(key: str) -> None:
    """Remove a registered plan and its aliases (no-op if absent)."""
    entry = _REGISTRY.pop(key, None)
    for alias in entry.aliases if entry else ():
        _ALIASES.pop(alias, None)


def lookup_tp_plan(name: str) -> PlanEntry | None:
    """The entry registered under a key or an alias, else None."""
    return _REGISTRY.get(_ALIASES.get(name, name))


def known_plan_names() -> list[str]:
    return sorted(set(_REGISTRY) | set(_ALIASES))
