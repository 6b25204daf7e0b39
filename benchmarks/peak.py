"""Peak CPU memory of a block of code, and figures measured one fresh process at a time.

A block's peak is ``VmHWM`` (reset with ``clear_refs`` at the block's start) minus the RSS at
its start: what the block itself held at its worst. Each figure comes from a process of its
own (``python -m MODULE ... --one JSON``), so no measurement inherits another's heap, with
glibc told to map every allocation above 64 KiB by itself (``MALLOC_MMAP_THRESHOLD_``) so that
a freed tensor leaves the resident set at once instead of staying in the heap.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import reset_peak_rss, rss_mb, status_kb

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


class BlockPeak:
    """``with BlockPeak() as p: ...`` then ``p.extra_mb`` (peak minus the start) and ``p.start_mb``."""

    def __enter__(self) -> BlockPeak:
        gc.collect()
        self.start_mb = rss_mb() or 0.0
        if not reset_peak_rss():
            raise RuntimeError("this system does not let a process reset its peak RSS (/proc/self/clear_refs)")
        return self

    def __exit__(self, *exc) -> None:
        self.peak_mb = (status_kb("VmHWM") or 0) / 1024.0
        self.extra_mb = self.peak_mb - self.start_mb


def in_fresh_process(module: str, spec: dict, timeout_s: float = 1800) -> dict:
    """``python -m MODULE --one SPEC --out TMP`` with one torch thread and glibc's mapping set;
    its JSON, or ``{"error": why}``."""
    env = {**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": "1", "SERL_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="serl-peak-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", module, "--one", json.dumps(spec), f"--out={out}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"ran past its {timeout_s:.0f} s limit"}
        if proc.returncode != 0 or not out.is_file():
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return {"error": f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"}
        return json.loads(out.read_text())
