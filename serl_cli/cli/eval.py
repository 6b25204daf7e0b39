"""``serl eval``: a policy (expert, random or a model) over a split's fixed panel."""

from __future__ import annotations

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from serl_cli.cli.common import eval_rows, resolve, save_resolved, show_defaults, summary_table
from serl_cli.cli.root import ConfigOpt, QuietOpt, SeedOpt, SetOpt, VerboseOpt, app, console
from serl_cli.stages.evaluate import EvalConfig, run_eval


@app.command("eval")
@show_defaults(
    EvalConfig,
    env="env.name",
    policy="policy",
    episodes="episodes",
    panel="panel",
    max_turns="env.max_turns",
    engine="engine",
    device="device",
    dtype="dtype",
    out="out",
)
def eval_command(
    env: str | None = typer.Option(
        None,
        "--env",
        help="Environment: webshop, alfworld, sokoban, an installed serl.envs entry point, or "
        "package.module:factory (docs/ENVIRONMENTS.md).",
    ),
    split: str | None = typer.Option(
        None, "--split", help="Split whose panel to run (default: webshop test, alfworld valid_unseen)."
    ),
    policy: str | None = typer.Option(None, "--policy", help="expert | random | model (implied by --model)."),
    model: str | None = typer.Option(None, "--model", help="A Hugging Face model directory or name."),
    episodes: int | None = typer.Option(None, "--episodes", help="How many tasks of the split (default: all)."),
    panel: str | None = typer.Option(
        None, "--panel", help="Which tasks: first (the first N, default) or spread (N evenly spaced)."
    ),
    max_turns: int | None = typer.Option(None, "--max-turns", help="Turn limit per episode."),
    engine: str | None = typer.Option(
        None,
        "--engine",
        help="A model policy generates with: hf | vllm (the vllm extra; settings: --set vllm.tensor_parallel_size=N).",
    ),
    device: str | None = typer.Option(None, "--device", help="Engine hf: auto (CUDA when present) | cpu | cuda."),
    dtype: str | None = typer.Option(
        None,
        "--dtype",
        help="auto (bf16 on a GPU with it, else fp32) | fp32 | bf16 | fp16: compute precision, through autocast.",
    ),
    threads: int | None = typer.Option(
        None, "--threads", help="Torch threads for a model policy (default: all cores)."
    ),
    out: str | None = typer.Option(None, "--out", help="Output directory (eval.json, episodes.jsonl)."),
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
        summary = run_eval(cfg, overwrite=overwrite, progress=lambda rec: bar.advance(task))
    save_resolved(cfg.out, "eval_config.yaml", cfg)
    console.print(summary_table(f"{summary['env']} {summary['split']}: {summary['policy']} policy", eval_rows(summary)))
    if not quiet:
        console.print(f"wrote {cfg.out}/eval.json")
