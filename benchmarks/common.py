"""Shared helpers: percentiles, the results tables, the JSON files, peak memory, subprocess sections."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

RESULTS_DIR = Path(__file__).parent / "results"


def percentiles_ms(seconds: list[float]) -> dict:
    a = np.asarray(seconds) * 1000.0
    return {
        "n": int(a.size),
        "p50_ms": float(np.percentile(a, 50)),
        "p95_ms": float(np.percentile(a, 95)),
        "mean_ms": float(a.mean()),
    }


def machine_info() -> dict:
    import torch

    return {
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _cpu_model() -> str:
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        return m.group(1).strip() if m else platform.processor()
    except OSError:
        return platform.processor()


def write_json(path: str | Path, payload: dict) -> Path:
    """Temp file in the same folder, then rename: an interrupted run never leaves half a JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(payload, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    table = Table(title=escape(title))
    for c in columns:
        table.add_column(escape(c), justify="right" if c != columns[0] else "left")
    for r in rows:  # escaped: text such as "serl[vllm]" is not rich markup
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else escape(str(v)) for v in r])
    # piped into a file or a log, rich would wrap at 80 columns; a table for reading later is wider
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def report(name: str, title: str, columns: list[str], rows: list[list], data: dict, out: str | None = None) -> Path:
    """A standalone script's ending: its table on stdout, its figures in ``results/NAME.json``."""
    print_table(title, columns, rows)
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **machine_info(), **data}
    path = write_json(Path(out) if out else RESULTS_DIR / f"{name}.json", payload)
    print(f"wrote {path}")
    return path


def add_run_size_options(ap: argparse.ArgumentParser) -> None:
    """A GPU check's run size; None until :func:`fill_defaults` sets the check's (its ``--smoke`` ones)."""
    ap.add_argument("--tasks", type=int, default=None)
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--max-turns", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--micro-batch-tokens", type=int, default=None)


def fill_defaults(args: argparse.Namespace, defaults: dict) -> None:
    """Set each option of ``defaults`` left unset (None) on the command line."""
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


@contextlib.contextmanager
def work_dir(path: str | None, prefix: str):
    """A check's ``--work`` folder (made, and kept), or a temporary one removed at the end."""
    work = Path(path) if path else Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
    finally:
        if not path:
            shutil.rmtree(work, ignore_errors=True)


def show_and_write(title: str, columns: list[str], rows: list[list], payload: dict, out: str | None) -> None:
    """A check's ending: its table on stdout, its payload in ``out`` where given."""
    print_table(title, columns, rows)
    if out:
        write_json(out, payload)
        print(f"wrote {out}")


# -- one figure a process (benchmarks.peak.in_fresh_process) -----------------------------------
def add_one_options(ap: argparse.ArgumentParser) -> None:
    """``--one SPEC`` (internal: the fresh process measures one figure) and ``--out FILE``."""
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)


def measure_one(args: argparse.Namespace, one) -> dict:
    """In the fresh process: ``one`` of the JSON spec ``--one``, written to ``--out`` (where
    ``in_fresh_process`` reads it)."""
    data = one(json.loads(args.one))
    write_json(args.out, data)
    return data


# -- the suite's summary rows --------------------------------------------------------------------
@dataclass
class Figure:
    """One line of the suite's table: a measured value, what it is, and the goal it is held to."""

    section: str
    name: str
    value: float | None
    unit: str = ""
    target: str = ""  # e.g. "<= 0.8"; empty where the figure has no goal
    note: str = ""

    @property
    def met(self) -> bool | None:
        return target_met(self.value, self.target)

    def to_dict(self) -> dict:
        return {**asdict(self), "met": self.met}


def target_met(value: float | None, target: str) -> bool | None:
    """``"<= 0.8"`` / ``">= 0.3"`` against a value; None where there is no goal or no value."""
    m = re.fullmatch(r"\s*(<=|>=|<|>)\s*([-+0-9.eE]+)\s*", target or "")
    if m is None or value is None:
        return None
    op, bound = m.group(1), float(m.group(2))
    return {"<=": value <= bound, ">=": value >= bound, "<": value < bound, ">": value > bound}[op]


def format_value(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0 or 0.01 <= abs(value) < 10_000:
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return f"{value:.3g}"


def figure_rows(figures: list[Figure]) -> list[list[str]]:
    mark = {True: "yes", False: "NO", None: ""}
    return [[f.section, f.name, format_value(f.value), f.unit, f.target, mark[f.met], f.note] for f in figures]


# -- time ------------------------------------------------------------------------------------------
class Stopwatch:
    """Wall-clock and process CPU seconds of a block.

    The machine is shared: wall-clock time includes the time a process waited for a core
    while others ran, CPU time (user + system of every thread of this process, and of the
    child processes it waited for) does not. The suite runs torch on a fixed thread count
    and compares CPU seconds; wall-clock seconds go to the JSON beside them."""

    def __enter__(self) -> Stopwatch:
        self._wall, self._cpu = time.perf_counter(), cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._wall
        self.cpu_s = cpu_seconds() - self._cpu


def cpu_seconds() -> float:
    """This process (nanosecond clock) + its reaped children (clock ticks: they only run whole sections)."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


# -- optional packages ------------------------------------------------------------------------------
def missing(module: str, extra: str) -> str:
    """Why a section needing ``module`` cannot run here ("" when it can)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install -e '.[{extra}]')"
    return ""


def require(module: str, extra: str) -> None:
    from serl_cli.errors import SerlError

    why = missing(module, extra)
    if why:
        raise SerlError(why)


# -- memory ----------------------------------------------------------------------------------------
def max_rss_mb() -> float:
    """This process's peak resident set so far (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def status_kb(field: str) -> int | None:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in kB; None off Linux."""
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def rss_mb() -> float | None:
    kb = status_kb("VmRSS")
    return kb / 1024.0 if kb is not None else None


def reset_peak_rss() -> bool:
    """Restart ``VmHWM`` from the current RSS (Linux ``clear_refs`` 5); False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# -- sections that run as their own process --------------------------------------------------------
def run_module(module: str, args: list[str], timeout_s: float) -> tuple[dict | None, str]:
    """``python -m MODULE ARGS --out TMP.json``; (its JSON, "") or (None, why it gave none).

    Every benchmark script writes its figures to ``--out``, so a section owned by another
    script is called through that one convention, in its own process (its memory is its own).
    """
    with tempfile.TemporaryDirectory(prefix="serl-bench-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", module, *args, f"--out={out}"]  # one token: scripts may pass argv on
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None, f"ran past its {timeout_s:.0f} s limit"
        if proc.returncode != 0 or not out.is_file():
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return None, f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"
        return json.loads(out.read_text()), ""
