"""Helpers the command modules share: config resolution and tables."""

from __future__ import annotations

import contextlib
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from serl_cli.api import require_run_to_resume as require_run_to_resume  # the commands import them from here too
from serl_cli.api import resolve_config
from serl_cli.api import save_resolved as save_resolved
from serl_cli.artifacts import io
from serl_cli.cli.root import err_console


def resolve(
    cls,
    *,
    config_file,
    overrides,
    flags: dict,
    base: dict | None = None,
    command: str | None = None,
    quiet: bool = False,
    reader=None,
    out_dir: bool = False,
):
    """``cls`` from defaults < ``base`` < ``--config`` files < flags < ``--set``
    (:func:`serl_cli.api.resolve_config`). With ``command`` (one of
    :data:`~serl_cli.api.READS_RUN_FILES`) a run file is read too, and the keys of it the command
    does not use are named in one note on stderr (not under ``-q``); ``reader``: a
    :class:`~serl_cli.online.run_file.RunFileReader` of the caller's (which keeps the run config).
    ``out_dir``: ``cfg.out`` is the folder the command writes, refused in one line where a file
    stands in its way."""
    cfg, note = resolve_config(
        cls, config_file=config_file, overrides=overrides, flags=flags, base=base, command=command, reader=reader
    )
    if note and not quiet:
        err_console.print(note, highlight=False, markup=False, soft_wrap=True)
    if out_dir and getattr(cfg, "out", None):
        io.check_output_dir(cfg.out)
    return cfg


LOG_EVERY_S = 30.0  # a progress line in a log file at most this often


class LogProgress:
    """A long step's progress where a rich bar draws nothing (output to a file, not a terminal):
    a plain line at most every ``LOG_EVERY_S`` seconds (``rollout: 120/256 episodes, 45 s``), and
    nothing on a terminal (the bar is there) or under ``-q``. ``advance()`` counts one item;
    ``update(done, total)`` sets the count."""

    clock = staticmethod(time.monotonic)

    def __init__(self, out, label: str, unit: str, *, total: int | None = None, quiet: bool = False):
        self.out, self.label, self.unit, self.total = out, label, unit, total
        self.on = not quiet and not out.is_terminal
        self.done = 0
        self.start = self.last = self.clock()

    def advance(self, n: int = 1) -> None:
        self.update(self.done + n)

    def update(self, done: int, total: int | None = None) -> None:
        self.done, self.total = done, total if total is not None else self.total
        if not self.on:
            return
        now = self.clock()
        if now - self.last < LOG_EVERY_S:
            return
        self.last = now
        of = f"/{self.total}" if self.total else ""
        eta = f", ETA {clock_text(remaining(now - self.start, done, self.total))}" if self.total and done else ""
        self.out.print(f"{self.label}: {done}{of} {self.unit}, {now - self.start:.0f} s{eta}", highlight=False)


def remaining(elapsed: float, done: int, total: int) -> float:
    """Seconds left at the pace so far: ``elapsed`` for ``done`` of ``total`` items."""
    return elapsed / done * (total - done) if done else float("nan")


def clock_text(seconds: float) -> str:
    """``42 s``, ``3:07``, ``1:02:09``: a duration as a person reads it on a progress line."""
    if seconds != seconds:  # not yet known
        return "?"
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole} s"
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Counted:
    """The callbacks a long step reports its progress through, to a bar and to :class:`LogProgress`:
    ``advance(item)`` counts one item (a rollout's episode), ``update(done, total)`` sets the count."""

    def __init__(self, bar: Progress, lines: LogProgress):
        self.bar, self.lines, self.task = bar, lines, bar.add_task(lines.unit, total=lines.total)

    def advance(self, item=None) -> None:
        self.bar.advance(self.task)
        self.lines.advance()

    def update(self, done: int, total: int) -> None:
        self.bar.update(self.task, completed=done, total=total)
        self.lines.update(done, total)


@contextlib.contextmanager
def progress_bar(out, label: str, unit: str, *, quiet: bool, total: int | None = None, terminal_only: bool = False):
    """A bar with an ETA over a long step (``label``: what it does, ``unit``: what it counts) and, in a
    log file, a line every ``LOG_EVERY_S``; nothing under ``-q``. ``terminal_only``: no bar where
    ``out`` is not a terminal, and the unit named beside the count. Yields a :class:`Counted`."""
    columns = [TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn()]
    columns += [TextColumn(unit)] if terminal_only else []
    disable = quiet or (terminal_only and not out.is_terminal)
    with Progress(
        *columns, TimeElapsedColumn(), TimeRemainingColumn(), console=out, disable=disable, transient=True
    ) as bar:
        yield Counted(bar, LogProgress(out, label, unit, total=total, quiet=quiet))


def plural(n: int, word: str) -> str:
    """``1 round``, ``2 rounds``: a count and its noun, agreeing."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def summary_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in rows:
        table.add_row(k, v)
    return table


def eval_rows(s: dict) -> list[tuple[str, str]]:
    lo, hi = s["success_ci95"]
    rows = [
        ("episodes", str(s["episodes"])),
        ("success rate", f"{s['success_rate']:.3f}  [{lo:.3f}, {hi:.3f}]"),
        ("score (0-100)", f"{s['score']:.1f}"),
        ("invalid-action rate", f"{s['invalid_action_rate']:.3f}"),
        ("mean turns", f"{s['mean_turns']:.2f}"),
    ]
    for group, sub in s.get("by_task_type", {}).items():
        rows.append((f"  success: {group}", f"{sub['success_rate']:.3f} (n={sub['episodes']})"))
    return rows
