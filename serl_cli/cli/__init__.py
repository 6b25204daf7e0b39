"""The ``serl`` command line: one typer app (``cli.root``), one module per command.

Each command module registers itself on the root app when imported; the root app never
imports them. :func:`main` (the ``serl`` entry point) imports the module of the command
being run, or all of them where none is named (``serl --help``, a misspelt command), then
runs the app. Importing only what the command needs keeps ``serl eval --policy expert`` and
every one-line error free of torch and transformers (several seconds of start-up each).
"""

from __future__ import annotations

# command name -> the module that registers it
COMMAND_MODULES = {
    "ablate": "ablate",
    "annotate": "annotate",
    "config": "config",
    "data": "data",
    "demo": "demo",
    "env": "env_play",
    "eval": "eval",
    "model": "model",
    "plan": "plan",
    "plot": "plot",
    "rollout": "rollout",
    "show": "show",
    "train": "train",
}


def command_modules(argv: list[str]) -> list[str]:
    """The command modules to import for ARGV (the arguments after ``serl``): the first word
    is the command, unless an option comes first (``--version``, ``--help``)."""
    if argv and argv[0] in COMMAND_MODULES:
        return [COMMAND_MODULES[argv[0]]]
    return list(COMMAND_MODULES.values())


def main() -> None:
    import importlib
    import sys

    from serl_cli.cli.root import quiet_libraries, run

    quiet_libraries()  # before any command module imports huggingface_hub, which reads its settings once
    for name in command_modules(sys.argv[1:]):  # importing a command module registers it on the root app
        importlib.import_module(f"serl_cli.cli.{name}")
    run()
