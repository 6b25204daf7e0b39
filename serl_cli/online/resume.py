"""Resuming an online run: the stored settings held to the ones it runs with now, bar what
:data:`~serl_cli.stages.resume_settings.RESUMABLE_CHANGES` lets a resume change, and each resume
recorded in the manifest (``stages.online.resumed``)."""

from __future__ import annotations

import time
from pathlib import Path

from serl_cli import config as cfgmod
from serl_cli.artifacts import io
from serl_cli.errors import SerlError
from serl_cli.online.config import OnlineConfig
from serl_cli.online.run_file import run_settings
from serl_cli.stages.resume_settings import changed_settings, without_changeable


def check_online_resume(run: str | Path, stored: dict | None, now: dict, finished: int) -> dict:
    """Refuse to resume the online run in ``run`` with settings other than ``stored`` (its
    manifest's), bar :data:`~serl_cli.stages.resume_settings.RESUMABLE_CHANGES`; returns the
    resumable changes. ``finished``: how many iterations the run has finished (``--iterations``
    may not go below them)."""
    if stored is None:  # a manifest from before the settings were recorded: nothing to hold it to
        return {}
    stored = with_defaults(stored)
    found = io.differences(without_changeable(stored), without_changeable(now))
    if found:
        raise SerlError(
            f"cannot resume {run} with other settings ({io.differences_text(found)}): a run directory holds "
            f"one run; `serl train --out {run} --resume` alone continues it with its own settings; pass a new --out "
            "to start another, or --overwrite to start this one again"
        )
    if now["iterations"] < finished:
        raise SerlError(
            f"cannot resume {run} with --iterations {now['iterations']}: it has finished {finished} "
            f"iterations; pass at least {finished}, or a new --out to start another run"
        )
    return changed_settings(stored, now)


def stored_settings(run: str | Path) -> dict | None:
    """The settings the online run in ``run`` was made with (its manifest's, as in ``online.yaml``, at
    this version's defaults where it lacks a newer setting): what ``serl train --out RUN --resume``
    runs with. None where ``run`` holds no online run."""
    from pathlib import Path

    if not (Path(run) / "manifest.json").is_file():
        return None
    stored = io.read_json(Path(run) / "manifest.json").get("stages", {}).get("online", {}).get("config")
    return with_defaults(stored) if isinstance(stored, dict) else None


def with_defaults(stored: dict) -> dict:
    """``stored`` with the settings this version of serl has and the run's own serl did not, at
    their defaults (a new setting's default computes what the run computed): a run resumes after
    an upgrade. Settings this version does not know are kept, and so differ."""
    try:
        return run_settings(cfgmod.from_dict(OnlineConfig, io.json_copy(stored), "the stored run settings"))
    except SerlError:
        return stored


def record_resume(run: Path, now: dict, start: int, changed: dict) -> None:
    """The manifest's online stage: running again, with the settings it now runs with and,
    in ``resumed``, each resume (where it started, what it changed)."""
    path = run / "manifest.json"
    manifest = io.read_json(path)
    entry = manifest.setdefault("stages", {}).setdefault("online", {})
    entry.pop("finished", None)
    entry.update(status="running", config=now)
    entry.setdefault("resumed", []).append({"at_iteration": start, "time": time.time(), "changed": changed})
    io.write_json(path, manifest)
