"""``serl plot RUN``: a run's training curves as a PNG."""

from __future__ import annotations

import typer

from serl_cli.cli.root import app, console
from serl_cli.views.plot import plot_run


@app.command("plot")
def plot_command(
    run: str = typer.Argument(..., help="A run directory with metrics.jsonl (serl train)."),
    x: str = typer.Option("iteration", "--x", help="x axis: iteration | env_steps."),
    out: str | None = typer.Option(None, "--out", help="PNG to write (default: RUN/curves.png)."),
):
    """Plot a run's curves (reward, success, loss, KL, SERL weights...) to curves.png.

    Reward, success, loss, KL (k3), clip fraction, SERL weights and the teacher signal of a run
    (matplotlib: the plots extra, pip install 'serl\\[plots]')."""  # escaped: rich markup would eat [plots]
    path = plot_run(run, x=x, out=out)
    console.print(f"wrote {path}", highlight=False)
