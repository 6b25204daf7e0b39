"""The run file (``RUN/online.yaml``, ``experiments/*/*.yaml``): the online loop's configuration
with each setting once, and how ``serl rollout``, ``serl eval`` and ``serl annotate`` read it when
given one as ``--config``: as the loop's step (``online.derive``). The loop itself is
:mod:`serl_cli.online.loop`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from serl_cli import config as cfgmod
from serl_cli.artifacts import io
from serl_cli.errors import SerlError
from serl_cli.online.config import OnlineConfig
from serl_cli.online.derive import LOOP_SETS, READS, annotate_config, eval_config, rollout_config
from serl_cli.stages.evaluate import EvalConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def run_settings(cfg: OnlineConfig) -> dict:
    """The run's configuration as written to ``RUN/online.yaml`` and the manifest: every setting
    once, without the per-stage copies the run sets itself (``online.derive.LOOP_SETS``). Loaded
    again it gives the same run (``from_dict(OnlineConfig, run_settings(cfg))``)."""
    plain = io.to_plain(cfg)
    for section, keys in LOOP_SETS.items():
        for key in keys:
            plain[section].pop(key)
    return plain


def stage_settings(command: str, run: OnlineConfig) -> dict:
    """What ``serl COMMAND --config RUN_FILE`` runs with (before its own flags): the stage's
    config as the loop derives it (``online.derive``), the command's own defaults where the loop
    has none (its output directory; the rollouts' seed is the run's)."""
    if command == "rollout":
        return io.to_plain(rollout_config(run))
    if command == "annotate":
        return io.to_plain(annotate_config(run))
    plain = io.to_plain(eval_config(run, EvalConfig().out, run.model))
    if run.model is None:  # a run on the embedded default model: the command's --policy (expert unless given)
        plain.pop("policy")
    return plain


class RunFileReader:
    """Reads the run-file layout (an ``OnlineConfig``: files, flags or ``--set`` keys) for one
    stage's command: a config resolver's ``reader`` (``config.resolve``). What it claims merges
    over ``base`` into one run config, checked as a whole (an unknown key fails with the closest
    known one), and becomes the stage's settings by :func:`stage_settings`; :attr:`run` keeps it.
    ``ignored``: the top-level keys of ``--set`` in the run layout that the command does not read,
    for :meth:`note` (the sections of a file it does not read are expected, and not named)."""

    def __init__(self, command: str, cls: type[DataclassInstance], base: dict | None = None):
        self.command, self.base = command, base or {}
        own = {f.name for f in dataclasses.fields(cls)}
        run = {f.name for f in dataclasses.fields(OnlineConfig)}
        self.run_only, self.own_only = run - own, own - run
        self.ignored: list[str] = []
        self.run: OnlineConfig | None = None

    def claims(self, data: dict) -> bool:
        """The run layout: a key only a run config has (a section, iterations...)."""
        return any(key in self.run_only for key in data)

    def check(self, data: dict, where: str) -> None:
        mixed = [key for key in data if key in self.own_only]
        if mixed:
            theirs = ", ".join(key for key in data if key in self.run_only)
            raise SerlError(
                f"{where} mixes the online loop's layout ({theirs}) with serl {self.command}'s own "
                f"({', '.join(mixed)}): use one layout per file"
            )
        if where != "--set":
            return  # a run file always holds the loop's other sections: taking one step of it is the point
        reads = READS[self.command]
        self.ignored += [key for key in data if key not in reads and key not in self.ignored]

    def read(self, data: dict) -> dict:
        if not data and not self.base:  # no run config given: the command's own defaults
            return {}
        self.run = cfgmod.from_dict(OnlineConfig, cfgmod.merge(self.base, data))
        return stage_settings(self.command, self.run)

    def note(self) -> str | None:
        if not self.ignored:
            return None
        return f"note: ignoring --set {', '.join(self.ignored)} of the run config (not used by serl {self.command})"
