"""``serl demo``: model -> expert data -> warm start -> online RL -> eval, on the embedded default."""

from __future__ import annotations

import dataclasses

import typer
from rich.table import Table

from serl_cli import config as cfgmod
from serl_cli.cli.common import resolve, save_resolved
from serl_cli.cli.root import ConfigOpt, QuietOpt, SeedOpt, SetOpt, app, console
from serl_cli.stages.demo import DemoConfig, demo_defaults, quick, run_demo


@app.command("demo")
def demo_command(
    env: str | None = typer.Option(None, "--env", help="Environment: sokoban (default) or webshop."),
    iterations: int | None = typer.Option(None, "--iterations", help="Online RL iterations per algorithm."),
    algo: list[str] | None = typer.Option(
        None, "--algo", help="Online algorithm (repeatable; default grpo and serl on Sokoban, grpo elsewhere)."
    ),
    episodes: int | None = typer.Option(None, "--episodes", help="Test-panel episodes per evaluation."),
    threads: int | None = typer.Option(None, "--threads", help="Torch threads (default: all cores)."),
    out: str | None = typer.Option(None, "--out", help="Directory for every artifact of the demo."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier demo in --out."),
    quick_run: bool = typer.Option(False, "--quick", help="A smoke run: every stage at sizes that take seconds."),
    config: str | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    seed: int | None = SeedOpt,
    quiet: bool = QuietOpt,
):
    """The whole pipeline on the embedded default: a small model, expert data, warm start, online RL, evaluation."""
    env_name = env or _env_in(config, set_) or "sokoban"
    defaults = demo_defaults(env_name)
    cfg = resolve(
        DemoConfig,
        config_file=config,
        overrides=set_,
        base=dataclasses.asdict(quick(defaults) if quick_run else defaults),
        flags={
            "env.name": env,
            "online.iterations": iterations,
            "algos": algo or None,
            "eval_episodes": episodes,
            "threads": threads,
            "out": out,
            "seed": seed,
        },
    )
    summary = run_demo(
        cfg,
        overwrite=overwrite,
        log=(lambda *_: None) if quiet else (lambda msg: console.print(msg, highlight=False, markup=False)),
    )
    save_resolved(cfg.out, "demo.yaml", cfg)
    console.print(results_table(cfg, summary))
    signal = summary.get("teacher_signal")
    if signal:
        console.print(
            f"SERL teacher signal ({signal['turns']} scored turns over {signal['iterations']} iterations): "
            f"moves the student's action the right way on {signal['right_direction']:.1%}; "
            f"expert action's probability {signal['expert_prob_gain']:+.3f} with the block"
        )
    console.print(f"artifacts: {cfg.out}/")


def results_table(cfg: DemoConfig, summary: dict) -> Table:
    decoding = "greedy" if cfg.eval_temperature <= 0 else f"sampled at T {cfg.eval_temperature:g}"
    table = Table(
        title=f"{cfg.env.name} test panel, first {cfg.eval_episodes} tasks, {decoding} "
        f"({summary['wall_time_s']:.0f} s in all)"
    )
    for col in ("policy", "success", "95% interval", "vs warm start", "score", "invalid actions", "mean turns"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    start = summary["results"]["warm start"]["success_rate"]
    for name, r in summary["results"].items():
        lo, hi = r["success_ci95"]
        change = "" if name in ("expert", "warm start") else f"{100 * (r['success_rate'] - start):+.1f} pts"
        table.add_row(
            name,
            f"{r['success_rate']:.3f}",
            f"[{lo:.3f}, {hi:.3f}]",
            change,
            f"{r['score']:.1f}",
            f"{r['invalid_action_rate']:.3f}",
            f"{r['mean_turns']:.2f}",
        )
    return table


def _env_in(config: str | None, overrides: list[str] | None) -> str | None:
    """The environment a config file or ``--set env.name=...`` asks for, to pick the demo's defaults."""
    name = None
    if config:
        name = (cfgmod.load_yaml(config).get("env") or {}).get("name")
    for text in overrides or []:
        path, value = cfgmod.parse_override(text)
        if path == ["env", "name"]:
            name = value
    return name
