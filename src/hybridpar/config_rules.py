"""Value rules of config keys: what a value must be (a range, a list of choices), as text and a test.

``config.RULES`` gives every key one; ``config.invalid`` turns a broken rule into the message
naming the key, the value, the rule and the fix.

Also the two helpers every user-facing message of the lower floors uses: ``quoted`` (a value
cut to a readable length: a message never grows with its input) and ``Notice`` (a warning
category printed as one ``hybridpar: warning: ...`` line, never as a raw ``UserWarning``).
"""

from __future__ import annotations

import codecs
import math
import reprlib
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Rule", "LazyText", "integer", "number", "one_of", "each", "or_null", "PATH", "ANY", "quoted", "shorten",
           "Notice", "INT64_MAX", "SEED_MAX", "did_you_mean", "leaf_keys", "not_utf8", "wide_encoding"]

INT64_MAX = 2**63 - 1  # every integer key's ceiling: torch and numpy hold counts in int64
SEED_MAX = 2**64 - 1  # torch.manual_seed and torch.Generator.manual_seed take [0, 2**64 - 1]
MESSAGE_VALUE_CHARS = 120  # a value quoted in a message is cut to about this many characters

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 3, 8, 8, 8, 8
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 80, 80, 40


def shorten(text: str, limit: int = MESSAGE_VALUE_CHARS) -> str:
    """``text`` cut to about ``limit`` characters, saying how long it was."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


MAX_MESSAGE_CHARS = 2000  # the longest error message of bad input, whatever the input


def bounded_message(message) -> str:
    """``message`` on one line, at most ``MAX_MESSAGE_CHARS`` (the middle cut, the fix at the end kept)."""
    text = " ".join(str(message).split("\n"))
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return f"{text[:MAX_MESSAGE_CHARS - 200]} ...[{len(text) - MAX_MESSAGE_CHARS + 200:,} characters cut]... {text[-150:]}"


class ConfigError(ValueError):
    """A configuration key or value that cannot be used, with the fix in the message (one line,
    at most ``MAX_MESSAGE_CHARS``: values are quoted with ``quoted``; this bounds the rest)."""

    def __init__(self, message="", *args):
        super().__init__(bounded_message(message), *args)


def quoted(value, limit: int = MESSAGE_VALUE_CHARS) -> str:
    """``repr(value)`` for a message, bounded in length and in time (nested containers, long
    strings and huge integers are elided, as ``reprlib`` does)."""
    if isinstance(value, str):
        return repr(shorten(value, limit)) if len(value) > limit else repr(value)
    return shorten(_REPR.repr(value), limit)


class Notice(UserWarning):
    """A warning for the person running hybridpar: printed as one ``hybridpar: warning:`` line."""


class RepeatedOverride(Notice):
    """An override that changes what an earlier one set (``repeated_override``); said by the process that reads the
    command line first (the launcher), not again by its workers."""


_format_warning = warnings.formatwarning


def _notice_format(message, category, filename, lineno, line=None) -> str:
    if isinstance(category, type) and issubclass(category, Notice):
        return f"hybridpar: warning: {message}\n"
    return _format_warning(message, category, filename, lineno, line)


warnings.formatwarning = _notice_format  # only Notice changes: every other warning prints as Python prints it


@dataclass(frozen=True)
class Rule:
    """What a value must be (``text``, read after "must be") and the test of it."""

    text: str  # or an object whose str() is the text (choices known only after an import)
    holds: Callable[[typing.Any], bool]
    problem: Callable[[typing.Any], str | None] | None = None  # a compound value: which part is wrong
    choices: Callable[[], list[str]] | None = None  # a choice among names: a near miss is named in the fix


def integer(low: int, high: int = INT64_MAX, why: str = "") -> Rule:
    """An integer in ``[low, high]`` (every integer key has a ceiling: int64's by default)."""
    return Rule(f"an integer >= {low} and <= {power_of_two_text(high)}{why}", lambda v: low <= v <= high)


def power_of_two_text(n: int) -> str:
    """``n`` as ``2**k`` or ``2**k-1`` when it is one, from 2**16 (int64's ceiling reads 2**63-1), else its digits."""
    for k, less in ((n.bit_length() - 1, 0), (n.bit_length(), 1)):
        if n >= 2**16 and 2**k - less == n:
            return f"2**{k}" + "-1" * less
    return str(n)


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

    return Rule(LazyText(lambda: "one of " + ", ".join(repr(c) for c in allowed())), lambda v: v in allowed(),
                choices=allowed)


def nearest_choice(value, choices: list[str]) -> str | None:
    """The choice ``value`` most likely meant: the same name in other case, else the closest spelling."""
    import difflib

    if not isinstance(value, str):
        return None
    same = [c for c in choices if c.lower() == value.strip().lower()]
    return (same or difflib.get_close_matches(value.strip().lower(), choices, n=1, cutoff=0.75) or [None])[0]


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


def as_path(value, name: str):
    """``value`` (a ``str`` or ``os.PathLike``) as a ``Path``; ValueError naming ``name`` for anything else (a number
    or None was os.fspath's ``TypeError``, naming no argument)."""
    import os
    from pathlib import Path

    if isinstance(value, (str, os.PathLike)):
        return Path(value)
    raise ValueError(f"{name}={quoted(value)} is not a path (type {type(value).__name__}); pass a str or pathlib.Path.")


def whole_section_problem(tree: dict, section: str, value) -> str | None:
    """Why the override ``section=value`` cannot replace ``tree[section]``: it would drop keys set before it (in the
    file or an earlier override; ``train={lr: 0.01}`` dropped the file's ``train.steps`` without a word), or None."""
    earlier = tree.get(section)  # a value that is not a mapping is refused as such when the config is built
    gone = sorted(set(earlier) - set(value or ())) if isinstance(earlier, dict) and isinstance(value, (dict, type(None))) else []
    if gone:
        return (f"an override of the whole section {section!r} would drop {quoted([f'{section}.{k}' for k in gone])} "
                f"set before it; set its keys one by one, e.g. {section}.<key>=<value>.")
    return None


def path_problem(value) -> str | None:
    """Why ``value`` cannot even be looked up as a path (empty, a NUL byte, a name longer than the
    file system allows, a symlink loop), or None; a path that does not exist is fine here."""
    import os

    text = str(value)
    if not text.strip():
        return "it is empty"
    try:
        os.stat(text)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    except ValueError:
        return "it contains a NUL byte"
    except OSError as error:
        return f"the system cannot look it up ({error.strerror})"
    return None


def not_a_directory(path, owner_marker: str = "manifest.json", owner: str = "checkpoint") -> str:
    """What a path that should be a folder is instead, in words: missing, a dangling symbolic link, a file (of the
    ``owner`` folder above it, which holds ``owner_marker``: the one to point at) or another kind of entry."""
    import os
    from pathlib import Path

    path = Path(path)
    if path.is_symlink() and not path.exists():
        return f"is a symbolic link to {quoted(os.readlink(path), 200)}, which does not exist"
    if not path.exists():
        return "does not exist"
    if not path.is_file():
        return "is not a directory"
    inside = (path.parent / owner_marker).is_file()
    return "is a file, not a folder" + (f" (a file of the {owner} {shorten(str(path.parent), 200)}: point at that "
                                        "folder)" if inside else "")


WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
             (codecs.BOM_UTF16_BE, "UTF-16"))  # UTF-32 first: its little-endian mark starts with UTF-16's


def wide_encoding(data: bytes) -> str | None:
    """``"UTF-16"`` or ``"UTF-32"`` for bytes that start with that encoding's byte-order mark, else None."""
    return next((name for bom, name in WIDE_BOMS if data.startswith(bom)), None)


def not_utf8(text: str) -> str | None:
    """Why command-line ``text`` is not text, or None: a byte that is not UTF-8 reaches Python as a
    surrogate escape (``\\udcff``), which no YAML value, tokenizer or message can hold."""
    at = next((i for i, c in enumerate(str(text)) if "\udc80" <= c <= "\udcff"), None)
    if at is None:
        return None
    return f"it holds a byte that is not UTF-8 (0x{ord(text[at]) - 0xDC00:02x} at character {at})"


def leaf_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of a nest of dataclasses (``train.steps``, ...)."""
    import dataclasses

    hints = typing.get_type_hints(cls)
    return [key for f in dataclasses.fields(cls) for key in
            (leaf_keys(hints[f.name], f"{prefix}{f.name}.") if dataclasses.is_dataclass(hints[f.name])
             else [prefix + f.name])]


def did_you_mean(name, known, end: str = "") -> str:
    """``"; did you mean X?"`` for a misspelt or misplaced key among ``known`` (the same name in
    another section first, then the closest spelling), a YAML ``key:value`` written without the
    space after the colon, or ``""``; ``end`` closes a sentence that does not end in the question."""
    import difflib

    name, known = str(name), [str(k) for k in known]
    if "." in name and name in known:  # ``train.steps: 3`` in a YAML file: one key with a dot in it
        section, _, key = name.rpartition(".")
        return (f"; a dotted key is for command-line overrides: in a YAML file write it nested, '{shorten(section, 60)}:' "
                f"then '  {shorten(key, 60)}: ...' on the next line{end}")
    if ":" in name and not name.endswith(":"):
        key, _, value = name.partition(":")
        return f"; YAML needs a space after the colon: write '{shorten(key.strip(), 60)}: {shorten(value.strip(), 60)}'{end}"
    leaf = name.rsplit(".", 1)[-1]
    same = [k for k in known if k.rsplit(".", 1)[-1] == leaf and k != name]
    cased = [k for k in known if k.lower() == name.lower() and k != name]  # TRAIN, Train.Steps: keys are lower case
    close = cased or same or difflib.get_close_matches(name, known, n=1, cutoff=0.75) or [
        k for k in known if k.rsplit(".", 1)[-1] in difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in known],
                                                                             n=1, cutoff=0.75)]
    return f"; did you mean {close[0]}?" if close else end


PATH = Rule("a non-empty path the system can look up (no NUL, every name at most 255 bytes)",
            lambda v: path_problem(v) is None)
ANY = Rule("any value of its type", lambda v: True)


# ``train.sample`` (used by train/sample.py): a mapping of the sampling settings.
SAMPLE_KEYS = {"prompt": None, "max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "seed": 0}  # prompt required
MAX_NEW_TOKENS = 2**31 - 1
SAMPLE_RULE_TEXT = ("null or a mapping with prompt (text, required), max_new_tokens (an integer >= 1, at most 2**31-1, "
                    "default 64), temperature (a finite number >= 0, default 0: greedy), top_p (in (0, 1], default 1) "
                    "and seed (an integer in [0, 2**64-1], default 0)")


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
         and 1 <= settings["max_new_tokens"] <= MAX_NEW_TOKENS, "max_new_tokens must be an integer in [1, 2**31-1]"),
        (_number(settings["temperature"]) and math.isfinite(settings["temperature"]) and settings["temperature"] >= 0,
         "temperature must be a finite number >= 0"),
        (_number(settings["top_p"]) and 0 < settings["top_p"] <= 1, "top_p must be in (0, 1]"),
        (isinstance(settings["seed"], int) and not isinstance(settings["seed"], bool) and 0 <= settings["seed"] <= SEED_MAX,
         "seed must be an integer in [0, 2**64-1]"),
    ]
    return next((message for holds, message in rules if not holds), None)


def show_value(value) -> str:
    """A config value as it would be written, cut to a readable length (``quoted``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return shorten("[" + ",".join(show_value(v) for v in value[:9]) + (",..." if len(value) > 9 else "") + "]")
    return quoted(value)


def type_names(options) -> str:
    """The type hints of a config field in words ('an integer or a number')."""
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping"}
    out = []
    for option in options:
        origin = typing.get_origin(option) or option
        if origin is tuple:
            items = typing.get_args(option)
            if Ellipsis in items:  # tuple[str, ...]: any length
                out.append({str: "a list of strings", int: "a list of integers"}.get(items[0], "a list of numbers"))
            else:
                out.append(f"a list of {len(items)} numbers")
        elif option is not type(None):
            out.append(names.get(origin, getattr(origin, "__name__", str(origin))))
    return " or ".join(out)


def not_key_value(overrides, index: int) -> str:
    """The message for ``overrides[index]``, which is not ``key=value``: an override the shell split at spaces
    around its ``=`` (``train.lr = 1e-3``) is shown joined, and a YAML file passed without ``--config`` is named."""
    item, before, after = overrides[index], overrides[index - 1] if index else "", overrides[index + 1:index + 3]
    joined = None
    if "=" not in item and after and after[0].startswith("="):  # train.lr =1e-3, train.lr = 1e-3
        joined = item + after[0] + (after[1] if after[0] == "=" and len(after) > 1 else "")
    elif "=" not in item and before.endswith("=") and before.count("=") == 1:  # train.lr= 1e-3
        joined = before + item
    if joined:
        return (f"override {quoted(item)} is part of {quoted(joined)}, split by the shell at spaces around '='; write it "
                f"without them ({shorten(joined, 60)}), or quote the whole override.")
    if item.lower().endswith((".yaml", ".yml")) and "=" not in item:
        return f"override {quoted(item)} is not key=value; it names a YAML file: pass it as --config {shorten(item, 60)}."
    return f"override {quoted(item)} is not key=value; write e.g. train.steps=100."


_UNSET = object()


def _leaves(keys: tuple, value) -> list[tuple]:
    """``(path, value)`` of every leaf an override writes: a non-empty mapping writes each of its keys."""
    if isinstance(value, dict) and value:
        return [leaf for name, inner in value.items() for leaf in _leaves(keys + (name,), inner)]
    return [(keys, value)]


def _value_at(value, path: tuple):
    for name in path:
        if not isinstance(value, dict) or name not in value:
            return _UNSET
        value = value[name]
    return value


def repeated_override(written: dict, item: str, keys: tuple, value) -> str | None:
    """The notice when override ``item`` (``keys`` = ``value``) changes what an earlier override wrote (the same key
    to another value, or a mapping holding it replaced): the last is used, and says so. ``written`` maps each leaf
    path to ``(override, value)``; it is updated."""
    said = None
    for path, (earlier, old) in written.items():
        new = _value_at({None: value}, (None,) + path[len(keys):]) if path[:len(keys)] == keys else old
        if new != old:
            now = "nothing (the mapping is replaced)" if new is _UNSET else show_value(new)
            said = (f"overrides give {shorten('.'.join(map(str, path)), 60)} twice: {show_value(old)} (in {quoted(earlier, 60)}), "
                    f"then {now} (in {quoted(item, 60)}); the last is used (give each key once to silence this)")
            break
    for path in [path for path in written if path[:len(keys)] == keys]:
        del written[path]
    written.update((path, (item, leaf)) for path, leaf in _leaves(keys, value))
    return said
