"""YAML with the YAML 1.2 core schema's scalars, on PyYAML's safe loader.

PyYAML implements YAML 1.1: ``1e-3`` is a string there (a float needs a dot), ``010`` is
octal 8 and ``yes``/``on`` are booleans. ``Yaml12Loader`` keeps the safe loader and swaps
its bool, int and float rules for YAML 1.2's (and drops 1.1's timestamps):

    bool   true | True | TRUE | false | False | FALSE
    int    [-+]?[0-9]+ (decimal) | 0o[0-7]+ | 0x[0-9a-fA-F]+
    float  [-+]?(.[0-9]+ | [0-9]+(.[0-9]*)?)([eE][-+]?[0-9]+)? | [-+]?.inf | .nan

A key written twice in one mapping is an error (YAML requires unique keys; PyYAML would
silently keep the last one). Aliases are bounded: a document whose values, with every alias
expanded, number more than ``MAX_EXPANDED_NODES`` (an "alias bomb": 300 bytes can stand for
millions of values) or that refers to itself is refused before anything is built, and so is
one nested more than ``MAX_DEPTH`` levels (PyYAML recursed per level: a RecursionError traceback).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from hybridpar.config_rules import ConfigError, path_problem, quoted, shorten, wide_encoding


class YamlSyntaxError(ValueError):
    """Text that is not YAML; the message names the source, line and column."""


MAX_EXPANDED_NODES = 100_000  # a run config has a few hundred values
MAX_DEPTH = 64  # levels of nesting; a run config has three or four


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with the YAML 1.2 core schema's bool, int and float rules."""

    def construct_document(self, node):
        _check_expansion(node)
        return super().construct_document(node)

    def compose_node(self, parent, index):
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"values nested more than {MAX_DEPTH} levels deep (a run "
                                                  "config needs a few); flatten them", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _check_expansion(root) -> None:
    """ConstructorError if ``root``, with its aliases expanded, holds more than ``MAX_EXPANDED_NODES``
    nodes or contains itself (sizes are memoized per node, so this costs one pass over the text)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise yaml.constructor.ConstructorError(None, None, "an alias refers to a node that contains it (a "
                                                    "recursive structure); write the values out", node.start_mark)
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > MAX_EXPANDED_NODES:
                raise yaml.constructor.ConstructorError(
                    None, None, f"its aliases expand to more than {MAX_EXPANDED_NODES:,} values (an alias bomb?); "
                    "write the values out or use fewer nested aliases", node.start_mark)
        open_nodes.discard(key)
        sizes[key] = total
        return total

    size(root)


_REPLACED = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")
Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _REPLACED]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))
Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                                   list("-+0123456789"))
Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"),
)


MAX_INT_DIGITS = 4000  # Python refuses to parse longer decimal integers (sys.get_int_max_str_digits)


def _construct_int(loader, node) -> int:
    text = loader.construct_scalar(node)
    if len(text) > MAX_INT_DIGITS:
        raise yaml.constructor.ConstructorError(None, None, f"an integer of {len(text):,} digits is too large to be "
                                                "a value (no key takes one); shorten it", node.start_mark)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _construct_unique_mapping(loader, node, deep=False) -> dict:
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, (str, int, float, bool, type(None))):  # ``? [a, b]``: a list or mapping as a key
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"the key {quoted(key)} is a {type(key).__name__}; a key is a name (e.g. steps)", key_node.start_mark)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"key {quoted(key)} appears twice (first at line {seen[key] + 1}); keep one", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


Yaml12Loader.construct_mapping = _construct_unique_mapping


def parse_yaml(text: str, source: str):
    """``text`` as YAML 1.2; a syntax error names ``source``, the line and the column."""
    try:
        return yaml.load(text, Loader=Yaml12Loader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = shorten(getattr(error, "problem", None) or str(error).splitlines()[0], 300)
        if "tag:yaml.org,2002:merge" in problem:  # ``<<: *base``: YAML 1.1 only
            problem = "a merge key ('<<') is YAML 1.1 and is not read here; write the keys out in full"
        elif "'\\t'" in problem:  # PyYAML: "found character '\t' that cannot start any token"
            problem = "a tab character, which is not read as indentation or separation here: replace the tabs with spaces"
        raise YamlSyntaxError(f"{source} is not valid YAML{where}: {problem}; fix the YAML syntax there.") from None


def unquoted_value(value, options) -> str | None:
    """``value`` as it would be written unquoted when it is text that reads as the number or boolean
    a key takes (``steps: "5"``, ``tf32: "false"``), else None."""
    if not isinstance(value, str) or len(value) > 100:
        return None
    try:
        parsed = yaml.load(value, Loader=Yaml12Loader)
    except yaml.YAMLError:
        return None
    import typing

    kinds = {typing.get_origin(o) or o for o in options}
    fits = (isinstance(parsed, bool) and bool in kinds) or (not isinstance(parsed, bool) and (
        (isinstance(parsed, int) and (int in kinds or float in kinds)) or (isinstance(parsed, float) and float in kinds)))
    return value.strip() if fits else None


_YAML11_BOOLS = {"yes": "true", "y": "true", "on": "true", "no": "false", "n": "false", "off": "false"}


def other_spelling(value, options, key: str) -> str | None:
    """The fix for a value spelled as YAML 1.1 or a float reads it but YAML 1.2 or this key does not: ``yes``/``off``
    for a boolean, ``inf``/``nan`` for a number, ``1e3`` or ``16.0`` for an integer; else None."""
    import typing

    kinds = {typing.get_origin(o) or o for o in options}
    if isinstance(value, str) and value.strip().lower() in _YAML11_BOOLS and bool in kinds:
        return f"YAML 1.2 reads {quoted(value)} as text (a YAML 1.1 boolean): write {key}={_YAML11_BOOLS[value.strip().lower()]}"
    if isinstance(value, str) and value.strip().lower().lstrip("+-") in ("inf", "infinity", "nan") and float in kinds:
        return (f"YAML 1.2 reads {quoted(value)} as text (the number is .inf or .nan), and no number key takes an "
                "infinite or NaN value: write a finite number")
    if isinstance(value, float) and int in kinds and float not in kinds and value.is_integer() and abs(value) < 2**63:
        return f"a number written with an exponent or a point is a float in YAML: write {key}={int(value)}"
    return None


def read_config_file(path: Path, max_bytes: int) -> dict:
    """The mapping of sections YAML file ``path`` holds; ConfigError (one line, with the fix) for a path that is
    not a regular UTF-8 file of at most ``max_bytes``, for a syntax error, and for a file with no mapping (an
    empty or comments-only file, a truncated or wrong one, ran on the defaults without a word)."""
    name = f"config file {quoted(str(path))}"
    if problem := path_problem(path):
        raise ConfigError(f"{name} cannot be read: {problem}; pass an existing YAML file, e.g. configs/tiny-hybrid.yaml.")
    if path.is_dir():
        raise ConfigError(f"{name} is a directory, not a YAML file; pass the YAML file in it, e.g. --config "
                          "configs/tiny-hybrid.yaml.")
    if not path.is_file():
        what = "is not a regular file (a device, pipe or socket)" if path.exists() else "does not exist"
        raise ConfigError(f"{name} {what}; pass an existing YAML file, e.g. configs/tiny-hybrid.yaml.")
    if (size := path.stat().st_size) > max_bytes:  # read whole and parsed by PyYAML: minutes for a data file
        raise ConfigError(f"{name} has {size:,} bytes, more than the {max_bytes:,} a run config can have (a few KB of "
                          "YAML); is it a data file? Pass the YAML config (the data goes in data.path).")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        wide = wide_encoding(error.object)
        what = f"{wide} text (its byte-order mark), not UTF-8" if wide else f"not UTF-8 text (byte {error.start})"
        raise ConfigError(f"{name} is {what}; save it as UTF-8 YAML"
                          + (f" (e.g. iconv -f {wide} -t utf-8 in > out)." if wide else ".")) from None
    try:
        raw = parse_yaml(text, name)
    except YamlSyntaxError as error:
        raise ConfigError(str(error)) from None
    if raw is None:
        raise ConfigError(f"{name} is empty (no sections, {'0 bytes' if not text else 'only comments or blank lines'}); "
                          "put the run's sections in it (e.g. configs/tiny-hybrid.yaml), or leave --config out to run "
                          "on the defaults and the overrides.")
    if not isinstance(raw, dict):
        raise ConfigError(f"{name} must hold a mapping of sections at the top level, got a {type(raw).__name__}; start "
                          "it with e.g. 'train:'.")
    return raw
