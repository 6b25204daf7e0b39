"""Artifacts on disk: atomic writes, JSONL records, the run manifest.

Every file is written to a temporary sibling, flushed, fsynced and renamed into place, so
a reader sees the old file or the new one, never half of one; a write that fails (disk
full) leaves the old file whole and is one clear error. JSONL readers reject a truncated,
malformed or oversized line with its file and line number rather than skipping it.

*Journals* make a killed stage resumable (docs/RELIABILITY.md): append-only JSONL files
whose every line is fsynced as a stage finishes a unit of work (a torn last line is the
unit that did not finish). The run lock, which keeps two processes from writing one run
directory, is in :mod:`serl_cli.artifacts.runlock`.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from serl_cli import __version__
from serl_cli.errors import SerlError

SCHEMA_VERSION = 1  # bump when a record's layout changes; readers refuse other versions
MAX_RECORD_BYTES = 64 * 2**20  # a JSONL line longer than this is refused unread (a 50-turn episode is ~1-2 MB)


FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# torch.save to a path (as DeepSpeed's checkpoints are written) reports a failed write in these
# words and keeps no errno: the write itself, then the zip's end that no longer lines up
TORCH_WRITE_FAILED = ("PytorchStreamWriter failed writing file", "unexpected pos", "iostream error")


def torch_write_failed(e: BaseException) -> bool:
    """Whether ``e`` is torch's report of a write that failed (most likely a full disk)."""
    return isinstance(e, RuntimeError) and any(words in str(e) for words in TORCH_WRITE_FAILED)


def write_failed(path: str | Path, e: Exception, kept: str = "the previous version, if any, is intact") -> SerlError:
    """A failed write (disk full, quota, file too large) as the one line the user sees.
    Libraries that write in native code (safetensors) report the OS error in their text."""
    if isinstance(e, OSError):
        reason, full = e.strerror or str(e), e.errno in FULL_DISK
    elif torch_write_failed(e):
        reason, full = "torch.save's write failed", True
    else:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        full = any(f"os error {n})" in reason for n in FULL_DISK)
    hint = " (disk full?)" if full else ""
    return SerlError(f"could not write {path}: {reason}{hint}; {kept}")


def torch_save(obj, path: str | Path) -> None:
    """``torch.save`` into a file serl opens, so that a failed write (a full disk) is the
    ``OSError`` it is: given a path, torch's zip writer reports it as a ``RuntimeError``
    ("unexpected pos ...") that has lost the errno; given a file, that error's context keeps it."""
    import torch

    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            cause = e.__context__
            while cause is not None and not isinstance(cause, OSError):
                cause = cause.__context__
            if cause is None:
                raise
            raise cause from None


def torch_load(path: str | Path, what: str, map_location="cpu"):
    """A ``torch.save`` file serl wrote (``what``: what it holds, for the message), read as tensors
    and plain values only (``weights_only``): a run folder is data, and a file planted in one can
    run no code here. An object that is not data, or a truncated file, is refused in one line."""
    import pickle

    import torch

    try:
        return torch.load(path, weights_only=True, map_location=map_location)
    except pickle.UnpicklingError as e:  # what weights_only refuses: an object that is not data
        raise SerlError(
            f"{path} ({what}) holds more than tensors and plain values, and serl never unpickles objects from a "
            f"run folder ({first_line(e)}): use a checkpoint serl wrote"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:  # truncated, or not a torch file at all
        raise SerlError(f"{path} ({what}) is unreadable, truncated or corrupt ({first_line(e)})") from None


def first_line(e: BaseException, limit: int = 200) -> str:
    """An exception's first line of text (its type where it has none), at most ``limit`` characters."""
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:limit]


def current_umask() -> int:
    mask = os.umask(0)  # reading it means setting it: put it straight back
    os.umask(mask)
    return mask


def follow_umask(tree: Path) -> None:
    """Give every file and folder under ``tree`` (itself included; or the file ``tree``) the mode the umask asks for.
    Some writers (safetensors) create 0600 files whatever the umask; call this on a staged
    directory before it is renamed into place."""
    mask = current_umask()
    tree.chmod((0o777 if tree.is_dir() else 0o666) & ~mask)
    for p in tree.rglob("*"):
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = None
    check_output_dir(path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o666 & ~current_umask())  # as open() would create it, not mkstemp's 0600
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # the rename itself survives a power cut
    except OSError as e:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        raise write_failed(path, e) from None
    except BaseException:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        raise


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename is still atomic
    finally:
        os.close(fd)


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
    except IsADirectoryError:
        raise SerlError(f"{path} is a directory, not a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise SerlError(f"{path}: malformed JSON ({e.__class__.__name__})") from None


def _lines(f, path: Path) -> Iterator[tuple[int, bytes]]:
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


def _parse(raw: bytes, path: Path, lineno: int) -> dict:
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
        for lineno, raw in _lines(f, path):
            if not raw.endswith(b"\n"):
                raise SerlError(
                    f"{path}:{lineno}: truncated last line (no newline): the file was cut while being written"
                )
            record = _parse(raw, path, lineno)
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


def not_a_directory(folder: str | Path) -> Path | None:
    """The first of ``folder`` and its parents that exists but is not a directory (a file where
    an output folder should go: ``--out runs/f`` with ``runs/f`` a file), else None."""
    folder = Path(folder)
    for p in (folder, *folder.parents):
        if p.exists() or p.is_symlink():
            return None if p.is_dir() else p
    return None


def check_output_dir(folder: str | Path) -> None:
    """Refuse, in one line, an output folder that a file stands in the way of (``mkdir`` would
    raise FileExistsError or NotADirectoryError with a traceback)."""
    blocker = not_a_directory(folder)
    if blocker is not None:
        where = "" if blocker == Path(folder) else f" (in the way of {folder})"
        raise SerlError(f"output folder {blocker} is a file, not a directory{where}: choose another --out")


def file_sha256(path: Path, chunk: int = 2**24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def digest_files(directory: str | Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """The sha256 of every file directly in ``directory`` (a checkpoint: its weights, trainer
    state, tokenizer), by name, bar ``skip``: what a record keeps so a resume finds out whether
    the files it is about to trust are the ones that were written."""
    directory = Path(directory)
    return {p.name: file_sha256(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name not in skip}


def check_digests(directory: str | Path, recorded: dict | None, what: str) -> None:
    """Refuse, in one line, ``directory`` when a file ``recorded`` names (:func:`digest_files`) is
    gone or holds other bytes now; nothing recorded (a run from before serl kept digests): nothing
    to check."""
    directory = Path(directory)
    for name, digest in (recorded or {}).items():
        path = directory / name
        if not path.is_file():
            raise SerlError(f"{path} is gone since {what} wrote it: the checkpoint is incomplete")
        if file_sha256(path) != digest:
            raise SerlError(
                f"{path} has changed since {what} wrote it (its sha256 differs from the record): the file was cut "
                "or replaced; pass --overwrite to run again"
            )


def save_figure(fig, path: str | Path, dpi: int) -> Path:
    """A matplotlib figure into ``path`` as a PNG, whole or not at all (written aside, then renamed);
    a folder that cannot be written (read-only, full) is one line naming it. The figure is closed."""
    import matplotlib.pyplot as plt

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=dpi)
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise write_failed(path, e, kept="nothing was written; pass --out FILE to draw it elsewhere") from None
    finally:
        plt.close(fig)
    return path


def make_dir(folder: str | Path) -> Path:
    """``mkdir -p`` that refuses a file in the way in one line (:func:`check_output_dir`)."""
    check_output_dir(folder)
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder)


def prepare_output(path: str | Path, *, overwrite: bool, what: str, resumable: bool = False) -> Path:
    """Refuse to write over finished output unless told ``--overwrite`` (``resumable``: the
    command also has ``--resume``, and the refusal names it), or into a folder a file stands in
    the way of."""
    path = Path(path)
    check_output_dir(path.parent)
    if path.exists() and not overwrite:
        also = " (or --resume to keep it)" if resumable else ""
        raise SerlError(f"{what} already exists at {path}: pass --overwrite to replace it{also}")
    return path


def json_copy(value):
    """``value`` as JSON reads it back (tuples become lists; a deep copy)."""
    return json.loads(json.dumps(value))


def to_plain(obj) -> dict:
    """A config dataclass as plain JSON-able data."""
    import dataclasses

    return dataclasses.asdict(obj)


def append_jsonl(path: str | Path, record: dict) -> None:
    """Add one record to a JSONL file by rewriting it atomically: a crash leaves the old file whole."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    atomic_write_text(path, old + json.dumps(record, separators=(",", ":")) + "\n")


# -- journals: the finished units of an interrupted stage ---------------------------------------


def begin_resumable(
    target: Path, journal: Path, *, overwrite: bool, resume: bool, what: str, finished, records_of=None
) -> dict | None:
    """Start a stage that writes ``target`` and journals its units in ``journal``.

    With ``resume``: the finished stage's summary (``finished()``), once ``target`` is checked
    whole (``records_of(summary)``: how many records it must hold), or None to go on from the
    journal. Without: ``target`` must be new unless ``overwrite``, and a journal left by an
    interrupted pass is refused rather than silently thrown away."""
    if resume and not overwrite:
        summary = finished()
        if summary is not None:
            check_finished_output(target, what, records_of(summary) if records_of else None)
            journal.unlink(missing_ok=True)  # left by a kill between marking done and cleaning up
        return summary
    prepare_output(target, overwrite=overwrite, what=what, resumable=True)
    if journal.exists() and not overwrite:
        raise SerlError(
            f"{target.parent} holds an interrupted {what} pass ({journal.name}): pass --resume to "
            f"continue it or --overwrite to start again"
        )
    return None


def check_finished_output(target: Path, what: str, records: int | None = None) -> None:
    """A finished stage's JSONL output is whole before ``--resume`` vouches for it: every line
    a record and, where the stage counted them, as many as it wrote. Its journal is gone, so
    what was cut off cannot be rebuilt: the refusal says how to run the stage again."""
    again = f"pass --overwrite to run the {what} again"
    try:
        found = count_jsonl(target)
    except SerlError as e:
        raise SerlError(f"{e}; the finished {what} there is damaged: {again}") from None
    if records is not None and found != records:
        raise SerlError(
            f"{target} holds {found} records but the finished {what} wrote {records}: "
            f"the file was cut or edited; {again}"
        )


def start_journal(path: str | Path, header: dict) -> None:
    """A new journal holding only its header (what the work is: config, inputs)."""
    atomic_write_text(path, json.dumps({"journal": header}, separators=(",", ":")) + "\n")


def append_journal(path: str | Path, unit: dict) -> None:
    """Append one finished unit and fsync it before the stage moves on: O(1) per unit, and a
    kill mid-write leaves at most a torn last line, which :func:`read_journal` drops."""
    line = (json.dumps(unit, separators=(",", ":")) + "\n").encode("utf-8")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise write_failed(path, e, "the work journaled before is kept: make room and rerun with --resume") from None


def read_journal(path: str | Path, header: dict) -> list[dict]:
    """The finished units of a journal whose header equals ``header``; a torn last line
    (the unit a kill interrupted) is cut off the file."""
    path = Path(path)
    units, good = [], 0
    with open(path, "rb") as f:
        for lineno, raw in _lines(f, path):
            if not raw.endswith(b"\n"):
                break  # the unit being written when the process died: it did not finish
            record = _parse(raw, path, lineno)
            if lineno == 1:
                _check_header(path, record.get("journal"), header)
            else:
                units.append(record)
            good += len(raw)
    if good == 0:
        raise SerlError(f"{path} has no header line: delete it or pass --overwrite to start again")
    if good < path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good)
            os.fsync(f.fileno())
    return units


def _check_header(path: Path, found, expected: dict) -> None:
    expected = json.loads(json.dumps(expected))  # compare as JSON sees it (tuples are lists)
    if found == expected:
        return
    if not isinstance(found, dict):
        raise SerlError(f"{path} is not a serl journal: delete it or pass --overwrite to start again")
    # the stage's settings first, named as the user sets them (sampling.temperature), then the rest
    every = differences(found.get("config"), expected.get("config"))
    every += differences(_without_config(found), _without_config(expected))
    every = [(key or "config", old, new) for key, old, new in every]  # "": a config that is not a mapping
    every = every or [("config", found.get("config"), expected.get("config"))]
    what = "a different setting" if len(every) == 1 else "different settings"
    raise SerlError(
        f"{path} belongs to an interrupted run with {what} ({differences_text(every)}): "
        f"resume with the same settings, or pass --overwrite to start again"
    )


_ABSENT = object()


def _without_config(header: dict) -> dict:
    return {k: v for k, v in header.items() if k != "config"}


def differences(stored, now, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Every setting (dotted path, in ``stored``'s order, then ``now``'s) whose value differs
    between two plain configs, compared as JSON sees them."""
    stored, now = json.loads(json.dumps(stored)), json.loads(json.dumps(now))
    if not (isinstance(stored, dict) and isinstance(now, dict)):
        return [] if stored == now else [(prefix.rstrip("."), stored, now)]
    found: list[tuple[str, Any, Any]] = []
    for key in [*stored, *(k for k in now if k not in stored)]:
        a, b = stored.get(key, _ABSENT), now.get(key, _ABSENT)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            found += differences(a, b, f"{prefix}{key}.")
        else:
            found.append((f"{prefix}{key}", a, b))
    return found


def first_difference(stored, now, prefix: str = "") -> tuple[str, Any, Any] | None:
    """The first of :func:`differences`; None when the configs are equal."""
    found = differences(stored, now, prefix)
    return found[0] if found else None


def differences_text(found: list[tuple[str, Any, Any]]) -> str:
    """``train.algo: stored grpo, now serl; rollout.tasks: stored 4, now 8``."""
    return "; ".join(difference_text(*d) for d in found)


def difference_text(key: str, stored, now) -> str:
    """``train.algo: stored grpo, now serl`` (a value one side lacks: ``unset``)."""

    def shown(v) -> str:
        return "unset" if v is _ABSENT else json.dumps(v) if not isinstance(v, str) else v

    return f"{key}: stored {shown(stored)}, now {shown(now)}"


DEBRIS = (".*.tmp", ".*.partial")  # temporary files of atomic writes, staging folders of checkpoints


def clear_debris(folder: Path) -> None:
    """Temporary files and folders a killed or failed writer left in ``folder``: whoever
    holds the lock is the only writer, so none of them is being written."""
    import shutil

    if folder.is_dir():
        for pattern in DEBRIS:
            for p in folder.glob(pattern):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
