"""docs/ARCHITECTURE.md names every module of serl_cli/ on its folder's line of the tree, so the
map stays whole as modules are added (the README's tree, which it replaces, had fallen behind:
cli/plan.py, four modules of method/, two of training/ were missing); and every function its
section "One iteration, call by call" names exists in the module the section says, so the route
follows the code through renames and moves."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def documented_modules(text: str) -> set[str]:
    """``folder/name.py`` (relative to serl_cli/) for each ``name.py`` the tree names on the lines
    of that folder: a folder's section starts at a line whose first word is ``serl_cli/`` or,
    indented under it, ``cli/``, ``rollout/engines/`` ..., and ends at the next such line; a
    top-level folder other than serl_cli/ (envs/, tests/ ...) ends the package's part."""
    tree = re.search(r"^```\n(.*?)^```", text, flags=re.S | re.M).group(1)
    found, folder = set(), None
    for line in tree.splitlines():
        head = re.match(r"^( *)(\S+/)\s", line + " ")
        if head and len(head.group(1)) <= 2:
            top, name = head.group(1) == "", head.group(2).rstrip("/")
            folder = ("" if name == "serl_cli" else None) if top else (name if folder is not None else None)
        if folder is None:
            continue
        for module in re.findall(r"\b(\w+\.py)\b", line):
            found.add(f"{folder}/{module}" if folder else module)
    return found


def test_the_parser_reads_a_folder_line_by_line():
    text = "```\nserl_cli/  a.py\n  cli/  b.py,\n        c.py\n  x/y/  d.py\nenvs/  e.py\n```\n"
    assert documented_modules(text) == {"a.py", "cli/b.py", "cli/c.py", "x/y/d.py"}


def test_every_module_of_serl_cli_is_in_the_architecture_doc():
    package = ROOT / "serl_cli"
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if p.name != "__init__.py"}
    documented = documented_modules(DOC.read_text(encoding="utf-8"))
    assert not modules - documented, f"modules missing from docs/ARCHITECTURE.md: {sorted(modules - documented)}"
    assert not documented - modules, (
        f"docs/ARCHITECTURE.md names modules that do not exist: {sorted(documented - modules)}"
    )


# -- "One iteration, call by call": every name resolves ------------------------------------------
ITERATION = "One iteration, call by call"
NAME = re.compile(r"(serl_cli(?:\.\w+)*):(\w+(?:\.\w+)*)")  # module:attribute, attribute: name or Class.method


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section: up to the next heading of its level or above."""
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^#{{1,2}} |\Z)", text, flags=re.S | re.M)
    assert found, f"docs/ARCHITECTURE.md has no section '## {title}'"
    return found.group(1)


def named(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The ``(module, attribute path)`` of every backticked ``serl_cli`` name in ``text``, and the
    backticked ``serl_cli`` names not written ``module:attribute``."""
    spans = re.findall(r"`(serl_cli[^`]*)`", text)
    names = [m.groups() for s in spans if (m := NAME.fullmatch(s))]
    return names, [s for s in spans if not NAME.fullmatch(s)]


def where(module: str, path: str) -> str | None:
    """Why ``module:path`` names nothing (None: the module imports and has the attribute path)."""
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        return f"no module ({e})"
    for part in path.split("."):
        if not hasattr(obj, part):
            return f"no attribute {part!r}"
        obj = getattr(obj, part)
    return None


def test_the_iteration_parser_reads_names_and_flags_other_forms():
    text = "## A\n`serl_cli.x` `serl_cli.a.b:f` and `serl_cli.a:C.m`, `rollouts.jsonl`\n## B\n`serl_cli.c:g`\n"
    assert named(section(text, "A")) == ([("serl_cli.a.b", "f"), ("serl_cli.a", "C.m")], ["serl_cli.x"])
    assert where("serl_cli.training.learner", "Learner.update") is None
    assert where("serl_cli.training.learner", "Learner.no_such_phase") == "no attribute 'no_such_phase'"
    assert where("serl_cli.no_such_module", "f").startswith("no module")


def test_every_name_of_the_iteration_section_exists_in_its_module():
    names, malformed = named(section(DOC.read_text(encoding="utf-8"), ITERATION))
    assert not malformed, f"write these as module:attribute in '{ITERATION}': {malformed}"
    assert len(names) > 50, "the section's names were not found: has their form changed?"
    wrong = {f"{m}:{p}": why for m, p in sorted(set(names)) if (why := where(m, p)) is not None}
    assert not wrong, f"docs/ARCHITECTURE.md, '{ITERATION}', names what the code does not have: {wrong}"
