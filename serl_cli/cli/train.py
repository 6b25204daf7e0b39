"""``serl train``: one update on a run's rollouts, or the online loop with ``--iterations``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path

import typer
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from serl_cli import api
from serl_cli.artifacts.tracking import Tracker, check_backends
from serl_cli.cli.common import LogProgress, plural, resolve, show_defaults, summary_table
from serl_cli.cli.root import ConfigOpt, QuietOpt, SeedOpt, SetOpt, VerboseOpt, app, console, err_console, resumable_at
from serl_cli.errors import PREEMPTED_EXIT
from serl_cli.stages.derive import READS, train_config
from serl_cli.stages.online_config import OnlineConfig, check_online_config
from serl_cli.stages.run_file import run_settings
from serl_cli.training.train_config import check_train_config


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


@app.command("train")
@show_defaults(
    OnlineConfig,
    algo="train.algo",
    model="model",
    backend="train.backend",
    deepspeed_config="train.deepspeed.config",
    zero_stage="train.deepspeed.zero_stage",
    offload="train.deepspeed.offload",
    lora_rank="train.lora.rank",
    lora_alpha="train.lora.alpha",
    lora_targets="train.lora.targets",
    lora_save="train.lora.save",
    device="train.device",
    dtype="train.dtype",
    gradient_checkpointing="train.gradient_checkpointing",
    iterations="iterations",
    engine="rollout.engine",
    env="env.name",
    tasks="rollout.tasks",
    group_size="rollout.group_size",
    max_turns="env.max_turns",
    threads="train.threads",
    out="out",
)
def train_command(
    run: str | None = typer.Argument(
        None, help="A run directory with rollouts (one update). Omit for the online loop."
    ),
    algo: str | None = typer.Option(None, "--algo"),
    model: str | None = typer.Option(None, "--model"),
    backend: str | None = typer.Option(None, "--backend"),
    deepspeed_config: str | None = typer.Option(None, "--deepspeed-config"),
    zero_stage: int | None = typer.Option(None, "--zero-stage"),
    offload: bool | None = typer.Option(None, "--offload/--no-offload"),
    lora_rank: int | None = typer.Option(None, "--lora-rank"),
    lora_alpha: float | None = typer.Option(None, "--lora-alpha"),
    lora_targets: str | None = typer.Option(None, "--lora-targets"),
    lora_save: str | None = typer.Option(None, "--lora-save"),
    device: str | None = typer.Option(None, "--device"),
    dtype: str | None = typer.Option(None, "--dtype"),
    gradient_checkpointing: bool | None = typer.Option(None, "--gradient-checkpointing/--no-gradient-checkpointing"),
    iterations: int | None = typer.Option(None, "--iterations", help="Online loop: K x (rollout -> update)."),
    engine: str | None = typer.Option(None, "--engine", help="Online loop: generation engine, hf | vllm."),
    env: str | None = typer.Option(None, "--env", help="Environment for the online loop."),
    tasks: int | None = typer.Option(None, "--tasks", help="Online loop: tasks per iteration."),
    group_size: int | None = typer.Option(None, "--group-size", help="Online loop: rollouts per task."),
    max_turns: int | None = typer.Option(None, "--max-turns", help="Online loop: turn limit."),
    threads: int | None = typer.Option(
        None, "--threads", help="Torch threads (default: the CPUs this process may use / ranks on the node)."
    ),
    out: str | None = typer.Option(
        None,
        "--out",
        help="Online loop: the run directory. One update: where its checkpoint goes (default RUN/checkpoint; "
        "elsewhere, RUN is only read).",
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Online loop: continue after the last finished iteration; "
        "one update: skip it if it finished, else run it again.",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing checkpoint or run."),
    no_plan_check: bool = typer.Option(
        False, "--no-plan-check", help="Start even where `serl plan` finds the layout does not fit this machine."
    ),
    report_to: list[str] | None = typer.Option(
        None,
        "--report-to",
        help="Also log metrics to: none | tensorboard "
        "(RUN/tensorboard/) | wandb (honours WANDB_MODE=offline); repeatable.",
    ),
    config: list[str] | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    seed: int | None = SeedOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
):
    """Update a policy: --algo on RUN's rollouts, or the online loop (rollout -> update, K times)."""
    online = iterations is not None or run is None
    cfg = resolve(
        OnlineConfig,
        config_file=config,
        overrides=set_,
        out_dir=True,
        flags={
            "train.algo": algo,
            "model": model,
            "train.backend": backend,
            "iterations": iterations,
            "env.name": env,
            "rollout.engine": engine,
            "rollout.tasks": tasks,
            "rollout.group_size": group_size,
            "env.max_turns": max_turns,
            "train.threads": threads,
            "out": out or (run if online else None),
            "seed": seed,
            "train.deepspeed.config": deepspeed_config,
            "train.deepspeed.zero_stage": zero_stage,
            "train.deepspeed.offload": offload,
            "train.lora.rank": lora_rank,
            "train.lora.alpha": lora_alpha,
            "train.lora.targets": lora_targets,
            "train.lora.save": lora_save,
            "train.device": device,
            "train.dtype": dtype,
            "train.gradient_checkpointing": gradient_checkpointing,
        },
    )
    # every setting is checked before torch loads (a typo costs no start-up) and before anything is
    # written: here, and again by the API (serl_cli.api) the command runs
    train = train_config(cfg)
    if online:
        check_online_config(cfg)
    else:
        check_train_config(train)
    from serl_cli.stages.online_stop import Preempted
    from serl_cli.stages.plan import run_model
    from serl_cli.stages.train import books_dir
    from serl_cli.training.backends import is_main_process

    main = is_main_process()  # under torchrun / the deepspeed launcher: rank 0 keeps the books
    trackers = check_backends(report_to) if main else []
    if not online:
        train.model = train.model or model
        train.checkpoint = out or train.checkpoint
        if main and not quiet:
            note = single_update_note(config, set_)
            if note:
                err_console.print(note, highlight=False, markup=False, soft_wrap=True)
        resumable_at(run)  # what Ctrl-C says
        plan_check = not no_plan_check
        if not main:  # its part of the update; the main process keeps the books and reports
            api.train(run, train, overwrite=overwrite, resume=resume, plan_check=plan_check)
            return
        with update_bar(console, quiet) as progress:
            done = api.train(run, train, overwrite=overwrite, resume=resume, progress=progress, plan_check=plan_check)
        m = done.summary
        train.model = train.model or run_model(run)  # the hyperparameters name the model it updated
        tracker = Tracker(trackers, books_dir(run, train), Path(run).name, dataclasses.asdict(train))
        tracker.log(m, step=m.get("update", 1))
        tracker.close()
        console.print(
            summary_table(f"train {train.algo}: {run}", [(k, _fmt(v)) for k, v in m.items() if k != "timing"])
        )
        warn_if_no_gradient(m)
        return

    recent: list[dict] = []
    live = Live(console=console, auto_refresh=False) if console.is_terminal and not quiet else None

    empty: list[int] = []  # iterations whose update changed nothing: one line for all of them under -q

    def show(m: dict) -> None:
        tracker.log(m, step=m["iteration"])
        if quiet:
            empty.extend([m["iteration"]] if m.get("optimizer_steps") == 0 else [])
            return
        warn_if_no_gradient(m)
        if live is None:  # a log file: one line per iteration
            extra = f"  eval success {m['eval_success_rate']:.3f}" if "eval_success_rate" in m else ""
            console.print(
                f"iteration {m['iteration']}: reward {m['mean_reward']:.3f}  success {m['success_rate']:.3f}  "
                f"loss {m.get('loss', float('nan')):.4f}  |A| {m.get('mean_abs_advantage', 0):.3f}{extra}",
                highlight=False,
            )
            return
        recent.append(m)
        live.update(iterations_table(recent[-LIVE_ROWS:], cfg.iterations), refresh=True)

    resumable_at(cfg.out)  # what Ctrl-C says
    online_run = functools.partial(
        api.train_online, cfg, resume=resume, overwrite=overwrite, plan_check=not no_plan_check
    )
    if not main:
        try:
            online_run()
        except Preempted:
            raise typer.Exit(PREEMPTED_EXIT) from None
        return
    tracker = Tracker(trackers, cfg.out, Path(cfg.out).name, run_settings(cfg))
    try:
        with live or contextlib.nullcontext():
            history = online_run(on_iteration=show)
    except Preempted as e:  # SIGTERM/SIGUSR1: checkpointed; the same command with --resume continues
        err_console.print(f"[yellow]preempted:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(PREEMPTED_EXIT) from None
    finally:
        tracker.close()
    if empty:
        err_console.print(
            f"[yellow]warning:[/] {plural(len(empty), 'update')} of {len(history)} had no gradient (every group's "
            f"rewards were equal): iteration {', '.join(map(str, empty))}",
            highlight=False,
            soft_wrap=True,
        )
    if history:
        last = history[-1]
        console.print(summary_table(f"online {cfg.train.algo}: {cfg.out}", [(k, _fmt(v)) for k, v in last.items()]))
    console.print(f"final policy: {cfg.out}/checkpoint")


@contextlib.contextmanager
def update_bar(out: Console, quiet: bool):
    """A progress bar over an update's micro-batches, with an ETA, on a terminal (nothing under
    ``-q``; in a log a line every ``LOG_EVERY_S``); yields the ``progress(done, total)`` callback for
    ``Learner.update``."""
    with Progress(
        TextColumn("[bold]update"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("micro-batches"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=out,
        disable=quiet or not out.is_terminal,
        transient=True,
    ) as bar:
        task = bar.add_task("micro-batches", total=None)
        lines = LogProgress(out, "update", "micro-batches", quiet=quiet)  # SFT's minutes, in a log file

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)
            lines.update(done, total)

        yield progress


def warn_if_no_gradient(m: dict) -> None:
    """An update that changed nothing deserves a line: its metrics say so (optimizer_steps 0)."""
    if m.get("optimizer_steps") == 0:
        it = f"iteration {m['iteration']}: " if "iteration" in m else ""
        err_console.print(
            f"[yellow]warning:[/] {it}no turn had a gradient (every group's rewards were equal): "
            f"the update changed nothing",
            highlight=False,
            soft_wrap=True,  # one line in a log, however narrow the terminal it thinks it has
        )


LIVE_ROWS = 8
LIVE_COLUMNS = [
    ("reward", "mean_reward"),
    ("success", "success_rate"),
    ("loss", "loss"),
    ("|A|", "mean_abs_advantage"),
    ("grad turns", "turns_with_gradient"),
    ("weight mean", "weight_mean"),
    ("eval", "eval_success_rate"),
]


def iterations_table(rows: list[dict], total: int) -> Table:
    """The last iterations of the online loop, for a live display on a terminal."""
    table = Table(title=f"online loop: iteration {rows[-1]['iteration'] + 1} of {total}", header_style="bold")
    table.add_column("iteration", justify="right")
    shown = [(name, key) for name, key in LIVE_COLUMNS if any(key in r for r in rows)]
    for name, _ in shown:
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(str(r["iteration"]), *(_fmt(r[key]) if key in r else "" for _, key in shown))
    return table


def single_update_note(config_files, overrides) -> str | None:
    """One line naming the top-level keys of the --config files and --set keys that a single update
    does not use (the rollouts already exist: env, rollout, annotate, eval, iterations ...)."""
    from serl_cli import config as cfgmod

    keys: list[str] = []
    for path in config_files or []:
        keys += [k for k in cfgmod.load_yaml(path) if k not in keys]
    keys += [k for k in (text.split("=", 1)[0].split(".", 1)[0] for text in overrides or []) if k not in keys]
    ignored = [k for k in keys if k not in READS["train"]]
    if not ignored:
        return None
    return (
        f"note: ignoring {', '.join(ignored)} of the run config (a single update reads train and seed; "
        f"the rollouts already exist)"
    )
