"""Flags generated from the settings (serl_cli.cli.flags): each declared flag sets a real setting of
its command, a ``Literal`` setting is a choice in ``--help`` and a bad word is a usage error (exit
2), and what a flag gives reaches the settings, under ``--set`` and over the defaults."""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from typing import Literal

import pytest
import typer
from typer.testing import CliRunner

from serl_cli import config as cfgmod
from serl_cli.cli import COMMAND_MODULES
from serl_cli.cli.flags import DECLARED, FLAGS, Given, flag, owner_of, setting_type, settings_command
from serl_cli.cli.root import app
from serl_cli.config import setting

for _module in set(COMMAND_MODULES.values()):  # importing a command module registers it (and its flags)
    importlib.import_module(f"serl_cli.cli.{_module}")

COMMANDS = sorted({command for f in FLAGS for command in f.sets})


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return result.output


def test_every_declared_flag_sets_a_setting_of_its_command():
    assert COMMANDS == ["annotate", "eval", "rollout", "train"]
    for command in COMMANDS:
        classes, declared = DECLARED[command]
        assert declared, command
        for f in declared:
            path = f.sets[command]
            assert setting_type(owner_of(path, classes), path) is not None, (command, f.name)
        names = [f.name for f in declared]
        assert len(set(names)) == len(names), f"serl {command} declares a flag twice: {names}"


@pytest.mark.parametrize("command", COMMANDS)
def test_literal_settings_show_their_choices(command):
    shown = _help(command)
    classes, declared = DECLARED[command]
    chosen = 0
    for f in declared:
        path = f.sets[command]
        words = cfgmod.choices(setting_type(owner_of(path, classes), path))
        if words is not None:
            chosen += 1
            assert re.search(rf"{f.name}\s+<{re.escape('|'.join(words))}>", shown), (f.name, words)
    assert chosen >= 2  # device and dtype at least


@pytest.mark.parametrize("command", ["annotate", "eval", "rollout", "train"])
def test_a_bad_choice_is_a_one_line_usage_error(command, capsys, monkeypatch):
    from serl_cli.cli.root import run

    monkeypatch.setattr(sys, "argv", ["serl", command, "--device", "gpu", "RUN"][: 4 + (command == "annotate")])
    with pytest.raises(SystemExit) as e:
        run()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(lines) == 1, lines
    for needle in ("--device", "'gpu'", "'cuda'", f"see serl {command} --help"):
        assert needle in lines[0]


# -- the mechanism, on a command of its own -------------------------------------------------------


@dataclasses.dataclass
class Inner:
    mode: Literal["fast", "slow"] = setting("fast", "how it runs")
    on: bool = setting(False, "whether it is on")


@dataclasses.dataclass
class Settings:
    inner: Inner = setting(factory=Inner, doc="a section")
    count: int | None = setting(None, "how many; null: all")
    name: str = setting("x", "the name")
    seed: int = setting(0, "the seed")


TRY_FLAGS = (
    flag("--mode", t="inner.mode"),
    flag("--on", t="inner.on"),
    flag("--count", t="count", help="Count them."),
    flag("--name", t="name"),
    flag("--other", elsewhere="name"),  # another command's: not shown here
)


def _try_app(seen: list):
    try_app = typer.Typer(add_completion=False)

    @try_app.command()
    @settings_command("t", Settings, flags=TRY_FLAGS)
    def t(given: Given, loud: bool = typer.Option(False, "--loud", help="Say it.")):
        seen.append((given, given.resolve(), loud))

    return try_app


def _run(*args: str):
    seen: list = []
    result = CliRunner().invoke(_try_app(seen), list(args), env={"COLUMNS": "250"})
    return result, seen


def test_flags_reach_the_settings_and_set_wins():
    result, [(given, cfg, loud)] = _run()
    assert result.exit_code == 0, result.output
    assert given.flags == {"inner.mode": None, "inner.on": None, "count": None, "name": None, "seed": None}
    assert cfg == Settings() and loud is False

    result, [(given, cfg, loud)] = _run("--mode", "slow", "--on", "--count", "3", "--seed", "5", "--loud", "-q")
    assert result.exit_code == 0, result.output
    assert cfg == Settings(inner=Inner(mode="slow", on=True), count=3, seed=5)
    assert type(cfg.inner.mode) is str and loud is True and given.quiet is True

    result, [(given, cfg, _)] = _run("--mode", "slow", "--no-on", "--set", "inner.mode=fast")
    assert given.flags["inner.on"] is False and cfg.inner == Inner(mode="fast", on=False)


def test_a_bad_choice_never_reaches_the_body():
    result, seen = _run("--mode", "medium")
    assert result.exit_code == 2 and seen == []
    assert "'medium'" in result.output and "'fast'" in result.output


def test_help_is_the_settings_doc_with_its_default_in_order():
    result, _ = _run("--help")
    text = result.output
    assert re.search(r"--mode\s+<fast\|slow>\s+how it runs\. \[default: \(fast\)\]", text)
    assert re.search(r"--count\s+<int>\s+Count them\.\s", text) and "[default: (None)]" not in text
    assert "--on" in text and "--no-on" in text and "whether it is on." in text
    assert "--other" not in text
    # the command's own options, then its flags in panels by the section they set, each in declared order
    order = [name for name in re.findall(r"│ (--[a-z-]+)", text)]
    assert order == ["--loud", "--config", "--set", "--seed", "--quiet", "--verbose", "--help", "--mode", "--count",
                     "--name", "--on"]  # fmt: skip
    assert re.findall(r"╭─ (\w[\w ]*) ─", text) == ["Options", "Run", "Switches"]


def test_a_flag_without_its_setting_fails_at_declaration():
    with pytest.raises(LookupError, match="no setting inner.speed"):
        settings_command("t", Settings, flags=(flag("--speed", t="inner.speed"),))(lambda given: None)
