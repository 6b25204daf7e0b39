"""``serl data prepare``: compute what an environment needs once, before any rollout.

ALFWorld: the planner expert's plan for every game of a split that has none yet (the
``ref`` source's expert and the SFT data), checked by replay and appended to a plan file
one game at a time, so an interrupted run resumes where it stopped. The planner runs in
its own process per game, ``--workers`` at a time, killed after ``--timeout`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from serl_cli.artifacts import io
from serl_cli.cli.common import resolve, save_resolved, summary_table
from serl_cli.cli.root import ConfigOpt, QuietOpt, SetOpt, app, console
from serl_cli.config import setting
from serl_cli.errors import SerlError
from serl_cli.rollout.worlds import EnvConfig, build_world


@dataclass
class PrepareConfig:
    env: EnvConfig = setting(
        factory=lambda: EnvConfig(name="alfworld", split="train"), doc="the environment and the split to prepare"
    )
    workers: int = setting(1, "planner processes at once")
    timeout_s: float = setting(600.0, "per game; the slowest games of the shared data took ~9 minutes")
    games: int | None = setting(None, "only the first N games of the split's panel; null: all")
    out: str | None = setting(None, "the plan file; null: $SERL_CACHE_DIR/alfworld/expert_plans.jsonl")


data_app = typer.Typer(no_args_is_help=True, help="Data: prepare what an environment needs before rollouts.")
app.add_typer(data_app, name="data")


def prepare_alfworld(cfg: PrepareConfig, world, progress=None) -> dict:
    from envs.alfworld.plans import PLANS_FILE, cache_dir, default_plan_files, load_plans, prepare_plans

    if cfg.workers < 1:
        raise SerlError(f"--workers must be at least 1, got {cfg.workers}")
    if cfg.timeout_s <= 0:
        raise SerlError(f"--timeout must be positive, got {cfg.timeout_s}")
    games = world.games(cfg.env.split)
    if cfg.games is not None:
        if not 0 < cfg.games <= len(games):
            raise SerlError(
                f"--games {cfg.games} out of range: the alfworld {cfg.env.split} split has {len(games)} games"
            )
        games = games[: cfg.games]
    out = Path(cfg.out) if cfg.out else cache_dir() / PLANS_FILE
    known = {**world.plans, **load_plans([out])}
    result = prepare_plans(
        games,
        out,
        known=known,
        workers=cfg.workers,
        timeout_s=cfg.timeout_s,
        on_result=progress,
        append=io.append_jsonl,
    )
    have = load_plans([*default_plan_files(world.root, world.config.plans), out])
    return {
        "split": cfg.env.split,
        "games": len(games),
        "planned": result.planned,
        "failed": result.failed,
        "skipped": result.skipped,
        "with_plan": sum(g.rel in have for g in games),
        "out": str(out),
    }


PREPARERS = {"alfworld": prepare_alfworld}


@data_app.command("prepare")
def prepare(
    env: str | None = typer.Option(None, "--env", help="Environment: alfworld."),
    split: str | None = typer.Option(
        None, "--split", help="Split whose games to prepare (train, valid_seen, valid_unseen)."
    ),
    workers: int | None = typer.Option(None, "--workers", help="Planner processes at once."),
    timeout: float | None = typer.Option(None, "--timeout", help="Seconds per game before its planner is stopped."),
    games: int | None = typer.Option(None, "--games", help="Only the first N games of the split's panel."),
    out: str | None = typer.Option(None, "--out", help="Plan file to append to (default: the serl cache)."),
    config: list[str] | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    quiet: bool = QuietOpt,
):
    """Compute and cache expert plans (ALFWorld), resumable: games with a plan are skipped."""
    cfg = resolve(
        PrepareConfig,
        config_file=config,
        overrides=set_,
        flags={
            "env.name": env,
            "env.split": split,
            "workers": workers,
            "timeout_s": timeout,
            "games": games,
            "out": out,
        },
    )
    if cfg.env.name not in PREPARERS:
        raise SerlError(
            f"environment {cfg.env.name!r} needs no preparation: `serl data prepare` is for "
            f"{', '.join(sorted(PREPARERS))}"
        )
    world = build_world(cfg.env)

    def report(game, rec):
        if not quiet:
            what = f"{len(rec['plan'])} steps" if "plan" in rec else rec["error"]
            console.print(f"{game.rel}: {what} ({rec.get('planner_seconds', '-')} s)", highlight=False)

    summary = PREPARERS[cfg.env.name](cfg, world, progress=report)
    save_resolved(Path(summary["out"]).parent, "prepare_config.yaml", cfg)
    console.print(
        summary_table(
            f"{cfg.env.name} {cfg.env.split}: expert plans",
            [
                ("games", str(summary["games"])),
                ("planned now", str(summary["planned"])),
                ("failed now", str(summary["failed"])),
                ("skipped", str(summary["skipped"])),
                ("games with a plan", f"{summary['with_plan']} / {summary['games']}"),
                ("plan file", summary["out"]),
            ],
        )
    )
