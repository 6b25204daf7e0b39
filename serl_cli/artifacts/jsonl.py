"""JSON and JSONL read strictly, and record files kept gzipped.

JSONL readers reject a truncated, malformed or oversized line with its file and line number
rather than skipping it. An online run may keep its older record files gzipped: readers find
``path`` or its copy ``path.gz`` (:func:`stored`).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from serl_cli.artifacts.writes import write_jsonl
from serl_cli.errors import SerlError

MAX_RECORD_BYTES = 64 * 2**20  # a JSONL line longer than this is refused unread (a 50-turn episode is ~1-2 MB)


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SerlError(f"missing file: {path}") from None
    except IsADirectoryError:
        raise SerlError(f"{path} is a directory, not a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise SerlError(f"{path}: malformed JSON ({e.__class__.__name__})") from None


def bounded_lines(f, path: Path) -> Iterator[tuple[int, bytes]]:
    """Raw lines of an open binary file, each read with a bounded buffer."""
    lineno = 0
    while True:
        raw = f.readline(MAX_RECORD_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_RECORD_BYTES:
            raise SerlError(f"{path}:{lineno}: line longer than {MAX_RECORD_BYTES // 2**20} MiB: not a serl record")
        yield lineno, raw


def parse_record(raw: bytes, path: Path, lineno: int) -> dict:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise SerlError(f"{path}:{lineno}: not a JSON record") from None
    if not isinstance(record, dict):
        raise SerlError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
    return record


def stored(path: str | Path) -> Path:
    """Where a record file is kept: ``path``, or its gzipped copy ``path.gz`` where only that exists
    (an online run's older iterations under ``old_rollouts: gzip``)."""
    path = Path(path)
    gz = path.with_name(path.name + ".gz")
    return gz if not path.exists() and gz.is_file() else path


def _open_stored(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_stored_bytes(path: str | Path) -> bytes:
    """A record file's bytes as written: ``path``'s, or those of its gzipped copy (:func:`stored`)."""
    with _open_stored(stored(path)) as f:
        return f.read()


def gzip_file(path: Path) -> Path:
    """Replace ``path`` by ``path.gz`` (written whole, then renamed: a kill leaves one or the other)."""
    gz = path.with_name(path.name + ".gz")
    tmp = gz.with_name(gz.name + ".tmp")
    with open(path, "rb") as src, gzip.open(tmp, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.replace(tmp, gz)
    path.unlink()
    return gz


def iter_jsonl(path: str | Path, required: tuple[str, ...] = ()) -> Iterator[dict]:
    """Records of a JSONL file (or of its gzipped copy, :func:`stored`); a truncated, malformed,
    oversized or incomplete line is an error."""
    path = stored(path)
    if not path.is_file():
        raise SerlError(f"missing file: {path}")
    with _open_stored(path) as f:
        for lineno, raw in bounded_lines(f, path):
            if not raw.endswith(b"\n"):
                raise SerlError(
                    f"{path}:{lineno}: truncated last line (no newline): the file was cut while being written"
                )
            record = parse_record(raw, path, lineno)
            missing = [k for k in required if k not in record]
            if missing:
                raise SerlError(f"{path}:{lineno}: record lacks {', '.join(missing)}")
            yield record


def count_jsonl(path: str | Path) -> int:
    """Records in a JSONL file; 0 when it does not exist."""
    return sum(1 for _ in iter_jsonl(path)) if Path(path).exists() else 0


def truncate_jsonl(path: str | Path, n: int) -> None:
    """Keep a JSONL file's first ``n`` records: drop what a killed attempt appended after them."""
    if Path(path).exists():
        records = list(iter_jsonl(path))
        if len(records) > n:
            write_jsonl(path, records[:n])
