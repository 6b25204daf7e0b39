"""``serl train``: one update on a run's rollouts, or the online loop with ``--iterations``."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from serl_cli import api
from serl_cli.artifacts.tracking import Tracker, check_backends
from serl_cli.cli.common import clock_text, plural, progress_bar, remaining, summary_table
from serl_cli.cli.flags import GIVEN_BY_FLAGS, Given, settings_command
from serl_cli.cli.root import app, console, err_console, overwrite_option, refuse_resume_with_overwrite, resumable_at
from serl_cli.errors import PREEMPTED_EXIT, SerlError
from serl_cli.online.config import OnlineConfig, check_online_config
from serl_cli.online.derive import READS, train_config
from serl_cli.online.resume import stored_settings
from serl_cli.online.run_file import run_settings
from serl_cli.training.train_config import check_train_config


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


@app.command("train")
@settings_command("train", OnlineConfig)
def train_command(
    run: str | None = typer.Argument(
        None, help="A run directory with rollouts (one update). Omit for the online loop."
    ),
    given: Given = GIVEN_BY_FLAGS,
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Online loop: continue after the last finished iteration; "
        "one update: skip it if it finished, else run it again.",
    ),
    overwrite: bool = overwrite_option("an existing checkpoint or run"),
    no_plan_check: bool = typer.Option(
        False, "--no-plan-check", help="Start even where `serl plan` finds the layout does not fit this machine."
    ),
    report_to: list[str] | None = typer.Option(
        None,
        "--report-to",
        help="Also log metrics to: none | tensorboard "
        "(RUN/tensorboard/) | wandb (honours WANDB_MODE=offline); repeatable.",
    ),
):
    """Update a policy: --algo on RUN's rollouts, or the online loop (rollout -> update, K times)."""
    from serl_cli.online.stop import catch_early

    with catch_early():  # a job's SIGTERM from here on ends in a checkpoint and exit 75
        train(run, given, resume=resume, overwrite=overwrite, plan_check=not no_plan_check, report_to=report_to)


def train(run: str | None, given: Given, *, resume: bool, overwrite: bool, plan_check: bool, report_to) -> None:
    """The train command's work once its flags are parsed."""
    online = given.flags["iterations"] is not None or run is None
    out = given.flags["out"]  # one update: where its checkpoint goes
    given.flags["out"] = out or (run if online else None)
    refuse_resume_with_overwrite(resume, overwrite)
    # `serl train --out RUN --resume` continues RUN with its own settings: what is given besides must agree
    base = stored_settings(given.flags["out"]) if resume and online and given.flags["out"] else None
    cfg = given.resolve(out_dir=True, base=base)
    # every setting is checked before torch loads (a typo costs no start-up) and before anything is
    # written: here, and again by the API (serl_cli.api) the command runs
    if online:
        check_online_config(cfg)  # first: it fills in what the run derives (a schedule's total_steps)
    train = train_config(cfg)
    if not online:
        check_train_config(train)
    if train.optim.lr == 0:  # allowed to the Python API (a measurement that must not move the weights)
        raise SerlError(
            "train.optim.lr is 0: every update would leave the policy as it is; set a positive learning rate"
        )
    from serl_cli.training.backends import is_main_process

    main = is_main_process()  # under torchrun / the deepspeed launcher: rank 0 keeps the books
    how = {"overwrite": overwrite, "resume": resume, "plan_check": plan_check}
    trackers = check_backends(report_to) if main else []
    if online:
        online_loop(cfg, how, trackers, main=main, quiet=given.quiet)
        return
    train.model = train.model or given.flags["model"]
    train.checkpoint = out or train.checkpoint
    if main and not given.quiet:
        note = single_update_note(given.config, given.overrides)
        if note:
            err_console.print(note, highlight=False, markup=False, soft_wrap=True)
    assert run is not None  # not the online loop, so a run was given
    one_update(run, train, how, trackers, main=main, quiet=given.quiet)


def one_update(run: str, train, how: dict, trackers: list, *, main: bool, quiet: bool) -> None:
    """An update on RUN's rollouts (``how``: overwrite, resume, plan_check), with a progress bar, its
    metrics logged to ``trackers`` and shown in a table; a process other than the main one does
    its part only."""
    from serl_cli.online.plan import run_model
    from serl_cli.stages.train import books_dir

    resumable_at(run)  # what Ctrl-C says
    if not main:  # its part of the update; the main process keeps the books and reports
        api.train(run, train, **how)
        return
    with update_bar(console, quiet) as progress:
        done = api.train(run, train, progress=progress, **how)
    m = done.summary
    train.model = train.model or run_model(run)  # the hyperparameters name the model it updated
    tracker = Tracker(trackers, books_dir(run, train), Path(run).name, dataclasses.asdict(train))
    tracker.log(m, step=m.get("update", 1))
    tracker.close()
    console.print(summary_table(f"train {train.algo}: {run}", [(k, _fmt(v)) for k, v in m.items() if k != "timing"]))
    warn_if_no_gradient(m)


def online_loop(cfg: OnlineConfig, how: dict, trackers: list, *, main: bool, quiet: bool) -> None:
    """The online loop into ``cfg.out`` (``how``: overwrite, resume, plan_check): the main process logs
    each iteration's metrics to ``trackers``, shows them as :class:`IterationsShown` does and the
    last in a table. A preempted loop exits with ``PREEMPTED_EXIT``."""
    from serl_cli.online.stop import Preempted

    shown = IterationsShown(cfg.iterations, quiet)
    resumable_at(cfg.out)  # what Ctrl-C says
    try:
        if not main:  # its part of the loop; the main process keeps the books and reports
            api.train_online(cfg, **how)
            return
        tracker = Tracker(trackers, cfg.out, Path(cfg.out).name, run_settings(cfg))
        if not quiet:
            console.print(settings_block(cfg, resume=how["resume"]), highlight=False, soft_wrap=True)
        try:
            with shown.live or contextlib.nullcontext():
                history = api.train_online(cfg, on_iteration=shown.logged_to(tracker), **how)
        finally:
            tracker.close()
    except Preempted as e:  # SIGTERM/SIGUSR1: checkpointed; the same command with --resume continues
        if main:
            err_console.print(f"[yellow]preempted:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(PREEMPTED_EXIT) from None
    if shown.empty:
        err_console.print(
            f"[yellow]warning:[/] {plural(len(shown.empty), 'update')} of {len(history)} had no gradient (every "
            f"group's rewards were equal): iteration {', '.join(map(str, shown.empty))}",
            highlight=False,
            soft_wrap=True,
        )
    if history:
        elapsed = clock_text(shown.clock() - shown.start)
        rows = final_rows(history, cfg.iterations, shown.env_steps, elapsed)
        console.print(summary_table(f"online {cfg.train.algo}: {cfg.out}", rows))
    console.print(f"final policy: {cfg.out}/checkpoint")


class IterationsShown:
    """How the online loop shows each iteration's metrics: a live table of the last ``LIVE_ROWS`` on a
    terminal, a line each in a log file, and under ``-q`` nothing but the iterations whose update
    changed nothing (``empty``: one warning for all of them at the end). Each says the time since the
    command started and the time left at the pace of the iterations this process ran (a resumed run's
    earlier ones ran elsewhere)."""

    clock = staticmethod(time.monotonic)

    def __init__(self, total: int, quiet: bool):
        self.total, self.quiet = total, quiet
        self.live = Live(console=console, auto_refresh=False) if console.is_terminal and not quiet else None
        self.recent: list[dict] = []
        self.empty: list[int] = []
        self.start, self.ran = self.clock(), 0
        self.env_steps = 0  # over the iterations shown here

    def logged_to(self, tracker: Tracker):
        """The loop's ``on_iteration``: log to ``tracker``, then show."""

        def on_iteration(m: dict) -> None:
            tracker.log(m, step=m["iteration"])
            self.show(m)

        return on_iteration

    def pace(self, iteration: int) -> str:
        """``1:23 elapsed, ETA 4:56`` after ``iteration`` (0-based) finished."""
        self.ran += 1
        elapsed = self.clock() - self.start
        left = remaining(elapsed, self.ran, self.ran + self.total - iteration - 1)
        return f"{clock_text(elapsed)} elapsed, ETA {clock_text(left)}"

    def show(self, m: dict) -> None:
        self.env_steps += m.get("env_steps", 0)
        pace = self.pace(m["iteration"])
        if self.quiet:
            self.empty.extend([m["iteration"]] if m.get("optimizer_steps") == 0 else [])
            return
        warn_if_no_gradient(m)
        if self.live is None:  # a log file: one line per iteration
            extra = f"  eval success {m['eval_success_rate']:.3f}" if "eval_success_rate" in m else ""
            lr = f"  lr {m['lr']:.3g}" if "lr" in m else ""
            console.print(
                f"iteration {m['iteration'] + 1}/{self.total}: reward {m['mean_reward']:.3f}  "
                f"success {m['success_rate']:.3f}  loss {m.get('loss', float('nan')):.4f}  "
                f"|A| {m.get('mean_abs_advantage', 0):.3f}{lr}{extra}  ({pace})",
                highlight=False,
                soft_wrap=True,  # one line in a log, however narrow the terminal it thinks it has
            )
            return
        self.recent.append(m)
        self.live.update(iterations_table(self.recent[-LIVE_ROWS:], self.total, pace), refresh=True)


@contextlib.contextmanager
def update_bar(out: Console, quiet: bool):
    """A progress bar over an update's micro-batches, with an ETA, on a terminal (nothing under
    ``-q``; in a log a line every ``LOG_EVERY_S``); yields the ``progress(done, total)`` callback for
    ``Learner.update``."""
    with progress_bar(out, "update", "micro-batches", quiet=quiet, terminal_only=True) as bar:
        yield bar.update


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
    ("lr", "lr"),
    ("eval", "eval_success_rate"),
]


def iterations_table(rows: list[dict], total: int, pace: str = "") -> Table:
    """The last iterations of the online loop, for a live display on a terminal (iterations counted
    from 1, as the title counts them)."""
    title = f"online loop: iteration {rows[-1]['iteration'] + 1} of {total}" + (f" ({pace})" if pace else "")
    table = Table(title=title, header_style="bold")
    table.add_column("iteration", justify="right")
    shown = [(name, key) for name, key in LIVE_COLUMNS if any(key in r for r in rows)]
    for name, _ in shown:
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(str(r["iteration"] + 1), *(_fmt(r[key]) if key in r else "" for _, key in shown))
    return table


def settings_block(cfg: OnlineConfig, *, resume: bool) -> str:
    """The settings a run starts with, in a few lines, as TRL and verl print theirs: what a reader of a
    log checks first. Every setting is in RUN/online.yaml; `serl config show train` prints them too."""
    r, t, o = cfg.rollout, cfg.train, cfg.train.optim
    schedule = o.schedule + (f" to step {o.total_steps}" if o.schedule != "constant" else "")
    warmup = f", warmup {o.warmup_steps}" if o.warmup_steps else ""
    lines = [
        f"{'resuming' if resume else 'run'}: {cfg.out}  ({cfg.iterations} iterations, seed {cfg.seed})",
        f"  model {cfg.model or 'the embedded default'}  env {cfg.env.name} {cfg.env.split}"
        + (f", max {cfg.env.max_turns} turns" if cfg.env.max_turns else ""),
        f"  algo {t.algo}  lr {o.lr:g} ({schedule}{warmup})  batch {r.tasks} tasks x {r.group_size}  "
        f"epochs {t.epochs} x {t.mini_batch_turns or t.mini_batches} "
        f"{'turns per step' if t.mini_batch_turns else 'steps'}  backend {t.backend}",
        f"  rollout {r.engine}, T {r.sampling.temperature:g}, {r.sampling.max_new_tokens} new tokens  "
        f"max_staleness {cfg.max_staleness}  eval "
        + (f"{cfg.eval.episodes} episodes every {cfg.eval.every}" if cfg.eval.episodes else "none"),
    ]
    if t.algo in ("serl", "rlsd", "sdpo"):
        a = cfg.annotate
        lines.append(
            f"  annotate {a.sources} ({a.granularity}, placement {a.placement})  clip {a.weight_clip:g}  "
            f"lambda {a.mixing_lambda:g} over {a.lambda_decay_steps} updates  teacher sync {a.teacher_sync_interval}"
        )
    lines.append(f"  every setting: {cfg.out}/online.yaml")
    return "\n".join(lines)


def final_rows(history: Sequence[Mapping], total: int, env_steps: int, elapsed: str) -> list[tuple[str, str]]:
    """The run's closing table: where it stands (iterations of the run, updates, environment steps
    over the iterations run here, the time), then the last iteration's figures."""
    last = history[-1]
    head = [
        ("iterations", f"{last['iteration'] + 1} of {total}"),
        ("updates", str(last.get("update", ""))),
        ("environment steps (this run)", str(env_steps)),
        ("wall time", elapsed),
    ]
    skip = {"iteration", "update", "env_steps"}
    return [
        *head,
        (f"-- iteration {last['iteration'] + 1} --", ""),
        *((k, _fmt(v)) for k, v in last.items() if k not in skip),
    ]


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
