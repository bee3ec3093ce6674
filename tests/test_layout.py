"""The house rules of ``src/hybridpar``, read from the source (nothing imported).

- no import circle, counting lazy imports inside functions;
- imports point down the floors named in ``hybridpar/__init__.py`` (config and models never
  import train; models/ never imports a process group);
- every module under 400 lines, every folder at most about a dozen modules, every package
  with a docstring that says what lives there and what may import it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
FLOORS = [  # lowest first; a module may import its own floor and those below
    {"hybridpar.yaml12", "hybridpar.config_rules", "hybridpar.strict_json"},
    {"hybridpar.models", "hybridpar.data"},
    {"hybridpar.parallel"},
    {"hybridpar.config"},
    {"hybridpar.train"},
    {"hybridpar.plan"},
    {"hybridpar.api", "hybridpar.generate", "hybridpar.launch", "hybridpar.environment"},
    {"hybridpar.cli", "hybridpar.worker", "hybridpar.__main__"},
]
MAX_LINES = 400
MAX_MODULES_PER_FOLDER = 13  # "about a dozen"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "hybridpar").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found.update(name for name in names if name in modules)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _floor(module: str) -> int | None:
    for level, tops in enumerate(FLOORS):
        if any(module == top or module.startswith(top + ".") for top in tops):
            return level
    return None


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == [], f"import circles: {cycles}"


def test_imports_point_down_the_floors():
    upward = []
    for module, imported in _graph().items():
        if module == "hybridpar":
            continue
        here = _floor(module)
        assert here is not None, f"{module} is on no floor of FLOORS; add its package"
        upward += [f"{module} -> {dep}" for dep in imported if dep != "hybridpar" and _floor(dep) > here]
    assert upward == []


def test_models_never_touch_a_process_group():
    offenders = [name for name, path in _modules().items() if name.startswith("hybridpar.models")
                 and "torch.distributed" in path.read_text()]
    assert offenders == []


def test_modules_are_short_and_folders_small():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}
    for folder in (SRC / "hybridpar").rglob("*"):
        if folder.is_dir() and folder.name != "__pycache__" and not folder.name.endswith(".egg-info"):
            count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            assert count <= MAX_MODULES_PER_FOLDER, f"{folder} holds {count} modules"


def test_every_package_says_what_lives_there_and_who_imports_it():
    for init in (SRC / "hybridpar").rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80 and "import" in doc.lower(), f"{init} needs a docstring naming its contents and importers"
