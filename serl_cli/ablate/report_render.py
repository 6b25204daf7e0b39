"""Rendering an ablation's report for a person: ``report.md``, ``curves.png`` and the CSV tables.

The numbers come from :mod:`serl_cli.ablate.report` (``collect``, ``summarize``) and
:mod:`serl_cli.ablate.contrasts`; what each column means is stated in that module's docstring.
Nothing here computes a statistic: it rounds, lays out and draws.
"""

from __future__ import annotations

import csv
import io as _stdio
from pathlib import Path

from serl_cli.ablate.contrasts import contrast_lines
from serl_cli.artifacts import io
from serl_cli.stats.summary import fmt, fmt_ci, fmt_p


def _pm(m, s, digits) -> str:
    if m is None:
        return "n/a"
    return f"{m:.{digits}f} ± {fmt(s, digits)}"


def _decoding(rec: dict) -> str:
    """How the final evaluation decoded: the base's eval temperature (0: greedy), as the cells ran it."""
    t = ((rec.get("base") or {}).get("eval") or {}).get("temperature") or 0.0
    return "greedy" if not t else f"sampled at T {t:g}"


def render_markdown(
    data: dict, rows: list[dict], png: str | None, png_note: str | None, contrasts: list[dict] | None = None
) -> str:
    """``report.md``: what ran, then one section per question the report answers, each a table
    with a row per arm (``rows``: :func:`serl_cli.ablate.report.summarize`)."""
    lines = _summary(data, rows)
    lines += _results(rows)
    lines += _against_baseline(rows, data["baseline"])
    if contrasts:
        lines += contrast_lines(contrasts)
    if data["budgets"]:
        lines += _at_budgets(rows, data["budgets"])
    lines += _selection_bias(rows)
    lines += _teacher_signal(rows)
    lines += _cost(rows)
    lines += ["", "## Learning curves", ""]
    lines.append(f"![learning curves]({png})" if png else f"(no plot: {png_note})")
    if data["unfinished"]:
        lines += ["", "## Unfinished cells", ""]
        lines += [f"- cell {u['index']} `{u['name']}`: {u['status']}" for u in data["unfinished"]]
    return "\n".join(lines) + "\n"


def _panel(fe: dict) -> str:
    """The tasks of the final evaluation's fixed panel, in words."""
    if not fe.get("episodes"):
        return f"all tasks of the `{fe['split']}` split"
    if fe.get("panel", "first") == "spread":
        return f"{fe['episodes']} tasks evenly spaced over the `{fe['split']}` split"
    return f"the first {fe['episodes']} tasks of the `{fe['split']}` split"


def _summary(data: dict, rows: list[dict]) -> list[str]:
    """The title, and what ran: the cells, how many finished, and the panel they were all scored on."""
    rec = data["record"]
    n, unfinished = len(rec["cells"]), data["unfinished"]
    return [
        "# Ablation report",
        "",
        f"{n} cells ({n - len(unfinished)} finished, {len(unfinished)} unfinished): {len(rows)} arms x "
        f"seeds {rec['axes']['seeds']}. Final evaluation: {_panel(rec['final_eval'])}, {_decoding(rec)}, "
        f"the same panel for every cell.",
    ]


def _results(rows: list[dict]) -> list[str]:
    """Each arm's final success, score and panel AUC over its seeds."""
    lines = [
        "",
        "## Results (final evaluation, mean ± std over seeds, 95 % t-interval)",
        "",
        "| arm | seeds | success | 95 % CI | score (0-100) | 95 % CI | panel AUC | 95 % CI |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['seeds_done']} | {_pm(r['success_mean'], r['success_std'], 3)} | "
            f"{fmt_ci(r['success_ci_lo'], r['success_ci_hi'], 3)} | {_pm(r['score_mean'], r['score_std'], 1)} | "
            f"{fmt_ci(r['score_ci_lo'], r['score_ci_hi'], 1)} | {_pm(r['auc_mean'], r['auc_std'], 3)} | "
            f"{fmt_ci(r['auc_ci_lo'], r['auc_ci_hi'], 3)} |"
        )
    return lines + [
        "",
        "Panel AUC: the test-panel success of the evaluations during training, averaged over "
        "environment steps (trapezoid rule from the first evaluation to the last).",
    ]


def _against_baseline(rows: list[dict], baseline: str) -> list[str]:
    """Each other arm minus the baseline, paired by seed."""
    lines = [
        "",
        f"## Difference from the baseline `{baseline}` (paired by seed, paired t-test)",
        "",
        "Pairing is valid because every cell is evaluated on the same fixed test panel; "
        "Wilcoxon signed-rank p is given where at least 6 seeds pair. Holm p: adjusted over this table's "
        "comparisons, one family per metric.",
        "",
        "| arm | pairs | Δ success | 95 % CI | p | Holm p | Wilcoxon p | Δ panel AUC | 95 % CI | p | Holm p |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["arm"] == baseline:
            continue
        d_s = "n/a" if r["diff_success"] is None else f"{r['diff_success']:+.3f}"
        d_a = "n/a" if r["diff_auc"] is None else f"{r['diff_auc']:+.3f}"
        lines.append(
            f"| {r['arm']} | {r['pairs']} | {d_s} | {fmt_ci(r['diff_success_ci_lo'], r['diff_success_ci_hi'], 3)} | "
            f"{fmt_p(r['p_success'])} | {fmt_p(r['p_success_holm'])} | {fmt_p(r['wilcoxon_p_success'])} | {d_a} | "
            f"{fmt_ci(r['diff_auc_ci_lo'], r['diff_auc_ci_hi'], 3)} | {fmt_p(r['p_auc'])} | {fmt_p(r['p_auc_holm'])} |"
        )
    return lines


def _at_budgets(rows: list[dict], budgets: list) -> list[str]:
    """Each arm's panel success within the same environment-step budgets: arms compared at equal experience."""
    cols = [f"success_at_{b}_steps" for b in budgets]
    lines = [
        "",
        "## Panel success at fixed environment-step budgets (mean over seeds)",
        "",
        "The last evaluation within each budget. One budget per evaluation round: the most "
        "environment steps any cell had taken by that round, so every cell had evaluated at "
        "least that often within it.",
        "",
        "| arm | " + " | ".join(f"{b} steps" for b in budgets) + " |",
        "| --- | " + " | ".join("---" for _ in cols) + " |",
    ]
    return lines + [f"| {r['arm']} | " + " | ".join(fmt(r[k]) for k in cols) + " |" for r in rows]


def _selection_bias(rows: list[dict]) -> list[str]:
    """Whether the turns placement selected differ from the rest (the selection report's verdicts)."""
    lines = [
        "",
        "## Selection bias (last iteration's selection report, per seed)",
        "",
        "Against every other turn, and against the other scorable turns alone (a block and a nonzero advantage:",
        "the turns a weight can change, and the only ones `random` placement draws from).",
        "",
        "| arm | selected fraction (mean) | verdicts | verdicts among scorable turns |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {fmt(r['selected_fraction'])} | {r['selection_verdicts'] or 'n/a (no annotation)'} | "
            f"{r['selection_verdicts_scorable'] or 'n/a'} |"
        )
    return lines


def _teacher_signal(rows: list[dict]) -> list[str]:
    """Whether the hindsight block moves the teacher toward the expert, and how much the weights change the update."""
    lines = [
        "",
        "## Teacher signal (last iteration that measured it, mean over seeds)",
        "",
        (
            "On scored turns with an expert action: how often the teacher moves the action the right way "
            "(down off the expert's action, up on it), and the change the hindsight block makes to the "
            "teacher's probability of the expert action."
        ),
        "",
        "Advantage mass moved: the share of the update's advantage mass the weights change, "
        "sum |A (w - 1)| / sum |A| over action tokens, averaged over iterations and seeds.",
        "",
        "| arm | seeds | right direction | expert prob gain | advantage mass moved |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        gain = "n/a" if r["teacher_expert_prob_gain"] is None else f"{r['teacher_expert_prob_gain']:+.3g}"
        lines.append(
            f"| {r['arm']} | {r['teacher_signal_seeds']} | {fmt(r['teacher_right_direction'])} | {gain} | "
            f"{fmt(r['advantage_mass_moved'], 4)} |"
        )
    return lines


def _cost(rows: list[dict]) -> list[str]:
    """What each arm cost: wall time and the tokens the teacher scored."""
    lines = [
        "",
        "## Cost",
        "",
        "| arm | cells | wall time total (s) | per cell (s) | teacher tokens scored |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['seeds_done']} | {fmt(r['wall_time_s_total'], 1)} | "
            f"{fmt(r['wall_time_s_mean'], 1)} | "
            f"{r['teacher_tokens_total'] if r['teacher_tokens_total'] is not None else 'n/a'} |"
        )
    return lines


def plot_curves(data: dict, path: Path) -> str | None:
    """Write the learning-curve PNG; returns why not where it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return "matplotlib is not installed (pip install 'serl[plots]')"
    panels = any(c["panel"] for arm in data["arms"].values() for c in arm["cells"].values())
    fig, axes = plt.subplots(1, 3 if panels else 2, figsize=(16 if panels else 11, 4))
    drawn = 0

    def band(ax, xs, ys, name, marker):  # mean over seeds, shaded +- std
        k = min(len(y) for y in ys)
        x = np.mean([xx[:k] for xx in xs], axis=0)
        y = np.array([yy[:k] for yy in ys], dtype=float)
        m, s = y.mean(axis=0), (y.std(axis=0, ddof=1) if len(ys) > 1 else np.zeros(k))
        (line,) = ax.plot(x, m, marker=marker, label=f"{name} (n={len(ys)})")
        ax.fill_between(x, m - s, m + s, alpha=0.2, color=line.get_color())

    for name, arm in data["arms"].items():
        curves = [c["curve"] for c in arm["cells"].values() if c["curve"]]
        if not curves:
            continue
        for ax, key in zip(axes[:2], ("success_rate", "mean_reward"), strict=True):
            band(
                ax,
                [[p["env_steps"] for p in c] for c in curves],
                [[float(p[key] or 0.0) for p in c] for c in curves],
                name,
                None,
            )
        points = [c["panel"] for c in arm["cells"].values() if c["panel"]]
        if panels and points:
            band(axes[2], [[x for x, _ in p] for p in points], [[y for _, y in p] for p in points], name, "o")
        drawn += 1
    if panels:
        axes[2].set_xlabel("cumulative environment steps")
        axes[2].set_ylabel("test-panel success (evaluations)")
        axes[2].grid(alpha=0.3)
    for ax, label in zip(
        axes[:2], ("success rate (training rollouts)", "mean reward (training rollouts)"), strict=True
    ):
        ax.set_xlabel("cumulative environment steps")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if drawn:
        axes[0].legend(fontsize=7)
    fig.suptitle("learning curves: mean over seeds, shaded ± std")
    fig.tight_layout()
    io.save_figure(fig, path, dpi=100)
    return None


def csv_text(rows: list[dict], first: str) -> str:
    buf = _stdio.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else [first], lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return buf.getvalue()
