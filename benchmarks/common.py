"""Shared helpers: percentiles, the results table, the JSON file."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

RESULTS_DIR = Path(__file__).parent / "results"


def percentiles_ms(seconds: list[float]) -> dict:
    a = np.asarray(seconds) * 1000.0
    return {"n": int(a.size), "p50_ms": float(np.percentile(a, 50)), "p95_ms": float(np.percentile(a, 95)),
            "mean_ms": float(a.mean())}


def report(name: str, title: str, columns: list[str], rows: list[list], data: dict, out: str | None = None) -> Path:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right" if c != columns[0] else "left")
    for r in rows:
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in r])
    Console().print(table)
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": platform.machine(),
               "python": platform.python_version(), **data}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path
