"""The run lock: one writer per run directory (docs/RELIABILITY.md).

A lock file beside the run (``.RUN.serl.lock``) holds its owner's pid, host, start time and
command. A second writer is refused in one line naming the owner; a lock whose owner died on
this host is taken over with a warning; a lock from another host is never taken over.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from serl_cli.artifacts.io import clear_debris, write_failed
from serl_cli.errors import SerlError


def lock_path(run_dir: str | Path) -> Path:
    """The lock sits next to the directory it guards (``.RUN.serl.lock``), so the run's own
    contents -- and whatever checks them or replaces them whole -- never see it."""
    run = Path(os.path.abspath(run_dir))
    return run.parent / f".{run.name}.serl.lock"


def _process_identity(pid: int) -> str | None:
    """Boot id and start time of a process: a pid reused after a reboot or a restart differs."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return f"{boot}:{fields[19]}"  # field 22 of stat: start time in clock ticks after boot


def _is_running(pid: int, identity: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat[stat.rindex(")") + 2] == "Z":
            return False  # killed, not yet reaped by its parent
    except OSError:
        pass
    now = _process_identity(pid)
    return identity is None or now is None or now == identity


def _owner_text(owner: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
    command = " ".join(str(c) for c in owner.get("command") or [])[:120]
    return f"pid {owner.get('pid')} on host {owner.get('host')} since {started} ({command})"


def writer(run_dir: str | Path) -> str | None:
    """Who holds ``run_dir``'s lock now (pid, host, since when, its command), None where no live
    process does: for a reader that finds a stage unfinished, which may be running this minute."""
    try:
        owner = json.loads(lock_path(run_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return None
    if owner.get("host") == platform.node() and (
        owner["pid"] == os.getpid() or not _is_running(owner["pid"], owner.get("identity"))
    ):
        return None  # this very process, or a writer that died here: its run is interrupted, not running
    return _owner_text(owner)


def _make_dirs(path: Path) -> list[Path]:
    """Create ``path`` and missing parents; return the ones created, deepest first."""
    created = []
    p = path
    while not p.exists():
        created.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    return created


@contextmanager
def run_lock(run_dir: str | Path, warn=None):
    """Hold ``run_dir``'s lock while the block runs. Another live writer: refused with one
    line naming it. A lock whose owner died on this host: taken over, with a warning."""
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    path = lock_path(run_dir)
    try:
        created = _make_dirs(path.parent)
    except OSError as e:  # a folder that cannot be written (read-only, full): nothing was made
        raise write_failed(path.parent, e, "nothing was written") from None
    me = {
        "pid": os.getpid(),
        "host": platform.node(),
        "started": time.time(),
        "command": sys.argv,
        "identity": _process_identity(os.getpid()),
    }
    text = json.dumps(me)
    try:
        for _ in range(3):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                _take_over_if_stale(path, run_dir, warn)
                continue
            try:
                os.write(fd, text.encode("utf-8"))
                os.fsync(fd)
            finally:
                os.close(fd)
            break
        else:
            raise SerlError(f"could not lock {run_dir}: {path} keeps changing hands")
    except OSError as e:
        for d in created:
            _rmdir_quietly(d)
        raise write_failed(path, e) from None
    except BaseException:
        for d in created:
            _rmdir_quietly(d)
        raise
    clear_debris(Path(run_dir))
    try:
        yield path
    finally:
        try:
            if path.read_text(encoding="utf-8") == text:
                path.unlink()
        except OSError:
            pass
        for d in created:
            _rmdir_quietly(d)


def _rmdir_quietly(d: Path) -> None:
    try:
        d.rmdir()  # only if still empty: a directory the command created but wrote nothing into
    except OSError:
        pass


def _take_over_if_stale(path: Path, run_dir, warn) -> None:
    try:
        raw = path.read_text(encoding="utf-8")
        owner = json.loads(raw)
        if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
            raise ValueError
    except FileNotFoundError:
        return  # released meanwhile: try again
    except (ValueError, UnicodeDecodeError):
        raise SerlError(f"{path} is not a serl lock: if no serl process uses {run_dir}, delete it") from None
    if owner.get("host") != platform.node():
        raise SerlError(f"{run_dir} is in use by {_owner_text(owner)}: if that process is gone, delete {path}")
    if _is_running(owner["pid"], owner.get("identity")):
        raise SerlError(f"{run_dir} is in use by {_owner_text(owner)}: wait for it, or use another directory")
    # Stale. Rename it aside first: of several processes taking over at once only one
    # rename succeeds, and a lock that changed meanwhile is put back untouched.
    aside = path.with_name(f"{path.name}.{os.getpid()}.stale")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if aside.read_text(encoding="utf-8") != raw:
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
        aside.unlink(missing_ok=True)
        return
    aside.unlink()
    warn(f"took over the lock of {run_dir} from {_owner_text(owner)}, which is no longer running")
