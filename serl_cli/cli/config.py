"""``serl config show COMMAND``: the configuration a command would run with, as YAML.

    serl config show train --config experiments/webshop/serl.yaml --set train.optim.lr=1e-5
    serl config show eval --defaults

It resolves exactly as the command does (defaults < ``--config`` files, left to right <
``--set``), so a typo fails here with the same one-line error, before anything runs.
Command-line flags of the command itself (``--tasks``, ``--algo``...) are ``--set`` keys here.
"""

from __future__ import annotations

import dataclasses

import typer
import yaml

from serl_cli.cli.common import resolve
from serl_cli.cli.root import SetOpt, app, console
from serl_cli.errors import SerlError

config_app = typer.Typer(no_args_is_help=True, help="Configuration: print what a command would run with.")
app.add_typer(config_app, name="config")


def config_class(command: str):
    """The settings dataclass behind each command (imported only when asked for)."""
    if command == "rollout":
        from serl_cli.stages.rollout import RolloutConfig as cls
    elif command == "annotate":
        from serl_cli.method.annotation import AnnotateConfig as cls
    elif command == "train":  # the online loop's config; a single update reads its `train` section
        from serl_cli.stages.online_config import OnlineConfig as cls
    elif command == "eval":
        from serl_cli.stages.evaluate import EvalConfig as cls
    elif command == "demo":
        from serl_cli.stages.demo import DemoConfig as cls
    elif command == "data":
        from serl_cli.cli.data import PrepareConfig as cls
    elif command == "model":
        from serl_cli.cli.model import ModelInitConfig as cls
    elif command == "env":
        from serl_cli.rollout.worlds import EnvConfig as cls
    else:
        raise SerlError(f"unknown command {command!r}: choose one of {', '.join(COMMANDS)}")
    return cls


COMMANDS = ("rollout", "annotate", "train", "eval", "demo", "data", "model", "env")


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
        from serl_cli.stages.run_file import run_settings

        plain = run_settings(cfg)
    else:
        plain = dataclasses.asdict(cfg)
    console.print(yaml.safe_dump(plain, sort_keys=False), end="", highlight=False, markup=False)
