"""``serl demo``: model -> expert data -> warm start -> online RL -> eval, on the embedded default."""

from __future__ import annotations

import dataclasses

import typer
from rich.table import Table

from serl_cli import config as cfgmod
from serl_cli.cli.common import plural, resolve, save_resolved
from serl_cli.cli.root import ConfigOpt, QuietOpt, SeedOpt, SetOpt, app, console
from serl_cli.demo.config import DemoConfig, demo_defaults, quick
from serl_cli.demo.pipeline import ARM_PREFIX, gain_text, run_demo


@app.command("demo")
def demo_command(
    env: str | None = typer.Option(None, "--env", help="Environment: sokoban (default) or webshop."),
    iterations: int | None = typer.Option(None, "--iterations", help="Online RL iterations per algorithm."),
    algo: list[str] | None = typer.Option(
        None, "--algo", help="Online algorithm (repeatable; default grpo and serl on Sokoban, grpo elsewhere)."
    ),
    episodes: int | None = typer.Option(None, "--episodes", help="Test-panel episodes per evaluation."),
    threads: int | None = typer.Option(
        None, "--threads", help="Torch threads per process (default 1: the arms run side by side, one core each)."
    ),
    out: str | None = typer.Option(None, "--out", help="Directory for every artifact of the demo."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier demo in --out."),
    quick_run: bool = typer.Option(False, "--quick", help="A smoke run: every stage at sizes that take seconds."),
    config: list[str] | None = ConfigOpt,
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
        out_dir=True,
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
        log=(lambda *_: None)
        if quiet
        else (lambda msg: console.print(msg, highlight=False, markup=False, soft_wrap=True)),
    )
    save_resolved(cfg.out, "demo.yaml", cfg)
    console.print(results_table(cfg, summary))
    if not quiet:
        for line in in_words(cfg, summary, quick_run):
            console.print(line, highlight=False, markup=False, soft_wrap=True)


def results_table(cfg: DemoConfig, summary: dict) -> Table:
    decoding = "greedy" if cfg.eval_temperature <= 0 else f"sampled at T {cfg.eval_temperature:g}"
    table = Table(
        title=f"{cfg.env.name} test panel, first {cfg.eval_episodes} tasks, {decoding} "
        f"({summary['wall_time_s']:.0f} s in all)"
    )
    for col in ("policy", "success", "95% interval", "gain, points", "score", "invalid actions", "mean turns"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    gains = summary["gains"]
    for name, r in summary["results"].items():
        lo, hi = r["success_ci95"]
        gain = gains.get(name.removeprefix(ARM_PREFIX)) if name.startswith(ARM_PREFIX) else None
        change = "" if gain is None else gain_text(gain["points"], gain["ci95"])
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


def in_words(cfg: DemoConfig, summary: dict, quick_run: bool = False) -> list[str]:
    """What the table says and what to try next, in plain words for someone who has just run it."""
    results = summary["results"]
    start = results["warm start"]["success_rate"]
    warm = summary.get("warm_start") or {}
    rooms = f"{cfg.eval_episodes} test rooms"
    lines = ["", "What happened:"]
    where = f" (SFT stopped at step {warm['step']})" if "step" in warm else ""
    lines.append(f"  The warm start{where} solved {start:.0%} of {rooms} it never trained on.")
    kept = summary.get("kept_iterations") or {}
    for algo, gain in summary["gains"].items():
        rate = results[ARM_PREFIX + algo]["success_rate"]
        best = f" (its best round on train rooms, round {kept[algo]})" if kept.get(algo) else ""
        lines.append(
            f"  After {plural(cfg.online.iterations, 'round')} of RL, {algo.upper()}{best} solved {rate:.0%}: "
            f"{gain['points']:+.0f} points{_in_words_interval(gain['ci95'])}."
        )
    lines.append(
        f"  Each gain's interval compares the two policies room by room on the same {rooms}: "
        "where it reaches down to 0, the gain could be luck."
    )
    signal = summary.get("teacher_signal")
    if signal:
        gain = signal["expert_prob_gain"]
        read = "more" if gain > 0 else "less"
        lines.append(
            f"  SERL's teacher, the model itself shown what the environment said about a move, pushed the "
            f"{signal['turns']} flagged moves the right way {signal['right_direction']:.0%} of the time, and rated "
            f"the expert's move {abs(100 * gain):.0f} points {read} likely after reading that feedback."
        )
    if quick_run:
        lines.append("  This was --quick: every stage ran, at sizes too small to learn. `serl demo` is the real run.")
    last = f"{cfg.out}/{cfg.algos[-1]}/iter_{cfg.online.iterations - 1:04d}"
    lines += [
        "",
        "Next:",
        f"  serl show {last} --episode 0    one game of the last round, turn by turn",
        f"  serl demo --seed 1 --out {cfg.out}-seed1    the same demo on other rooms and other random draws",
        "  README.md, 'The pipeline': each step as its own command, for your own model and environment",
        f"  Everything this run wrote is in {cfg.out}/ (demo.json: the numbers above).",
    ]
    return lines


def _in_words_interval(ci: list[float] | None) -> str:
    return "" if ci is None else f" (95% interval {ci[0]:+.0f} to {ci[1]:+.0f})"


def _env_in(config: list[str] | None, overrides: list[str] | None) -> str | None:
    """The environment the config files (the last that names one) or ``--set env.name=...`` ask
    for, to pick the demo's defaults."""
    name = None
    for file in config or []:
        name = (cfgmod.load_yaml(file).get("env") or {}).get("name") or name
    for text in overrides or []:
        path, value = cfgmod.parse_override(text)
        if path == ["env", "name"]:
            name = value
    return name
