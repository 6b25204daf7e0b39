"""``serl rollout``: collect episodes with a model (or the expert, for SFT data)."""

from __future__ import annotations

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from serl_cli import api
from serl_cli.cli.common import LogProgress, resolve, show_defaults, summary_table
from serl_cli.cli.root import ConfigOpt, QuietOpt, SeedOpt, SetOpt, VerboseOpt, app, console, resumable_at
from serl_cli.stages.rollout import RolloutConfig


@app.command("rollout")
@show_defaults(
    RolloutConfig,
    env="env.name",
    split="env.split",
    model="model",
    policy="policy",
    engine="engine",
    tasks="tasks",
    group_size="group_size",
    max_turns="env.max_turns",
    temperature="sampling.temperature",
    top_p="sampling.top_p",
    device="device",
    dtype="dtype",
    threads="threads",
    out="out",
)
def rollout_command(
    env: str | None = typer.Option(None, "--env"),
    split: str | None = typer.Option(None, "--split"),
    model: str | None = typer.Option(None, "--model"),
    policy: str | None = typer.Option(None, "--policy"),
    engine: str | None = typer.Option(None, "--engine"),
    tasks: int | None = typer.Option(None, "--tasks"),
    group_size: int | None = typer.Option(None, "--group-size"),
    max_turns: int | None = typer.Option(None, "--max-turns"),
    temperature: float | None = typer.Option(None, "--temperature"),
    top_p: float | None = typer.Option(None, "--top-p"),
    device: str | None = typer.Option(None, "--device"),
    dtype: str | None = typer.Option(None, "--dtype"),
    threads: int | None = typer.Option(None, "--threads"),
    out: str | None = typer.Option(None, "--out"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing rollouts in --out."),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue an interrupted rollout in --out from its journal "
        "(same settings); a finished one is left as it is.",
    ),
    config: list[str] | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    seed: int | None = SeedOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
):
    """Run a policy on sampled tasks, G times each; store prompt/action token ids, log-probs and feedback."""
    cfg = resolve(
        RolloutConfig,
        config_file=config,
        overrides=set_,
        out_dir=True,
        flags={
            "env.name": env,
            "env.split": split,
            "env.max_turns": max_turns,
            "model": model,
            "policy": policy,
            "engine": engine,
            "tasks": tasks,
            "group_size": group_size,
            "sampling.temperature": temperature,
            "sampling.top_p": top_p,
            "threads": threads,
            "out": out,
            "seed": seed,
            "device": device,
            "dtype": dtype,
        },
        command="rollout",
        quiet=quiet,
    )
    if resume and not overwrite:
        api.require_run_to_resume(cfg.out, "rollout")  # before the Ctrl-C line names it
    resumable_at(cfg.out)  # what Ctrl-C says
    with Progress(
        TextColumn("[bold]rollout"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=quiet,
        transient=True,
    ) as bar:
        task = bar.add_task("episodes", total=cfg.tasks * cfg.group_size)
        lines = LogProgress(console, "rollout", "episodes", total=cfg.tasks * cfg.group_size, quiet=quiet)

        def progress(rec) -> None:
            bar.advance(task)
            lines.advance()

        s = api.rollout(cfg, overwrite=overwrite, resume=resume, progress=progress).summary
    console.print(
        summary_table(
            f"rollout: {cfg.env.name} {cfg.env.split}, {cfg.policy} policy",
            [
                ("episodes", f"{s['episodes']} ({s['tasks']} tasks x {cfg.group_size})"),
                ("success rate", f"{s['success_rate']:.3f}"),
                ("mean reward", f"{s['mean_reward']:.3f}"),
                ("invalid-action rate", f"{s['invalid_action_rate']:.3f}"),
                ("turns", str(s["turns"])),
                ("episodes ended by an environment error", str(s.get("env_errors", 0))),
                ("generated tokens/s", f"{s['tokens_per_s']:.1f}"),
                ("wall time", f"{s['wall_time_s']:.1f} s"),
            ],
        )
    )
    if not quiet:
        console.print(f"wrote {cfg.out}/rollouts.jsonl")
