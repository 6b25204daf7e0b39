"""The root of the ``serl`` command line: the typer app, its shared options, and error handling.

Every command takes ``--config FILE.yaml``, repeated ``--set key.path=value``, ``--seed``,
``--out`` and ``-q/-v``; the resolved configuration is written next to its artifacts. Bad
input raises :class:`SerlError`, printed here as one line with exit code 2.
"""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console
from rich.markup import escape

from envs.base import EnvError
from serl_cli import __version__
from serl_cli.errors import SerlError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="serl: selective environment-reweighted learning for multi-turn LLM agents.",
)
env_app = typer.Typer(no_args_is_help=True, help="Environments: play a task by hand or by script.")
app.add_typer(env_app, name="env")

console = Console()
err_console = Console(stderr=True)

# Options every command shares (README.md, "The pipeline").
ConfigOpt = typer.Option(
    None,
    "--config",
    help="A YAML config file (from experiments/ or your own); repeat it to compose files, left to right.",
)
SetOpt = typer.Option(None, "--set", help="Override a setting: key.path=value (repeatable; value parsed as YAML).")
SeedOpt = typer.Option(None, "--seed", help="Seed for task order, sampling and initialization.")
QuietOpt = typer.Option(False, "-q", "--quiet", help="Print only the final table.")
VerboseOpt = typer.Option(False, "-v", "--verbose", help="Print more detail.")


def _version(value: bool):
    if value:
        console.print(f"serl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version.")):
    pass


def quiet_libraries() -> None:
    """Library progress bars and warnings would bury serl's own output. Set before the libraries are
    imported: huggingface_hub reads HF_HUB_DISABLE_PROGRESS_BARS once, at import."""
    if not sys.stderr.isatty():  # on a terminal a real download shows its progress; in logs it would be noise
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # --engine vllm: its start-up log runs to ~100 lines


def run() -> None:
    """Run the app; a :class:`SerlError` or :class:`EnvError` becomes one line and exit code 2."""
    try:
        app()
    except (SerlError, EnvError) as e:
        # escaped: messages quote actions like click[buy now] and extras like serl[vllm]
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(2)
