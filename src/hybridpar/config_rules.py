"""Value rules of config keys: what a value must be (a range, a list of choices), as text and a test.

``config.RULES`` gives every key one; ``config.invalid`` turns a broken rule into the message
naming the key, the value, the rule and the fix.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Rule", "LazyText", "integer", "number", "one_of", "each", "or_null", "PATH", "ANY"]


@dataclass(frozen=True)
class Rule:
    """What a value must be (``text``, read after "must be") and the test of it."""

    text: str  # or an object whose str() is the text (choices known only after an import)
    holds: Callable[[typing.Any], bool]


def integer(low: int, high: int | None = None) -> Rule:
    text = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    return Rule(text, lambda v: v >= low and (high is None or v <= high))


def number(low: float, high: float | None = None, low_open: bool = False, high_open: bool = False) -> Rule:
    """A finite number in the interval (``*_open``: the bound itself excluded)."""
    if high is None:
        text = f"a finite number {'>' if low_open else '>='} {low:g}"
    else:
        text = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    return Rule(text, lambda v: math.isfinite(v) and (v > low if low_open else v >= low)
                and (high is None or (v < high if high_open else v <= high)))


def one_of(*choices: str, lazy: Callable[[], typing.Iterable[str]] | None = None) -> Rule:
    """One of ``choices`` (or of ``lazy()``, for choices defined where importing is costly)."""
    def allowed():
        return sorted(lazy()) if lazy else list(choices)

    return Rule(LazyText(lambda: "one of " + ", ".join(repr(c) for c in allowed())), lambda v: v in allowed())


class LazyText:
    """A rule text computed when a message needs it."""

    def __init__(self, make: Callable[[], str]):
        self.make = make

    def __str__(self) -> str:
        return self.make()


def each(rule: Rule, count: int) -> Rule:
    return Rule(f"{count} values, each {rule.text}", lambda v: len(v) == count and all(rule.holds(x) for x in v))


def or_null(rule: Rule, meaning: str = "") -> Rule:
    return Rule(LazyText(lambda: f"{rule.text} or null{meaning}"), lambda v: v is None or rule.holds(v))


PATH = Rule("a non-empty path", lambda v: bool(str(v).strip()))
ANY = Rule("any value of its type", lambda v: True)


# ``train.sample`` (used by train/sample.py): a mapping of the sampling settings.
SAMPLE_KEYS = {"prompt": None, "max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "seed": 0}  # prompt required
SAMPLE_RULE_TEXT = ("null or a mapping with prompt (text, required), max_new_tokens (an integer >= 1, default 64), "
             "temperature (>= 0, default 0: greedy), top_p (in (0, 1], default 1) and seed (an integer >= 0, default 0)")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sample_problem(raw) -> str | None:
    """What is wrong with a ``train.sample`` mapping, or None."""
    if not isinstance(raw, dict):
        return f"a mapping, not a {type(raw).__name__}"
    unknown = sorted(set(raw) - set(SAMPLE_KEYS))
    if unknown:
        return f"unknown key(s) {unknown}"
    settings = {**SAMPLE_KEYS, **raw}
    rules = [
        (isinstance(settings["prompt"], str) and settings["prompt"] != "", "prompt must be a non-empty string"),
        (isinstance(settings["max_new_tokens"], int) and not isinstance(settings["max_new_tokens"], bool)
         and settings["max_new_tokens"] >= 1, "max_new_tokens must be an integer >= 1"),
        (_number(settings["temperature"]) and settings["temperature"] >= 0, "temperature must be >= 0"),
        (_number(settings["top_p"]) and 0 < settings["top_p"] <= 1, "top_p must be in (0, 1]"),
        (isinstance(settings["seed"], int) and not isinstance(settings["seed"], bool) and settings["seed"] >= 0,
         "seed must be an integer >= 0"),
    ]
    return next((message for holds, message in rules if not holds), None)
