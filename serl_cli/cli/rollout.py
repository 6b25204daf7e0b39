"""``serl rollout``: collect episodes with a model (or the expert, for SFT data)."""

from __future__ import annotations

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from serl_cli.cli.common import require_run_to_resume, resolve, save_resolved, show_defaults, summary_table
from serl_cli.cli.root import ConfigOpt, QuietOpt, SeedOpt, SetOpt, VerboseOpt, app, console, resumable_at
from serl_cli.stages.rollout import RolloutConfig, run_rollout


@app.command("rollout")
@show_defaults(
    RolloutConfig,
    env="env.name",
    policy="policy",
    engine="engine",
    tasks="tasks",
    group_size="group_size",
    max_turns="env.max_turns",
    temperature="sampling.temperature",
    top_p="sampling.top_p",
    out="out",
)
def rollout_command(
    env: str | None = typer.Option(
        None,
        "--env",
        help="Environment: webshop, alfworld, sokoban, an installed serl.envs entry point, or "
        "package.module:factory (docs/ENVIRONMENTS.md).",
    ),
    split: str | None = typer.Option(None, "--split", help="Split to sample tasks from (default train)."),
    model: str | None = typer.Option(
        None, "--model", help="HF model directory or name (default: the embedded tiny model)."
    ),
    policy: str | None = typer.Option(None, "--policy", help="model | expert (expert: SFT data)."),
    engine: str | None = typer.Option(None, "--engine", help="Generation engine: hf | vllm (the vllm extra)."),
    tasks: int | None = typer.Option(None, "--tasks", help="How many tasks to sample."),
    group_size: int | None = typer.Option(None, "--group-size", help="Rollouts per task (G)."),
    max_turns: int | None = typer.Option(None, "--max-turns", help="Turn limit per episode."),
    temperature: float | None = typer.Option(None, "--temperature", help="Sampling temperature (0 = greedy)."),
    top_p: float | None = typer.Option(None, "--top-p", help="Nucleus sampling mass."),
    device: str | None = typer.Option(None, "--device", help="Engine hf: auto (CUDA when present) | cpu | cuda."),
    dtype: str | None = typer.Option(
        None,
        "--dtype",
        help="auto (bf16 on a GPU with it, else fp32) | fp32 | bf16 | fp16: compute precision, through autocast.",
    ),
    threads: int | None = typer.Option(None, "--threads", help="Torch threads (default: all cores)."),
    out: str | None = typer.Option(None, "--out", help="Run directory to write."),
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
        require_run_to_resume(cfg.out, "rollout")
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
        s = run_rollout(cfg, overwrite=overwrite, resume=resume, progress=lambda rec: bar.advance(task))
    save_resolved(cfg.out, "rollout.yaml", cfg)
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
