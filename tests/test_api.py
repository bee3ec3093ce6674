"""The public API: every name of ``hybridpar.api`` reachable as ``hybridpar.<name>``, a cheap
``import hybridpar``, and the example that uses it (2 real gloo processes) runs and is exact
(its ``main`` called here: the example's ranks are the processes that matter)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_is_reachable_from_the_package():
    import hybridpar
    from hybridpar import api

    assert api.__all__ and all(getattr(hybridpar, name) is getattr(api, name) for name in api.__all__)
    assert set(api.__all__) <= set(dir(hybridpar))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        hybridpar.not_a_name  # noqa: B018


def test_every_public_name_is_documented():
    from hybridpar import api

    page = (ROOT / "docs" / "architecture.md").read_text()
    assert [name for name in api.__all__ if f"`{name}`" not in page] == []


def _documented_calls(text: str, names: dict):
    """``(dotted name, object, keyword names)`` of every call in ``text`` of a name in ``names``
    (``hp.NAME(...)``, or ``NAME(...)`` the block imported), nested calls included."""
    for match in re.finditer(r"(?<![\w.])([A-Za-z_][\w.]*)\(", text):
        first, *rest = match.group(1).split(".")
        if first not in names:
            continue
        target = names[first]
        for part in rest:
            target = getattr(target, part)
        depth, start = 1, match.end()
        for end in range(start, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        top = text[start:end]
        while re.search(r"\([^()]*\)", top):  # drop nested calls: their keywords are their own
            top = re.sub(r"\([^()]*\)", "", top)
        yield match.group(1), target, re.findall(r"(?<![=!<>])\b(\w+)\s*=(?!=)", top)


def test_the_documented_calls_use_real_keywords():
    """Every call of a hybridpar name with ``key=...`` in the API's docstring and the README's and
    docs' Python blocks names a parameter the callable has (``HybridConfig(d_model=...)`` was in
    ``hybridpar.api``'s docstring)."""
    import inspect

    import hybridpar as hp
    from hybridpar import api

    texts = {"hybridpar/api.py": [api.__doc__]}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        texts[page.name] = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    wrong, calls = [], 0
    for where, blocks in texts.items():
        for block in blocks:
            names = {"hp": hp}
            for line in block.splitlines():
                if re.match(r"from hybridpar\S* import ", line):
                    exec(line, names)
            for dotted, target, keywords in _documented_calls(block, names):
                parameters = inspect.signature(target).parameters
                if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
                    continue
                calls += 1
                wrong += [f"{where}: {dotted}({key}=...)" for key in keywords if key not in parameters]
    assert calls >= 15 and wrong == [], wrong


def test_import_hybridpar_loads_no_torch():
    code = "import sys, hybridpar; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.timeout(300)
def test_quickstart_example_runs_and_cp2_equals_one_process(monkeypatch, capsys):
    """The example's ``main`` (what ``python examples/quickstart.py`` exits with) in this process;
    its two ranks are real spawned processes that import the example as a module."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # spawned ranks get this sys.path too
    monkeypatch.delitem(sys.modules, "quickstart", raising=False)
    quickstart = importlib.import_module("quickstart")
    assert quickstart.main() == 0, capsys.readouterr()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == lines[1].split()[-1], lines  # the same loss, printed to 12 decimals
    assert "largest gradient difference over" in lines[2]
