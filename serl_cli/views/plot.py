"""``serl plot RUN``: training curves of one run, as a PNG beside its metrics.

Reads ``RUN/metrics.jsonl`` (one record per update: the online loop's, or a single
update's) and draws one panel per quantity that the run logged -- reward, success, loss,
KL to the reference, clip fraction, the rollout engine's mismatch with the trainer and the
off-policy correction's weights (``train.offpolicy``), SERL weight statistics, the teacher
signal (an annotated update's ``teacher_right_direction`` and ``teacher_expert_prob_gain``,
where its turns had an expert action: ``method.teacher_signal``), periodic evaluation -- against iterations or
environment steps. A panel whose metric the run never logged is left out, so a GRPO run has
no weight panel. matplotlib is an optional extra (``serl[plots]``).
"""

from __future__ import annotations

from pathlib import Path

from serl_cli.artifacts import io
from serl_cli.artifacts.records import Metrics
from serl_cli.artifacts.schema import METRICS_FILE
from serl_cli.artifacts.schema import read_metrics as read_metrics_file
from serl_cli.errors import SerlError

# (panel title, metric keys drawn in it)
PANELS = [
    ("reward", ["mean_reward"]),
    ("success", ["success_rate", "eval_success_rate"]),
    ("loss", ["loss", "pg_loss"]),
    ("KL (k3)", ["kl_ref", "kl_k3"]),  # k3 estimates, both >= 0: to the reference, and to the rollouts' policy
    ("clip fraction", ["clip_frac"]),
    # the rollout engine against the trainer (train.recompute_logp_old) and the off-policy correction's weights
    ("engine mismatch", ["logp_mismatch_k1", "logp_mismatch_k3"]),
    ("off-policy weights", ["is_weight_mean", "is_clipped_frac", "is_masked_frac"]),
    ("staleness (updates)", ["staleness_mean", "staleness_max"]),
    ("SERL weights", ["weight_mean", "weight_min", "weight_max"]),
    ("|advantage|", ["mean_abs_advantage"]),
    ("teacher signal", ["teacher_right_direction", "teacher_expert_prob_gain"]),
]
X_AXES = {"iteration": "iteration", "env_steps": "environment steps"}


def read_metrics(run: Path) -> list[Metrics]:
    path = run / METRICS_FILE
    if not path.is_file():
        raise SerlError(f"{run} has no metrics.jsonl: plot a run that trained (serl train)")
    records = read_metrics_file(path)
    if not records:
        raise SerlError(f"{path} is empty: no update has finished yet")
    return records


def series(records: list[Metrics], x: str, key: str) -> tuple[list[float], list[float]]:
    """(x, y) points of ``key`` over the records that carry both; the update count stands in
    for the iteration in a single-update run's metrics."""
    xs, ys = [], []
    for i, r in enumerate(records):
        xv = r.get(x, r.get("update", i) if x == "iteration" else None)
        yv = r.get(key)
        if isinstance(xv, (int, float)) and isinstance(yv, (int, float)):
            xs.append(float(xv))
            ys.append(float(yv))
    return xs, ys


def drawn_panels(records: list[Metrics], x: str) -> list[tuple[str, list]]:
    """The panels the records fill: (title, [(metric, (xs, ys)), ...]), each metric with at least one point."""
    panels = [(title, [(k, series(records, x, k)) for k in keys]) for title, keys in PANELS]
    panels = [(title, [(k, s) for k, s in lines if s[0]]) for title, lines in panels]
    return [(title, lines) for title, lines in panels if lines]


def plot_run(run_dir: str, *, x: str = "iteration", out: str | None = None) -> Path:
    """Write the curves of ``run_dir`` to ``out`` (default ``RUN/curves.png``); returns the path."""
    if x not in X_AXES:
        raise SerlError(f"unknown x axis {x!r}: choose one of {', '.join(X_AXES)}")
    run = Path(run_dir)
    panels = drawn_panels(read_metrics(run), x)
    if not panels:
        raise SerlError(f"{run}/metrics.jsonl holds none of the plotted metrics against {x}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SerlError("serl plot needs matplotlib, in serl's plots extra: pip install 'serl[plots]'") from None
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    # the grid may hold more cells than panels: the spare ones are switched off below
    for ax, (title, lines) in zip(axes.flat, panels, strict=False):
        for key, (xs, ys) in lines:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel(X_AXES[x])
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(str(run), fontsize=9)
    fig.tight_layout()
    return io.save_figure(fig, Path(out) if out else run / "curves.png", dpi=110)
