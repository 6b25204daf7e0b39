"""Helpers the command modules share: config resolution and tables."""

from __future__ import annotations

import dataclasses
import inspect
import time
from pathlib import Path

from rich.table import Table

from serl_cli import config as cfgmod
from serl_cli.artifacts import io
from serl_cli.cli.root import err_console
from serl_cli.errors import SerlError


def show_defaults(cls, **flag_keys: str):
    """Decorate a command so ``--help`` shows each flag's documentation and effective default,
    read from the settings dataclass ``cls`` at the flag's key path (the flags themselves
    default to None, so that a config file can set them); a flag's own ``help`` wins."""
    defaults = dataclasses.asdict(cls())

    def value_at(path: str):
        node = defaults
        for part in path.split("."):
            node = node[part]
        return node

    def wrap(fn):
        params = inspect.signature(fn).parameters
        for name, path in flag_keys.items():
            info = params[name].default
            value = value_at(path)
            info.show_default = False if value is None else str(value)  # null: the doc says what it means
            doc = cfgmod.doc_of(cls, path)
            info.help = info.help or (f"{doc}." if doc else None)
        return fn

    return wrap


# The commands that also take a run file (the online loop's layout: `serl train --config`'s) as
# --config, and run its step as the loop does (stages.run_file, stages.derive).
READS_RUN_FILES = ("rollout", "eval", "annotate")


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
    """``cls`` from defaults < ``base`` < ``--config`` files < flags < ``--set``. With ``command``
    (one of :data:`READS_RUN_FILES`) a run file is read too, and the keys of it the command does
    not use are named in one note on stderr (not under ``-q``); ``reader``: a
    :class:`~serl_cli.stages.run_file.RunFileReader` of the caller's (which keeps the run config).
    ``out_dir``: ``cfg.out`` is the folder the command writes, refused in one line where a file
    stands in its way."""
    # the run file's layout is read from --config files and from --set alike: the same full dotted
    # path (rollout.prompt.bare_replies) works with or without a run file given
    if reader is None and command in READS_RUN_FILES:
        from serl_cli.stages.run_file import RunFileReader

        reader = RunFileReader(command, cls)
    cfg = cfgmod.resolve(
        cls, config_file=config_file, flags=flags, overrides=list(overrides or []), base=base, reader=reader
    )
    note = reader.note() if reader is not None else None
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
        self.out.print(f"{self.label}: {done}{of} {self.unit}, {now - self.start:.0f} s", highlight=False)


def plural(n: int, word: str) -> str:
    """``1 round``, ``2 rounds``: a count and its noun, agreeing."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def save_resolved(out_dir: str | Path, name: str, cfg) -> None:
    """The resolved configuration (a settings dataclass, or its plain form), next to the artifacts it produced."""
    import yaml

    plain = cfg if isinstance(cfg, dict) else dataclasses.asdict(cfg)
    io.atomic_write_text(Path(out_dir) / name, yaml.safe_dump(plain, sort_keys=False))


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


def require_run_to_resume(out: str | Path, what: str) -> None:
    """``--resume`` continues a run that is there: a misspelt ``--out`` is refused in one line
    instead of silently starting a fresh run somewhere else."""
    if not (Path(out) / "manifest.json").is_file():
        where = "does not exist" if not Path(out).exists() else "holds no serl run (no manifest.json)"
        raise SerlError(
            f"--resume: {out} {where}, so there is no {what} to continue: "
            "check --out, or leave out --resume to start one"
        )
