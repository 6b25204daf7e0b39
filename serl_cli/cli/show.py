"""``serl show RUN``: a run's episodes, or one episode turn by turn with its annotations."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from serl_cli.artifacts.schema import read_manifest
from serl_cli.cli.root import app, console
from serl_cli.errors import SerlError
from serl_cli.views import show as sh
from serl_cli.views import show_online


@app.command("show")
def show_command(
    run: str = typer.Argument(
        ...,
        help="A run directory (manifest.json, rollouts.jsonl, optional annotations.jsonl), or an online "
        "run (serl train --iterations: its iter_XXXX folders).",
    ),
    episode: int | None = typer.Option(None, "--episode", help="Show this episode (its index in rollouts.jsonl)."),
    turn: int | None = typer.Option(None, "--turn", help="With --episode: only this turn."),
    full: bool = typer.Option(False, "--full", help="Show observations whole instead of shortened."),
    width: int | None = typer.Option(
        None, "--width", min=40, help="Render at this many columns (default: the terminal's)."
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print JSON for scripts: the episode with its annotations "
        "merged per turn (without --episode: one row per episode).",
    ),
):
    """Show a run: its stages and episodes, or one episode turn by turn (selection, hindsight, weights)."""
    if turn is not None and episode is None:
        raise SerlError("--turn needs --episode")
    out = Console(width=width) if width else console
    if (Path(run) / "grid.json").is_file() and not (Path(run) / "manifest.json").is_file():
        # an ablation's folder holds runs, one per cell: its view is the report over them
        raise SerlError(f"{run} is an ablation directory (grid.json), not a run: use serl ablate --report {run}")
    stored = read_manifest(run)
    if show_online.is_online_run(run, stored):  # the online loop's run: its episodes are in its iterations
        rows = show_online.iteration_rows(run, stored)
        if episode is not None:
            folder = rows[-1]["folder"] if rows else "iter_0000"
            raise SerlError(
                f"{run} is an online run: its episodes are in its iterations, e.g. "
                f"serl show {Path(run) / folder} --episode {episode}"
            )
        if as_json:
            typer.echo(json.dumps(rows))
            return
        out.print(show_online.online_view(run, stored, rows))
        return
    manifest, episodes, ann = sh.load_run(run)
    if as_json:
        data = sh.episode_json(episodes, ann, episode, turn) if episode is not None else sh.episode_rows(episodes, ann)
        typer.echo(json.dumps(data))  # one line: pipe to jq to read it
        return
    if episode is None:
        out.print(sh.run_view(run, manifest, episodes, ann))
    else:
        out.print(sh.episode_view(manifest, episodes, ann, episode, turn, full=full))
