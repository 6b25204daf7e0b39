"""docs/ARCHITECTURE.md names every module of serl_cli/ on its folder's line of the tree, so the
map stays whole as modules are added (the README's tree, which it replaces, had fallen behind:
cli/plan.py, four modules of method/, two of training/ were missing)."""

from __future__ import annotations

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
