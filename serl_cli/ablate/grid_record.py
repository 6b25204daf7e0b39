"""``OUT/grid.json``: the resolved grid as a record, written once and checked by every later entry point.

Apart from the grid file's parser (:mod:`serl_cli.ablate.grid`, whose docstring has the
layout): the cells, the report and ``--reuse`` read an ablation directory through this record
alone, never through the grid file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from serl_cli import config as cfgmod
from serl_cli.ablate.grid import Grid, arms, cells
from serl_cli.artifacts import io
from serl_cli.errors import SerlError

GRID_VERSION = 1


def grid_record(grid: Grid, source_args: list[str]) -> dict:
    return {
        "kind": "serl-ablation",
        "version": GRID_VERSION,
        "source_args": list(source_args),
        "description": grid.description,
        "axes": grid.axes,
        "final_eval": grid.final_eval,
        "slurm": grid.slurm,
        "base": grid.base,
        "arms": arms(grid),
        "baseline": grid.baseline,
        "contrasts": grid.contrasts,
        "cells": cells(grid),
        # the benchmark data its cells read (env settings with catalog auto look there): each cell must too
        "data_dir": data_dir_now(),
    }


def data_dir_now() -> str | None:
    """``$SERL_DATA_DIR`` as an absolute path (None: unset)."""
    value = os.environ.get(DATA_DIR_VAR)
    return os.path.abspath(value) if value else None


def check_data_dir(record: dict) -> None:
    """A cell runs with the data folder the ablation was started with, or not at all: without it an
    environment whose catalog is ``auto`` (WebShop) would quietly take serl's synthetic one, and the
    cell would belong to another grid. A cell started where ``$SERL_DATA_DIR`` is unset takes the
    recorded folder, when it is there; a record from before serl kept it is not checked."""
    if "data_dir" not in record:
        return
    recorded, now = record["data_dir"], data_dir_now()
    if recorded == now:
        return
    if recorded and now is None and Path(recorded).is_dir():
        os.environ[DATA_DIR_VAR] = recorded
        return
    if recorded and now is None:
        raise SerlError(
            f"this ablation was started with {DATA_DIR_VAR}={recorded}, which is not here: set {DATA_DIR_VAR} to "
            "the same data on this machine before running its cells"
        )
    raise SerlError(
        f"this ablation was started with {DATA_DIR_VAR}={recorded or '(unset)'} and this cell would run with "
        f"{now or '(unset)'}: run every cell of a grid on the same data (set or unset {DATA_DIR_VAR})"
    )


_IDENTITY = ("version", "axes", "final_eval", "base", "cells")
DATA_DIR_VAR = "SERL_DATA_DIR"
_REPORT_KEYS = ("description", "baseline", "contrasts")  # what only the report reads: the grid file's latest word


def write_grid(out: Path, record: dict) -> None:
    """Write OUT/grid.json, or check that the one there is this same grid."""
    path = out / "grid.json"
    if path.exists():
        old = io.read_json(path)
        if old.get("kind") != "serl-ablation":
            raise SerlError(f"{path} is not an ablation grid")
        if not same_grid(old, record):
            raise SerlError(f"{out} holds a different ablation grid: use another --out (or delete {path})")
        # the same cells: a baseline or contrasts added to the grid file later reach the report
        fresh = {k: record.get(k) for k in _REPORT_KEYS if k in record}
        if any(old.get(k) != v for k, v in fresh.items()):
            io.write_json(path, {**old, **fresh})
        return
    io.write_json(path, record)


def same_grid(recorded: dict, record: dict) -> bool:
    """Whether ``record`` (the grid loaded now) has the same cells as ``recorded`` (a grid.json):
    the report's keys (description, baseline, contrasts) aside."""
    fresh = json.loads(json.dumps(record))
    return all(_identity(recorded, k) == _identity(fresh, k) for k in _IDENTITY)


def _identity(record: dict, key: str):
    if key != "base":
        return record.get(key)
    try:
        return resolved_base(record.get("base") or {})
    except SerlError:  # a setting serl no longer knows: not the grid loaded now
        return record.get("base")


def resolved_base(base: dict) -> dict:
    """A grid's base as today's ``OnlineConfig`` resolves it, so a grid.json written before a
    setting existed is the same grid as the file loaded now (the new setting at its default)."""
    from serl_cli.online.config import OnlineConfig

    plain = io.to_plain(cfgmod.from_dict(OnlineConfig, base, "base"))
    plain.pop("out", None)
    plain.pop("seed", None)
    return plain


def load_grid_record(out: str | Path) -> dict:
    out = Path(out)
    path = out / "grid.json"
    if not path.is_file():
        raise SerlError(f"{out} is not an ablation directory (no grid.json)")
    record = io.read_json(path)
    if not isinstance(record, dict) or record.get("kind") != "serl-ablation":
        raise SerlError(f"{path} is not an ablation grid")
    return record
