"""``serl ablate --parallel N``: the coordinator's cells are its own. Killed (-9), it leaves no cell
running (the kernel's parent-death signal stops each at its next safe point: at most the
iteration it was in is finished); told SIGTERM, it asks
each cell to stop, waits for them and exits 75; either way a rerun resumes every cell, and each
cell's log keeps every attempt under its own header."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support import tiny_grid


def descendants(pid: int) -> set[int]:
    """Every process under ``pid`` (children, their children...)."""
    found, todo = set(), [pid]
    while todo:
        out = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout.split()
        for child in map(int, out):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return False
    return "zombie" not in state.lower()


@pytest.fixture
def grid(tmp_path, tiny_model_dir) -> Path:
    """Two cells (grpo, serl), each an online run of 12 iterations with its rollout producer beside it:
    long enough that neither finishes between the two stops."""
    path = tiny_grid(tmp_path, tiny_model_dir, seeds=1, iterations=12)
    data = yaml.safe_load(path.read_text())
    data["base"]["max_staleness"] = 1
    path.write_text(yaml.safe_dump(data))
    return path


def coordinator(grid: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "serl_cli", "ablate", str(grid), "--out", str(out), "--parallel", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SERL_THREADS": "1", "COLUMNS": "200"},
        start_new_session=True,
    )


def iterations_done(out: Path) -> list[int]:
    """Each cell's finished online iterations, so far."""
    return [m.read_text().count('"iter_') for m in sorted((out / "cells").glob("*/train/manifest.json"))]


def wait_until_both_train(proc: subprocess.Popen, out: Path, past: list[int]) -> set[int]:
    """Once each cell has finished an iteration more than ``past`` says it had: the processes under the
    coordinator."""
    deadline = time.time() + 300
    while time.time() < deadline and not (
        len(done := iterations_done(out)) == 2 and all(d > p for d, p in zip(done, past, strict=True))
    ):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    cells = descendants(proc.pid)  # the cells, and their producers where started
    assert len(cells) >= 2, f"two cells were expected under the coordinator: {cells}"
    return cells


def test_a_stopped_or_killed_coordinator_leaves_no_cell_running_and_a_rerun_resumes(grid, tmp_path):
    out = tmp_path / "abl"
    # SIGTERM: every cell stops at its next safe point, the coordinator waits for them and exits 75
    proc = coordinator(grid, out)
    cells = wait_until_both_train(proc, out, past=[0, 0])
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-2000:]
    assert "stopped on SIGTERM" in stderr and "rerun" in stderr
    assert not [p for p in cells if alive(p)]
    # kill -9: the kernel stops every cell (and so its producer) with it, within seconds
    before = iterations_done(out)
    proc = coordinator(grid, out)
    cells = wait_until_both_train(proc, out, past=before)
    at_kill = iterations_done(out)
    proc.kill()
    proc.wait(10)
    # each cell finishes the iteration it is in (its next safe point) and ends: how long that takes
    # depends on the machine's load, so the bound is on the work done after the kill, not on seconds
    deadline = time.time() + 120
    while time.time() < deadline and any(alive(p) for p in cells):
        time.sleep(0.1)
    assert not [p for p in cells if alive(p)], "a cell or its producer outlived the killed coordinator"
    after = iterations_done(out)
    assert all(a <= k + 1 for a, k in zip(after, at_kill, strict=True)), (at_kill, after)
    # the rerun: no cell refused as "in use", every one finished, each attempt in its log
    rerun = coordinator(grid, out)
    _, stderr = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, stderr[-3000:]
    record = json.loads((out / "grid.json").read_text())
    for i, cell in enumerate(record["cells"]):
        assert json.loads((out / "cells" / cell["name"] / "cell.json").read_text())["status"] == "done"
        log = (out / "logs" / f"cell_{i}.log").read_text()
        assert log.count("==== ") == 3, log[-2000:]  # every attempt's lines kept, each under its header
