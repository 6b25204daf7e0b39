"""The package's house rules: no import cycles, and imports only run down the layers.

    cli -> api -> {ablate, demo} -> online -> {stages, views} -> {method, training, rollout}
        -> {algos, models, envs} -> {artifacts, config, stats, errors}

(``api``: the Python API, which the CLI is a thin layer over; it never imports the CLI.)

A module may import from its own layer or any layer below it, never above. The graph is
built with ``ast`` from every ``import`` in the source, lazy ones inside functions included:
a lazy import still ties the modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "serl_cli"

# top layer first; a module's layer is its first folder under serl_cli/ (or its own name)
LAYERS = [
    {"__main__", "cli"},
    {"api"},
    {"ablate", "demo"},
    {"online"},
    {"stages", "views"},
    {"method", "training", "rollout"},
    {"algos", "models", "envs"},
    {"artifacts", "config", "stats", "errors", "__init__"},
]
RANK = {room: i for i, layer in enumerate(LAYERS) for room in layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(name: str, modules: set[str]) -> str | None:
    """The module a dotted import name lands in (``a.b.c`` may be a name inside ``a.b``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "envs").rglob("*.py"))
    modules = {module_name(f) for f in files}
    graph: dict[str, set[str]] = {}
    for f in files:
        here = module_name(f)
        package = here if f.name == "__init__.py" else here.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from .core import x
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for n in names:
                target = resolve(n, modules)
                if target is not None and target != here and not here.startswith(target + "."):
                    targets.add(target)
        graph[here] = targets
    return graph


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "envs":
        return "envs"
    return parts[1] if len(parts) > 1 else "__init__"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_room_has_a_layer():
    rooms = {room(m) for m in import_graph() if m.startswith("serl_cli")}
    assert rooms <= set(RANK), f"new folder(s) without a layer in LAYERS: {sorted(rooms - set(RANK))}"


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_only_run_down_the_layers():
    upward = []
    for module, targets in import_graph().items():
        for target in targets:
            if module.startswith("envs") and target.startswith("serl_cli"):
                upward.append(f"{module} -> {target} (environments never import serl_cli)")
            elif module.startswith("serl_cli") and RANK[room(target)] < RANK[room(module)]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports against the layer order:\n" + "\n".join(sorted(upward))


@pytest.mark.parametrize(
    "graph, cycle",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, cycle):
    assert find_cycle(graph) == cycle


def test_algorithms_are_known_by_their_registry_entries_not_their_names():
    """What an algorithm does is a capability of its entry (algos/registry.py); nowhere else does
    the code compare an algorithm's name or look its math up by string."""
    import re

    from serl_cli.algos.registry import OBJECTIVES

    names = "|".join(OBJECTIVES)
    compared = re.compile(rf"""(==|!=)\\s*["']({names})["']|["']({names})["']\\s*(==|!=|in\\b|not\\s+in\\b)""")
    found = []
    for path in sorted((ROOT / "serl_cli").rglob("*.py")):
        if path.name == "registry.py" and path.parent.name == "algos":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "globals()[" in line or compared.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
