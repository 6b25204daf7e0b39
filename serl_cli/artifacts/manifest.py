"""The run's manifest (``manifest.json``): what made the run, and each stage's status and settings.

Written whole at every change (:mod:`serl_cli.artifacts.writes`); its records view is
:class:`serl_cli.artifacts.records.Manifest`.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from pathlib import Path

from serl_cli import __version__
from serl_cli.artifacts.jsonl import read_json
from serl_cli.artifacts.writes import write_json
from serl_cli.errors import SerlError

SCHEMA_VERSION = 1  # bump when a record's layout changes; readers refuse other versions


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def new_manifest(stage: str, config: dict, seed: int | None, environment: dict | None = None) -> dict:
    """A run's manifest; ``environment`` is what its environment says of the data it loaded
    (``rollout.worlds.world_info``: e.g. which WebShop catalog, the real one or serl's synthetic)."""
    manifest = {
        "serl_version": __version__,
        "schema_version": SCHEMA_VERSION,
        "git_commit": git_commit(),
        "command": sys.argv,
        "python": platform.python_version(),
        "host": platform.node(),
        "seed": seed,
    }
    if environment is not None:
        manifest["environment"] = environment
    manifest["stages"] = {stage: {"status": "running", "started": time.time(), "config": config}}
    return manifest


def load_manifest(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SerlError(f"run directory not found: {run_dir}")
    manifest = read_json(run_dir / "manifest.json") if (run_dir / "manifest.json").exists() else None
    if manifest is None:
        raise SerlError(f"{run_dir} is not a serl run directory (no manifest.json)")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("stages", {}), dict):
        raise SerlError(f"{run_dir}/manifest.json is not a serl manifest (expected an object with a stages mapping)")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SerlError(
            f"{run_dir}/manifest.json has artifact schema version {version!r}; this serl reads version {SCHEMA_VERSION}"
        )
    return manifest


def mark_stage(run_dir: str | Path, stage: str, status: str, **extra) -> None:
    """Record a stage's status (running, done) in the run's manifest, atomically."""
    path = Path(run_dir) / "manifest.json"
    manifest = read_json(path)
    entry = manifest.setdefault("stages", {}).setdefault(stage, {})
    entry.update(status=status, **extra)
    if status == "done":
        entry["finished"] = time.time()
    write_json(path, manifest)
