"""The ``serl`` command line: one typer app (``cli.root``), one module per command.

Each command module registers itself on the root app when imported; the root app never
imports them. :func:`main` (the ``serl`` entry point) imports them all, then runs the app.
"""

from __future__ import annotations

COMMAND_MODULES = ("ablate", "annotate", "config", "data", "demo", "env_play", "eval", "model", "plot", "rollout",
                   "show", "train")


def main() -> None:
    import importlib

    from serl_cli.cli.root import run

    for name in COMMAND_MODULES:  # importing a command module registers it on the root app
        importlib.import_module(f"serl_cli.cli.{name}")
    run()
