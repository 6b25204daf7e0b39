"""Where an ablation's cells run: here one after another, here N at a time as
subprocesses, or on a cluster as a SLURM job array whose task i runs ``serl ablate
--cell i`` against the same grid. Every runner goes through :func:`cell_command`, so a
cell runs the same way everywhere; a finished cell is skipped and a killed one resumes.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from serl_cli.ablate.cells import cell_config, is_done, run_cell
from serl_cli.artifacts import io
from serl_cli.errors import PREEMPTED_EXIT, SerlError
from serl_cli.online.stop import die_with_parent

SELF_CMD = [sys.executable, "-m", "serl_cli"]  # how a subprocess runs serl itself

# What the emitted scripts run by default: this interpreter (its virtual environment's python, by
# its absolute path, not resolved), never a `serl` found on the job's PATH -- unless the grid's
# slurm.setup activates an environment (the paper grids: source "$SERL_VENV/bin/activate"), and
# then that environment's `python`, for serl, torchrun and deepspeed alike. SERL=..., TORCHRUN=...
# and DEEPSPEED=... still override them.
PYTHON = os.path.abspath(sys.executable)
ACTIVATED_PYTHON = "python"  # first on PATH once the setup lines have activated the environment


def activates_environment(setup: list[str]) -> bool:
    """Whether the setup lines activate a Python environment (a venv's bin/activate, conda activate)."""
    return any(re.search(r"\bactivate\b", line) for line in setup)


def job_python(record: dict) -> str:
    """The interpreter the job's scripts run: the activated environment's, else this one."""
    setup = (record.get("slurm") or {}).get("setup") or []
    return ACTIVATED_PYTHON if activates_environment(setup) else PYTHON


# A grid without these in its `slurm:` section gets them, per cell (docs: serl_cli.ablate.grid):
# a day of wall time, and per GPU of the cell (at least one) 4 CPUs and 32 GB of host memory --
# one paper cell on an 8-GPU node: 32 CPUs, 256G. The emit message names the ones it filled in.
DEFAULT_TIME = "24:00:00"
CPUS_PER_GPU = 4
MEM_GB_PER_GPU = 32


def cell_command(record: dict, out: str | Path, cell: str, program: list[str] | None = None) -> list[str]:
    # the cell reads the grid from OUT/grid.json, not the grid file: an edit there mid-run changes no cell
    return [*(program or SELF_CMD), "ablate", "--out", str(Path(out).resolve()), "--cell", cell]


def run_cells(record: dict, out: str | Path, *, parallel: int = 1, log=print) -> dict:
    """Run every cell here: one after another, or ``parallel`` subprocesses at a time."""
    n = len(record["cells"])
    if parallel <= 1:
        results = {i: run_cell(record, out, i, log=log) for i in range(n)}
        return results
    check_parallel(record, out, parallel)
    todo = [i for i in range(n) if not is_done(out, record["cells"][i])]
    results, failed = {i: "skipped" for i in range(n) if i not in todo}, []
    logs = Path(out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with CellProcesses() as running:
        while todo or running.cells:
            while todo and len(running.cells) < parallel and running.stopped is None:
                i = todo.pop(0)
                running.start(i, cell_command(record, out, str(i)), logs / f"cell_{i}.log")
                log(f"cell {i} {record['cells'][i]['name']}: started (log: {logs / f'cell_{i}.log'})")
            time.sleep(0.5)
            for i, code in running.ended():
                results[i] = (
                    "done"
                    if code == 0
                    else f"stopped (exit {code}): rerun to resume it"
                    if code == PREEMPTED_EXIT or running.stopped is not None
                    else f"failed (exit {code})"
                )
                log(f"cell {i} {record['cells'][i]['name']}: {results[i]}")
                if code and running.stopped is None:
                    failed.append(i)
            if running.stopped is not None and not running.cells:
                break
    if running.stopped is not None:
        raise CellsStopped(running.stopped, len(todo))
    if failed:
        raise SerlError(f"{len(failed)} cell(s) failed: {', '.join(map(str, failed))} (see {logs}/cell_<i>.log)")
    return results


class CellsStopped(Exception):
    """``serl ablate --parallel`` stopped by a signal: every running cell was asked to stop at its next
    safe point and has ended; a rerun resumes them and starts the rest."""

    def __init__(self, signum: int, not_started: int):
        self.signum = signum
        self.exit_code = INTERRUPTED_EXIT if signum == signal.SIGINT else PREEMPTED_EXIT
        super().__init__(
            f"stopped on {signal.Signals(signum).name}: the running cells checkpointed and ended"
            + (f", {not_started} cell(s) not started" if not_started else "")
            + "; rerun the same command to resume"
        )


INTERRUPTED_EXIT = 130  # 128 + SIGINT


class CellProcesses:
    """The cells running as processes of their own, tied to this one. Each dies with it (the
    kernel's parent-death signal: a SIGTERM, upon which a cell checkpoints and ends), so a killed
    coordinator leaves no orphan to hold a cell's lock. A SIGTERM, SIGUSR1 or SIGINT here asks each
    cell to stop at its next safe point (SIGUSR1: a cell that got the signal itself, with its
    process group, takes a second request as the same one), starts no new cell, and waits for the
    running ones; a second signal ends them at once. Each attempt appends to the cell's log under
    a header, so an earlier attempt's log is never lost."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self):
        self.cells: dict[int, subprocess.Popen] = {}
        self.stopped: int | None = None
        self._old: dict = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            self._old[sig] = signal.signal(sig, self._stop)
        return self

    def __exit__(self, *exc) -> None:
        try:
            for p in self.cells.values():  # an error here: the cells must not run on without us
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR1)
            for p in self.cells.values():
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        finally:
            for sig, old in self._old.items():
                signal.signal(sig, old)

    def _stop(self, signum, frame) -> None:
        if self.stopped is not None:  # a second signal: at once
            for p in self.cells.values():
                if p.poll() is None:
                    p.kill()
            return
        self.stopped = signum
        for p in self.cells.values():
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1)

    def start(self, i: int, command: list[str], log_file: Path) -> None:
        with open(log_file, "a", encoding="utf-8") as f:
            f.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(command)} ====\n")
            f.flush()
            self.cells[i] = subprocess.Popen(
                command,
                stdout=f,
                stderr=subprocess.STDOUT,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
            )

    def ended(self) -> list[tuple[int, int]]:
        """(cell, exit code) of each cell that ended since the last call."""
        done = [(i, p.returncode) for i, p in self.cells.items() if p.poll() is not None]
        for i, _ in done:
            del self.cells[i]
        return done


def check_parallel(record: dict, out: str | Path, parallel: int, cuda_available: bool | None = None) -> None:
    """``--parallel N`` starts N cells at once on this machine: N trainers and engines on the
    same GPUs, each sized for all of them. Refused where a cell trains or generates on CUDA."""
    import torch

    from serl_cli.online.plan import uses_cuda

    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    gpu = [c["name"] for c in record["cells"] if uses_cuda(cell_config(record, out, c), cuda)]
    if gpu:
        raise SerlError(
            f"--parallel {parallel} would start {parallel} cells at once on the same GPUs ({gpu[0]} and "
            f"{len(gpu) - 1} more use CUDA): run them one at a time (--parallel 1) or one per node (--emit slurm)"
        )


DEFAULT_SBATCH = """#!/bin/bash
#SBATCH --job-name=serl-ablate
#SBATCH --array={array}
#SBATCH --output={logs}/%A_%a.out
#SBATCH --open-mode=append
#SBATCH --chdir={workdir}
{resources}
# serl ablate job array: task i trains and evaluates cell i of {grid}
# (a finished cell is skipped, a killed one resumes), run from {workdir} (where it was written).
# serl runs with {python};
# override it with SERL="/path/to/python -m serl_cli" (torchrun, deepspeed: TORCHRUN=..., DEEPSPEED=...).
# Submit it with its report job: bash {submit}
set -euo pipefail
{setup}
{launch}
"""

# The cell runs in the background so that this shell can pass a signal on to it: SLURM sends
# SIGUSR1 {grace} s before the time limit (--signal=B:USR1@...), the cell checkpoints at its next
# safe point and exits (serl: 75), and the task is requeued; its rerun resumes the cell. A SIGTERM
# is passed on as SIGUSR1, which asks the same: on preemption SLURM sends SIGTERM to every process
# of the job, the cell included, and a second SIGTERM would end the cell at once, unsaved.
LAUNCH = """cd {workdir}
cell="$SLURM_ARRAY_TASK_ID"
{prepare}{command} &
child=$!
stopped=""
trap 'stopped=USR1; kill -USR1 "$child" 2>/dev/null || true' USR1
trap 'stopped=TERM; kill -USR1 "$child" 2>/dev/null || true' TERM
rc=0
wait "$child" || rc=$?
while kill -0 "$child" 2>/dev/null; do rc=0; wait "$child" || rc=$?; done
if [ "$stopped" = USR1 ] || [ "$rc" = {preempted} ]; then
    echo "cell $cell stopped (exit $rc): requeued, it resumes where it stopped"
    {requeue}
    exit 0
fi
exit "$rc"
"""

MULTI_NODE = """head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=$((29500 + SLURM_ARRAY_TASK_ID % 1000))
"""

REPORT_SBATCH = """#!/bin/bash
#SBATCH --job-name=serl-ablate-report
#SBATCH --output={logs}/report_%j.out
#SBATCH --chdir={workdir}
{resources}
# The ablation's report, once every task of the array has ended (submitted by {submit} with
# --dependency=afterany:<array job id>): report.md, report.csv, curves.png in {out}.
set -euo pipefail
{setup}
${{SERL:-{serl}}} ablate --report {out}
"""

SUBMIT = """#!/bin/bash
# Submit the ablation: the job array, then its report as a job that starts when every task
# of the array has ended, whatever their exit status (afterany).
set -euo pipefail
array=$(sbatch --parsable {out}/ablate.sbatch)
array=${{array%%;*}}   # --parsable prints "id" or "id;cluster"
report=$(sbatch --parsable --dependency=afterany:"$array" {out}/report.sbatch)
echo "submitted: array $array, report ${{report%%;*}} (after the array)"
"""


def cell_processes(record: dict) -> tuple[int, int]:
    """(nodes, trainer processes per node) a cell of this grid runs with: one per GPU, or one
    per ``train.gpus`` entry when vLLM has GPUs of its own (``rollout.gpus``)."""
    s = record.get("slurm") or {}
    nodes = int(s.get("nodes") or 1)
    gpus = int(s.get("gpus_per_node", s.get("gpus")) or 0)
    train_gpus = (record.get("base") or {}).get("train", {}).get("gpus")
    return nodes, len(train_gpus) if train_gpus else max(gpus, 1)


def choose_launcher(record: dict) -> str:
    """``slurm.launcher``; ``auto``: torchrun when a cell trains on more than one process
    (DeepSpeed), else one process."""
    s = record.get("slurm") or {}
    launcher = s.get("launcher", "auto")
    if launcher != "auto":
        return launcher
    nodes, per_node = cell_processes(record)
    deepspeed = (record.get("base") or {}).get("train", {}).get("backend") == "deepspeed"
    return "torchrun" if deepspeed and nodes * per_node > 1 else "none"


def launch_command(record: dict, out: Path, *, grace: int) -> tuple[str, str]:
    """(preparation lines, the command) of one array task: the cell's command on one
    process, or under torchrun / the deepspeed launcher across the cell's GPUs, each run by
    :func:`job_python`."""
    python = job_python(record)
    serl, torchrun = f"{python} -m serl_cli", f"{python} -m torch.distributed.run"
    args = shlex.join(["ablate", "--out", str(Path(out).resolve()), "--cell"])  # the grid from OUT/grid.json
    args += ' "$SLURM_ARRAY_TASK_ID"'
    nodes, per_node = cell_processes(record)
    launcher = choose_launcher(record)
    if launcher == "none":
        return "", f"${{SERL:-{serl}}} {args}"
    if launcher == "deepspeed":
        hosts = "" if nodes == 1 else ' --hostfile "$SERL_HOSTFILE"'
        return (
            "",
            f"${{DEEPSPEED:-{python} -m deepspeed.launcher.runner}}{hosts} --num_nodes {nodes} --num_gpus {per_node} "
            f"--module serl_cli {args}",
        )
    # torchrun passes SIGUSR1/SIGTERM on to its workers and gives them the grace period to stop
    common = (
        f"--nproc_per_node {per_node} --signals-to-handle SIGTERM,SIGINT,SIGUSR1 "
        f"--shutdown-timeout {max(grace - 60, 30)}"
    )
    if nodes == 1:
        return "", f"${{TORCHRUN:-{torchrun}}} --standalone {common} -m serl_cli {args}"
    rdzv = '--rdzv_backend c10d --rdzv_endpoint "$head:$port" --rdzv_id "$SLURM_JOB_ID"'
    # srun of Slurm 22.05-23.02 does not inherit sbatch's --cpus-per-task (nor read
    # SLURM_CPUS_PER_TASK): without it each node's launcher would get one CPU
    cpus = "${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK}"
    return MULTI_NODE, (
        f"srun --ntasks-per-node=1 {cpus} --kill-on-bad-exit=1 ${{TORCHRUN:-{torchrun}}} --nnodes {nodes} "
        f"{rdzv} {common} -m serl_cli {args}"
    )


def default_resources(record: dict) -> dict:
    """The ``slurm:`` resources a grid leaves unset, as this module fills them in (time, and per
    GPU of the cell -- at least one -- CPUs and host memory): {key: value}."""
    s = record.get("slurm") or {}
    gpus = max(int(s.get("gpus_per_node", s.get("gpus")) or 0), cell_processes(record)[1], 1)
    defaults = {"time": DEFAULT_TIME, "cpus_per_task": CPUS_PER_GPU * gpus, "mem": f"{MEM_GB_PER_GPU * gpus}G"}
    return {k: v for k, v in defaults.items() if s.get(k) is None}


def _resources(s: dict, *, gpus: bool) -> list[str]:
    lines = []
    keys: tuple[tuple[str, str], ...] = (("partition", "partition"), ("account", "account"))
    if gpus:
        keys += (("time", "time"), ("nodes", "nodes"), ("cpus_per_task", "cpus-per-task"), ("mem", "mem"))
    for key, flag in keys:
        if s.get(key) is not None:
            lines.append(f"#SBATCH --{flag}={s[key]}")
    if not gpus:  # the report: a few CPU minutes
        return lines + ["#SBATCH --time=01:00:00", "#SBATCH --cpus-per-task=2", "#SBATCH --mem=8G"]
    if int(s.get("nodes") or 1) > 1:
        lines.append("#SBATCH --ntasks-per-node=1")
    per_node = s.get("gpus_per_node", s.get("gpus"))
    if per_node:
        lines.append(f"#SBATCH --gres=gpu:{per_node}")
    for extra in s.get("extra") or []:
        lines.append(f"#SBATCH {extra}")
    return lines


def emit_slurm(record: dict, out: str | Path, *, template: str | None = None, parallel: int = 0) -> Path:
    """Write ``OUT/ablate.sbatch`` (the job array: task i runs cell i, on the cell's GPUs),
    ``OUT/report.sbatch`` (``serl ablate --report``) and ``OUT/submit.sh`` (the array, then
    the report with ``--dependency=afterany``). ``parallel`` (or ``slurm.max_parallel``) caps
    the tasks that run at once (``%N``). Time, CPUs and memory the grid leaves unset get
    :func:`default_resources` (not with a template, which asks for its own)."""
    out = Path(out).resolve()
    workdir = shlex.quote(str(Path.cwd()))  # relative paths the grid names resolve as they did here
    python = job_python(record)
    n = len(record["cells"])
    s = {**default_resources(record), **(record.get("slurm") or {})}
    cap = parallel if parallel and parallel > 0 else int(s.get("max_parallel") or 0)
    array = f"0-{n - 1}" + (f"%{cap}" if cap else "")
    grace = int(s.get("signal_grace_s") or 900)
    requeue = s.get("requeue", True)
    prepare, command = launch_command(record, out, grace=grace)
    setup = "\n".join(s.get("setup") or [])
    requeue_cmd = (
        'scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" || true'
        if requeue
        else ": # slurm.requeue is false: rerun the task to resume it"
    )
    launch = LAUNCH.format(
        workdir=workdir, prepare=prepare, command=command, grace=grace, preempted=PREEMPTED_EXIT, requeue=requeue_cmd
    )
    template = template or s.get("template")
    submit = out / "submit.sh"
    if template:
        p = Path(template)
        if not p.is_file():
            raise SerlError(f"slurm template not found: {p}")
        text = p.read_text(encoding="utf-8")
        if "{command}" not in text:
            raise SerlError(f"slurm template {p} has no {{command}} placeholder")
        if "{array}" not in text:
            raise SerlError(f"slurm template {p} has no {{array}} placeholder")
        script = text.replace("{array}", array).replace("{command}", launch).replace("{out}", shlex.quote(str(out)))
    else:
        resources = _resources(s, gpus=True)
        if requeue:
            resources += [f"#SBATCH --signal=B:USR1@{grace}", "#SBATCH --requeue"]
        script = DEFAULT_SBATCH.format(
            python="the python of the environment the setup lines activate"
            if python == ACTIVATED_PYTHON
            else f"the interpreter that wrote this script ({PYTHON})",
            workdir=workdir,
            array=array,
            logs=shlex.quote(str(out / "logs")),
            resources="\n".join(resources),
            grid=out / "grid.json",
            setup=setup,
            launch=launch,
            submit=submit,
        )
    report = REPORT_SBATCH.format(
        logs=shlex.quote(str(out / "logs")),
        resources="\n".join(_resources(record.get("slurm") or {}, gpus=False)),
        submit=submit,
        setup=setup,
        out=shlex.quote(str(out)),
        serl=f"{python} -m serl_cli",
        workdir=workdir,
    )
    (out / "logs").mkdir(parents=True, exist_ok=True)
    path = out / "ablate.sbatch"
    for target, text in (
        (path, script),
        (out / "report.sbatch", report),
        (submit, SUBMIT.format(out=shlex.quote(str(out)))),
    ):
        io.atomic_write_text(target, text)
        target.chmod(0o755)
    return path
