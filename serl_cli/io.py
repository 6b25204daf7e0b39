"""Artifacts on disk: atomic writes, JSONL records, the run manifest.

Every file is written to a temporary sibling, flushed, fsynced and renamed into place, so
a reader sees the old file or the new one, never half of one. JSONL readers reject a
truncated or malformed line with its file and line number rather than skipping it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from serl_cli import __version__
from serl_cli.errors import SerlError

SCHEMA_VERSION = 1  # bump when a record's layout changes; readers refuse other versions


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_jsonl(path: str | Path, records: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SerlError(f"missing file: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SerlError(f"{path}: malformed JSON ({e.__class__.__name__})") from None


def iter_jsonl(path: str | Path, required: tuple[str, ...] = ()) -> Iterator[dict]:
    """Records of a JSONL file; a truncated, malformed or incomplete line is an error."""
    path = Path(path)
    if not path.is_file():
        raise SerlError(f"missing file: {path}")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                raise SerlError(f"{path}:{lineno}: truncated last line (no newline): the file was cut while being written")
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise SerlError(f"{path}:{lineno}: not a JSON record") from None
            if not isinstance(record, dict):
                raise SerlError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            missing = [k for k in required if k not in record]
            if missing:
                raise SerlError(f"{path}:{lineno}: record lacks {', '.join(missing)}")
            yield record


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def new_manifest(stage: str, config: dict, seed: int | None) -> dict:
    return {
        "serl_version": __version__,
        "schema_version": SCHEMA_VERSION,
        "git_commit": git_commit(),
        "command": sys.argv,
        "python": platform.python_version(),
        "host": platform.node(),
        "seed": seed,
        "stages": {stage: {"status": "running", "started": time.time(), "config": config}},
    }


def load_manifest(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SerlError(f"run directory not found: {run_dir}")
    manifest = read_json(run_dir / "manifest.json") if (run_dir / "manifest.json").exists() else None
    if manifest is None:
        raise SerlError(f"{run_dir} is not a serl run directory (no manifest.json)")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SerlError(f"{run_dir}/manifest.json has artifact schema version {version!r}; this serl reads version {SCHEMA_VERSION}")
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


def prepare_output(path: str | Path, *, overwrite: bool, what: str) -> Path:
    """Refuse to write over finished output unless told ``--overwrite``."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise SerlError(f"{what} already exists at {path}: pass --overwrite to replace it (or --resume where supported)")
    return path


def to_plain(obj) -> dict:
    """A config dataclass as plain JSON-able data."""
    import dataclasses

    return dataclasses.asdict(obj)


def append_jsonl(path: str | Path, record: dict) -> None:
    """Add one record to a JSONL file by rewriting it atomically: a crash leaves the old file whole."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    atomic_write_text(path, old + json.dumps(record, separators=(",", ":")) + "\n")
