"""``serl demo``: model -> expert data -> SFT -> online RL -> eval, on the embedded default."""

from __future__ import annotations

from typing import List, Optional

import typer
from rich.table import Table

from serl_cli.cli.common import resolve, save_resolved
from serl_cli.cli.root import ConfigOpt, QuietOpt, SeedOpt, SetOpt, app, console
from serl_cli.stages.demo import DemoConfig, run_demo


@app.command("demo")
def demo_command(
    env: Optional[str] = typer.Option(None, "--env", help="Environment: webshop."),
    iterations: Optional[int] = typer.Option(None, "--iterations", help="Online RL iterations after SFT."),
    algo: Optional[str] = typer.Option(None, "--algo", help="Online algorithm (grpo)."),
    episodes: Optional[int] = typer.Option(None, "--episodes", help="Test-panel episodes per evaluation."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Torch threads (default: all cores)."),
    out: Optional[str] = typer.Option(None, "--out", help="Directory for every artifact of the demo."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier demo in --out."),
    config: Optional[str] = ConfigOpt,
    set_: Optional[List[str]] = SetOpt,
    seed: Optional[int] = SeedOpt,
    quiet: bool = QuietOpt,
):
    """The whole pipeline on the embedded default: tiny model, expert data, SFT, online RL, evaluation."""
    cfg = resolve(DemoConfig, config_file=config, overrides=set_, flags={
        "env.name": env, "online.iterations": iterations, "online.train.algo": algo, "eval_episodes": episodes,
        "threads": threads, "out": out, "seed": seed})
    summary = run_demo(cfg, overwrite=overwrite, log=(lambda *_: None) if quiet else
                       (lambda msg: console.print(msg, highlight=False, markup=False)))
    save_resolved(cfg.out, "demo.yaml", cfg)
    table = Table(title=f"{cfg.env.name} test panel, first {cfg.eval_episodes} tasks "
                        f"({summary['wall_time_s']:.0f} s in all)")
    for col in ("policy", "success", "95% interval", "score", "invalid actions", "mean turns"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for name, r in summary["results"].items():
        lo, hi = r["success_ci95"]
        table.add_row(name, f"{r['success_rate']:.3f}", f"[{lo:.3f}, {hi:.3f}]", f"{r['score']:.1f}",
                      f"{r['invalid_action_rate']:.3f}", f"{r['mean_turns']:.2f}")
    console.print(table)
    console.print(f"artifacts: {cfg.out}/")
