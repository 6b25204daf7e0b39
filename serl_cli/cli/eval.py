"""``serl eval``: a policy (expert, random or a model) over a split's fixed panel."""

from __future__ import annotations

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from serl_cli import api
from serl_cli.cli.common import LogProgress, eval_rows, resolve, show_defaults, summary_table
from serl_cli.cli.root import ConfigOpt, QuietOpt, SeedOpt, SetOpt, VerboseOpt, app, console
from serl_cli.stages.evaluate import EvalConfig


@app.command("eval")
@show_defaults(
    EvalConfig,
    env="env.name",
    split="env.split",
    policy="policy",
    model="model",
    episodes="episodes",
    panel="panel",
    max_turns="env.max_turns",
    engine="engine",
    device="device",
    dtype="dtype",
    threads="threads",
    out="out",
)
def eval_command(
    env: str | None = typer.Option(None, "--env"),
    split: str | None = typer.Option(None, "--split"),
    policy: str | None = typer.Option(None, "--policy"),
    model: str | None = typer.Option(None, "--model"),
    episodes: int | None = typer.Option(None, "--episodes"),
    panel: str | None = typer.Option(None, "--panel"),
    max_turns: int | None = typer.Option(None, "--max-turns"),
    engine: str | None = typer.Option(None, "--engine"),
    device: str | None = typer.Option(None, "--device"),
    dtype: str | None = typer.Option(None, "--dtype"),
    threads: int | None = typer.Option(None, "--threads"),
    out: str | None = typer.Option(None, "--out"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing evaluation in --out."),
    config: list[str] | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    seed: int | None = SeedOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
):
    """Evaluate a policy on a split's fixed panel: success with a 95 % interval, score, turns."""
    cfg = resolve(
        EvalConfig,
        config_file=config,
        overrides=set_,
        out_dir=True,
        flags={
            "env.name": env,
            "env.split": split,
            "env.max_turns": max_turns,
            "policy": policy,
            "model": model,
            "episodes": episodes,
            "panel": panel,
            "threads": threads,
            "out": out,
            "seed": seed,
            "engine": engine,
            "device": device,
            "dtype": dtype,
        },
        command="eval",
        quiet=quiet,
    )
    with Progress(
        TextColumn("[bold]eval"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=quiet,
        transient=True,
    ) as bar:
        task = bar.add_task("episodes", total=cfg.episodes)
        lines = LogProgress(console, "eval", "episodes", total=cfg.episodes, quiet=quiet)

        def progress(rec) -> None:
            bar.advance(task)
            lines.advance()

        summary = api.evaluate(cfg, overwrite=overwrite, progress=progress)
    console.print(summary_table(f"{summary['env']} {summary['split']}: {summary['policy']} policy", eval_rows(summary)))
    if not quiet:
        console.print(f"wrote {cfg.out}/eval.json")
