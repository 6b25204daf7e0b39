"""The ``serl`` command line: one typer app (``cli.root``), one module per command.

Each command module registers itself on the root app when imported; the root app never
imports them. :func:`main` (the ``serl`` entry point) imports them all, then runs the app.
"""

from __future__ import annotations


def main() -> None:
    from serl_cli.cli import ablate, annotate, data, demo, env_play, eval, model, rollout, show, train  # noqa: F401  (importing a command module registers it)
    from serl_cli.cli.root import run

    run()
