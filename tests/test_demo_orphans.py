"""A ``serl demo`` killed alone leaves no arm behind: each arm's process ends with its parent."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, sys, time

    def arm(parent, ready):
        from serl_cli.demo.side_by_side import exit_with_parent
        exit_with_parent(parent, poll_s=0.1)
        open(ready, "w").close()
        time.sleep(120)  # an arm that would train on

    if __name__ == "__main__":
        import os
        child = multiprocessing.get_context("spawn").Process(target=arm, args=(os.getpid(), sys.argv[1]))
        child.start()
        print(child.pid, flush=True)
        time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_an_arm_ends_when_the_demo_is_killed(tmp_path):
    script = tmp_path / "demo_like.py"
    script.write_text(SCRIPT)
    ready = tmp_path / "ready"
    parent = subprocess.Popen([sys.executable, str(script), str(ready)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 60  # the arm imports serl, then watches
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists() and _alive(child), "the arm never started"
        parent.kill()  # SIGKILL: the parent runs no handler, no finally
        parent.wait()
        deadline = time.monotonic() + 15
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the arm outlived the demo"
    finally:
        parent.kill()
