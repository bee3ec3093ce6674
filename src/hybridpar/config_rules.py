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
