"""Files written whole: atomic writes, and a write that fails as one line.

Every file is written to a temporary sibling, flushed, fsynced and renamed into place, so
a reader sees the old file or the new one, never half of one; a write that fails (disk
full) leaves the old file whole and is one clear error. Here too: the output folders a
write goes into (a file in the way is refused in one line), torch files saved and read back
as data only, a checkpoint's file digests, and the debris a killed writer leaves.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from serl_cli.errors import SerlError

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


def append_jsonl(path: str | Path, record: dict) -> None:
    """Add one record to a JSONL file by rewriting it atomically: a crash leaves the old file whole."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    atomic_write_text(path, old + json.dumps(record, separators=(",", ":")) + "\n")


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


# -- the folders writes go into --------------------------------------------------------------------
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


# -- whether files are still the ones written: digests ---------------------------------------------
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


# -- what killed writers leave ---------------------------------------------------------------------
DEBRIS = (".*.tmp", ".*.partial")  # temporary files of atomic writes, staging folders of checkpoints


def clear_debris(folder: Path) -> None:
    """Temporary files and folders a killed or failed writer left in ``folder``: whoever
    holds the lock is the only writer, so none of them is being written."""
    import shutil

    if folder.is_dir():
        for pattern in DEBRIS:
            for p in folder.glob(pattern):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
