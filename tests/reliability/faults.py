"""Fault injection for the reliability suite: run a stage in a forked child and SIGKILL it.

A forked child starts in milliseconds with torch, the tokenizer and the environment
already loaded, so a test can kill a stage at many points. The kill is a real SIGKILL:
no Python cleanup, no ``finally``, no flush -- what a preempted node does.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def kill_during(
    work: Callable[[], object], when: Callable[[], bool], *, delay: float = 0.0, timeout: float = 300.0
) -> bool:
    """Run ``work()`` in a forked child and SIGKILL it ``delay`` seconds after ``when()``
    first holds. True if it was killed; False if it finished first (a failure of the child
    is an AssertionError carrying its exit status)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: run, then leave without running the parent's pytest machinery
        code = 0
        try:
            work()
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, f"the stage failed in the child (status {status})"
            return False
        if when():
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return True
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the kill condition never held within {timeout} s")
        time.sleep(0.002)


def lines(path: Path) -> int:
    """Complete lines in a file (0 if absent)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def stage_status(run: Path, stage: str) -> str | None:
    try:
        return json.loads((run / "manifest.json").read_text()).get("stages", {}).get(stage, {}).get("status")
    except (OSError, ValueError):
        return None


def tree_hash(root: Path) -> str:
    """Names and bytes of everything under ``root`` (nothing on disk changed <=> equal)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def without(record: dict, *keys: str) -> dict:
    return {k: v for k, v in record.items() if k not in keys}


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run ``serl ARGS`` in this process (the real entry point, without a new interpreter's
    start-up time): exit code, stdout, stderr."""
    from serl_cli.cli import main

    argv = sys.argv
    sys.argv = ["serl", *args]
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(result: tuple[int, str, str], *needles: str) -> str:
    code, _, err = result
    assert code == 2, err
    lines_ = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines_) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines_[0], lines_[0]
    return lines_[0]


def run_with_file_size_limit(work: Callable[[], int], limit: int, stderr_path: Path) -> int:
    """Run ``work()`` in a forked child whose files cannot grow past ``limit`` bytes
    (RLIMIT_FSIZE: the kernel fails the write that crosses it, part-way, as a full disk
    would); the child's stderr goes to ``stderr_path``. Returns the child's exit code."""
    from support import file_size_limit

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            sys.stderr = open(2, "w", closefd=False)
            file_size_limit(limit)()
            code = work()
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def cli_exit_code(*args: str) -> int:
    """``serl ARGS`` through the real entry point; its exit code."""
    from serl_cli.cli import main

    sys.argv = ["serl", *args]
    try:
        main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0
