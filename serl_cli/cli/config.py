"""``serl config show COMMAND``: the configuration a command would run with, as YAML;
``serl config reference``: every setting of every command, documented (docs/CONFIG.md).

    serl config show train --config experiments/webshop/serl.yaml --set train.optim.lr=1e-5
    serl config show eval --defaults          # each setting with its documentation as a comment
    serl config reference > docs/CONFIG.md

It resolves exactly as the command does (defaults < ``--config`` files, left to right <
``--set``), so a typo fails here with the same one-line error, before anything runs.
Command-line flags of the command itself (``--tasks``, ``--algo``...) are ``--set`` keys here.
The documentation is each field's own (``config.setting``).
"""

from __future__ import annotations

import dataclasses
import textwrap
import types
import typing

import typer
import yaml

from serl_cli import api
from serl_cli import config as cfgmod
from serl_cli.cli.common import resolve
from serl_cli.cli.root import SetOpt, app, console
from serl_cli.errors import SerlError

config_app = typer.Typer(no_args_is_help=True, help="Configuration: print what a command would run with.")
app.add_typer(config_app, name="config")


def config_class(command: str) -> type:
    """The settings dataclass behind each command (imported only when asked for): the Python
    API's (:func:`serl_cli.api.config_class`), and the CLI's own commands' (data, model)."""
    if command == "data":
        from serl_cli.cli.data import PrepareConfig

        return PrepareConfig
    if command == "model":
        from serl_cli.cli.model import ModelInitConfig

        return ModelInitConfig
    if command in COMMANDS:
        return api.config_class(command)
    raise SerlError(f"unknown command {command!r}: choose one of {', '.join(COMMANDS)}")


COMMANDS = ("rollout", "annotate", "train", "eval", "demo", "data", "model", "env")


def _section_class(tp):
    """The settings dataclass a field holds (``X`` or ``X | None``), else None."""
    for arg in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _flow(value) -> str:
    """One value as inline YAML."""
    return yaml.safe_dump([value], default_flow_style=True, width=10**9, sort_keys=False).strip()[1:-1]


def documented_yaml(cls, plain: dict, indent: int = 0) -> list[str]:
    """``plain`` (settings of ``cls``) as YAML lines, each key under its documentation as a comment."""
    hints, fields = typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}
    pad, lines = "  " * indent, []
    for key, value in plain.items():
        doc = cfgmod.described(fields[key])
        lines += [f"{pad}# {line}" for line in textwrap.wrap(doc, 100 - len(pad))]
        section = _section_class(hints[key])
        if section is not None and isinstance(value, dict):
            lines += [f"{pad}{key}:", *documented_yaml(section, value, indent + 1)]
        else:
            lines.append(f"{pad}{key}: {_flow(value)}")
    return lines


@config_app.command("show")
def show_command(
    command: str = typer.Argument(..., help=f"The command whose configuration to print: {' | '.join(COMMANDS)}."),
    config: list[str] | None = typer.Option(None, "--config", help="YAML config files, composed left to right."),
    set_: list[str] | None = SetOpt,
    defaults: bool = typer.Option(False, "--defaults", help="Print the defaults alone (no files, no --set)."),
):
    """Print the resolved configuration of COMMAND as YAML."""
    cls = config_class(command)
    if defaults:
        if config or set_:
            raise SerlError("--defaults prints the defaults alone: drop --config and --set")
        cfg = cls()
    else:
        cfg = resolve(cls, config_file=config, overrides=set_, flags={}, command=command)
    if command == "train":  # as RUN/online.yaml holds it: each setting once, without the loop's own copies
        from serl_cli.online.run_file import run_settings

        plain = run_settings(cfg)
    else:
        plain = dataclasses.asdict(cfg)
    text = "\n".join(documented_yaml(cls, plain)) + "\n" if defaults else yaml.safe_dump(plain, sort_keys=False)
    console.print(text, end="", highlight=False, markup=False, soft_wrap=True)


@config_app.command("reference")
def reference_command():
    """Print the configuration reference (docs/CONFIG.md): every setting of every command, documented."""
    console.print(reference(), end="", highlight=False, markup=False, soft_wrap=True)


# the settings dataclasses the reference documents beyond the commands': where they live, what reads them
EXTRA_CLASSES = {"serl_cli.ablate.grid:Grid": "`serl ablate`'s grid, resolved (OUT/grid.json)"}


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(map(str, typing.get_args(tp)))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp)) if not typing.get_args(tp) else str(tp).replace("typing.", "")


def _default_text(f: dataclasses.Field, section) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if section is not None:  # a section: where its default differs from the section's own defaults
            own, given = dataclasses.asdict(section()), dataclasses.asdict(value)
            delta = {k: v for k, v in given.items() if v != own[k]}
            return f"`{_flow(delta)}`" if delta else ""
        return f"`{_flow(value)}`"
    return "" if f.default is dataclasses.MISSING else f"`{_flow(f.default)}`"


def settings_classes() -> list:
    """Every settings dataclass the commands read, each once, in the order the commands reach them."""
    import importlib

    roots = [config_class(c) for c in ("train", *COMMANDS)] + [
        getattr(importlib.import_module(m), n) for m, n in (x.split(":") for x in EXTRA_CLASSES)
    ]
    seen: list = []

    def visit(cls) -> None:
        if cls in seen:
            return
        seen.append(cls)
        for tp in typing.get_type_hints(cls).values():
            if (section := _section_class(tp)) is not None:
                visit(section)

    for cls in roots:
        visit(cls)
    return seen


def reference() -> str:
    """docs/CONFIG.md: one table per settings dataclass, from its fields' own documentation."""
    import importlib

    used_by = {config_class(c): f"`serl {c}`" for c in COMMANDS}
    for where, what in EXTRA_CLASSES.items():
        module, name = where.split(":")
        used_by[getattr(importlib.import_module(module), name)] = what
    lines = [
        "# Configuration reference",
        "",
        "Every setting of every command, generated from the settings' own documentation "
        "(`serl config reference > docs/CONFIG.md`; a test fails when this page is stale).",
        "A command takes its settings from defaults < `--config FILE.yaml` (repeatable, composed left to "
        "right) < its flags < `--set key.path=value`; `serl config show COMMAND [--defaults]` prints what it "
        "would run with. A section's default lists where it differs from the section's own defaults.",
        "`serl rollout|eval|annotate --config RUN_FILE` run their step of a run file (`serl train`'s layout) "
        "as the online loop does (`serl_cli/online/derive.py`).",
    ]
    for cls in settings_classes():
        # the heading is the class name alone: its anchor (#trainconfig) is what the tables link to
        lines += ["", f"## `{cls.__name__}`", ""]
        if cls in used_by:
            lines += [f"Settings of {used_by[cls]}.", ""]
        lines += ["| setting | type | default | |", "| --- | --- | --- | --- |"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            section = _section_class(hints[f.name])
            kind = f"[`{section.__name__}`](#{section.__name__.lower()})" if section else _type_name(hints[f.name])
            doc = cfgmod.described(f).replace("|", "\\|")
            lines.append(f"| `{f.name}` | {kind} | {_default_text(f, section)} | {doc} |")
    return "\n".join(lines) + "\n"
