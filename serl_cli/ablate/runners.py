"""Where an ablation's cells run: here one after another, here N at a time as
subprocesses, or on a cluster as a SLURM job array whose task i runs ``serl ablate
--cell i`` against the same grid. Every runner goes through :func:`cell_command`, so a
cell runs the same way everywhere; a finished cell is skipped and a killed one resumes.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

from serl_cli.ablate.grid import is_done, run_cell
from serl_cli.artifacts import io
from serl_cli.errors import SerlError

SELF_CMD = [sys.executable, "-m", "serl_cli"]  # how a subprocess runs serl itself


def cell_command(record: dict, out: str | Path, cell: str, program: list[str] | None = None) -> list[str]:
    return [*(program or SELF_CMD), "ablate", *record["source_args"], "--out", str(Path(out).resolve()), "--cell", cell]


def run_cells(record: dict, out: str | Path, *, parallel: int = 1, log=print) -> dict:
    """Run every cell here: one after another, or ``parallel`` subprocesses at a time."""
    n = len(record["cells"])
    if parallel <= 1:
        results = {i: run_cell(record, out, i, log=log) for i in range(n)}
        return results
    todo = [i for i in range(n) if not is_done(out, record["cells"][i])]
    running: dict[int, subprocess.Popen] = {}
    results, failed = {i: "skipped" for i in range(n) if i not in todo}, []
    logs = Path(out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    while todo or running:
        while todo and len(running) < parallel:
            i = todo.pop(0)
            with open(logs / f"cell_{i}.log", "w", encoding="utf-8") as f:
                running[i] = subprocess.Popen(cell_command(record, out, str(i)), stdout=f, stderr=subprocess.STDOUT)
            log(f"cell {i} {record['cells'][i]['name']}: started (log: {logs / f'cell_{i}.log'})")
        time.sleep(0.5)
        for i, p in list(running.items()):
            if p.poll() is not None:
                del running[i]
                results[i] = "done" if p.returncode == 0 else f"failed (exit {p.returncode})"
                log(f"cell {i} {record['cells'][i]['name']}: {results[i]}")
                if p.returncode:
                    failed.append(i)
    if failed:
        raise SerlError(f"{len(failed)} cell(s) failed: {', '.join(map(str, failed))} (see {logs}/cell_<i>.log)")
    return results


DEFAULT_SBATCH = """#!/bin/bash
#SBATCH --job-name=serl-ablate
#SBATCH --array={array}
#SBATCH --output={logs}/%A_%a.out
{resources}
# serl ablate job array: task i trains and evaluates cell i of {grid}
# (a finished cell is skipped, a killed one resumes). Override the program with SERL=/path/to/serl.
set -euo pipefail
{command}
"""


def emit_slurm(record: dict, out: str | Path, *, template: str | None = None, parallel: int = 0) -> Path:
    out = Path(out).resolve()
    n = len(record["cells"])
    array = f"0-{n - 1}" + (f"%{parallel}" if parallel and parallel > 0 else "")
    cmd = shlex.join(cell_command(record, out, "CELL", program=["SERL_PROGRAM"]))
    cmd = cmd.replace("SERL_PROGRAM", "${SERL:-serl}", 1)
    cmd = cmd[: cmd.rfind("CELL")] + '"$SLURM_ARRAY_TASK_ID"'
    s = record.get("slurm") or {}
    template = template or s.get("template")
    if template:
        p = Path(template)
        if not p.is_file():
            raise SerlError(f"slurm template not found: {p}")
        text = p.read_text(encoding="utf-8")
        if "{command}" not in text:
            raise SerlError(f"slurm template {p} has no {{command}} placeholder")
        if "{array}" not in text:
            raise SerlError(f"slurm template {p} has no {{array}} placeholder")
        script = text.replace("{array}", array).replace("{command}", cmd).replace("{out}", shlex.quote(str(out)))
    else:
        lines = []
        for key, flag in (("partition", "partition"), ("account", "account"), ("time", "time"),
                          ("cpus_per_task", "cpus-per-task"), ("mem", "mem")):
            if s.get(key) is not None:
                lines.append(f"#SBATCH --{flag}={s[key]}")
        if s.get("gpus"):
            lines.append(f"#SBATCH --gres=gpu:{s['gpus']}")
        for extra in s.get("extra") or []:
            lines.append(f"#SBATCH {extra}")
        script = DEFAULT_SBATCH.format(array=array, logs=shlex.quote(str(out / "logs")), resources="\n".join(lines),
                                       grid=out / "grid.json", command=cmd)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    path = out / "ablate.sbatch"
    io.atomic_write_text(path, script)
    path.chmod(0o755)
    return path
