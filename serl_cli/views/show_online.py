"""``serl show RUN`` on an online run (``serl train --iterations``): its ``iter_XXXX`` folders.

The run's own directory holds no episodes: each iteration's are in its folder, which
``serl show RUN/iter_XXXX`` renders as any run (:mod:`serl_cli.views.show`). Here: what ran,
and one line per iteration folder -- its status in the manifest, its metrics, its checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from serl_cli.artifacts.records import Manifest, Metrics
from serl_cli.artifacts.schema import METRICS_FILE, ROLLOUTS_FILE, read_metrics

ITERATION_COLUMNS = [  # (column, metrics.jsonl key)
    ("reward", "mean_reward"),
    ("success", "success_rate"),
    ("loss", "loss"),
    ("eval success", "eval_success_rate"),
]
STALE_COLUMNS = [  # an asynchronous run's (max_staleness > 0) too
    ("staleness", "staleness_max"),
    ("IS weight", "is_weight_mean"),
]


def is_online_run(run_dir: str | Path, manifest: Manifest) -> bool:
    """An online loop's run directory (``serl train --iterations``): its episodes are in its
    ``iter_XXXX`` folders, not beside the manifest."""
    return manifest.has("online") and not (Path(run_dir) / ROLLOUTS_FILE).exists()


def iteration_rows(run_dir: str | Path, manifest: Manifest) -> list[dict]:
    """One row per ``iter_XXXX`` folder: its status in the manifest (an iteration the loop
    abandoned on a stop, or is running, is not done), the iteration's metrics line, and
    whether it kept a checkpoint."""
    run = Path(run_dir)
    metrics: dict[int, Metrics] = {}
    if (run / METRICS_FILE).is_file():
        metrics = {r["iteration"]: r for r in read_metrics(run / METRICS_FILE) if "iteration" in r}
    rows = []
    for d in sorted(p for p in run.glob("iter_*") if p.is_dir()):
        try:
            k = int(d.name.split("_", 1)[1])
        except ValueError:
            continue
        m = metrics.get(k, Metrics())
        stale = {key: m.get(key) for _, key in STALE_COLUMNS}
        rows.append(
            {
                "iteration": k,
                "folder": d.name,
                "status": str(manifest.stage(d.name).status or "not finished"),
                "episodes": m.get("episodes"),
                **{key: m.get(key) for _, key in ITERATION_COLUMNS},
                **stale,
                "checkpoint": (d / "checkpoint").is_dir(),
            }
        )
    return rows


def online_view(run_dir: str | Path, manifest: Manifest, rows: list[dict]) -> RenderableType:
    """An online run for a person: what ran, then one line per iteration folder."""
    online = manifest.stage("online")
    cfg, status = online.config, online.status or "?"
    commit = (manifest.git_commit or "unknown")[:10]
    algo, env = (cfg.get("train") or {}).get("algo", "?"), (cfg.get("env") or {}).get("name", "?")
    staleness = cfg.get("max_staleness") or 0
    columns = ITERATION_COLUMNS + (STALE_COLUMNS if staleness else [])
    head = Text(
        f"online run {run_dir}: {algo} on {env}, {cfg.get('iterations', '?')} iterations ({status}); "
        + (f"rollouts up to {staleness} update(s) stale; " if staleness else "")
        + f"serl {manifest.serl_version}, "
        f"seed {manifest.seed}, commit {commit}",
        style="bold",
    )
    table = Table(title="iterations", title_justify="left", header_style="bold")
    # a folder's name is what a person copies into the next command: never cut (iter_00…); the
    # numbers' headers wrap instead when the terminal is narrow
    table.add_column("folder", no_wrap=True, min_width=max((len(r["folder"]) for r in rows), default=6))
    for col in ("status", "episodes", *(name for name, _ in columns), "checkpoint"):
        table.add_column(col, justify="left" if col == "status" else "right")
    for r in rows:
        numbers = [f"{r[key]:.3f}" if isinstance(r[key], (int, float)) else "" for _, key in columns]
        table.add_row(
            Text(r["folder"]),
            Text(r["status"], style="green" if r["status"] == "done" else "yellow"),
            Text("" if r["episodes"] is None else str(r["episodes"])),
            *(Text(x) for x in numbers),
            Text("yes" if r["checkpoint"] else ""),
        )
    if not rows:
        hint = "no iteration has started yet"
    else:
        hint = f"`serl show {Path(run_dir) / rows[-1]['folder']}` for an iteration's episodes; `serl plot {run_dir}`"
        hint += " for its curves"
    return Group(head, table, Text(hint, style="dim"))
