"""Paired contrasts of an ablation's arms (a grid file's ``contrasts:``), for ``serl ablate --report``.

Apart from the per-arm report (:mod:`serl_cli.ablate.report`, whose docstring states the rule):
a contrast is, per seed, the sum of its plus arms' metric minus the sum of its minus arms', over
the seeds every named arm finished; the contrasts are one Holm family per metric.
"""

from __future__ import annotations

from serl_cli.stats.paired import holm, paired_t_test, wilcoxon_signed_rank
from serl_cli.stats.summary import fmt_ci, fmt_p

CONTRASTED = ("success", "auc")  # what a contrast of arms compares: the final success and the panel AUC


def contrast_rows(data: dict) -> list[dict]:
    """One row per contrast of the grid record: sum(plus arms) - sum(minus arms), paired by seed."""
    arms, rows = data["arms"], []
    for con in data["record"].get("contrasts") or []:
        named = list(con["plus"]) + list(con["minus"])
        seeds = sorted(set.intersection(*(set(arms[a]["cells"]) for a in named)))
        row = {"contrast": con["name"], "plus": " ".join(con["plus"]), "minus": " ".join(con["minus"])}
        for label in CONTRASTED:
            both = [s for s in seeds if all(arms[a]["cells"][s][label] is not None for a in named)]
            plus = [sum(arms[a]["cells"][s][label] for a in con["plus"]) for s in both]
            minus = [sum(arms[a]["cells"][s][label] for a in con["minus"]) for s in both]
            t = paired_t_test(plus, minus) if both else None
            w = wilcoxon_signed_rank(plus, minus) if both else None
            ci = (t or {}).get("ci95") or [None, None]
            row.update(
                {
                    f"pairs_{label}": len(both),
                    f"diff_{label}": t["mean_diff"] if t else None,
                    f"diff_{label}_ci_lo": ci[0],
                    f"diff_{label}_ci_hi": ci[1],
                    f"p_{label}": t["p"] if t else None,
                    f"wilcoxon_p_{label}": w["p"] if w else None,
                }
            )
        rows.append(row)
    for label in CONTRASTED:  # the contrasts are one family per metric
        for r, adjusted in zip(rows, holm([r[f"p_{label}"] for r in rows]), strict=True):
            r[f"p_{label}_holm"] = adjusted
    return rows


def contrast_lines(contrasts: list[dict]) -> list[str]:
    def diff(r, label):
        return "n/a" if r[f"diff_{label}"] is None else f"{r[f'diff_{label}']:+.3f}"

    lines = [
        "",
        "## Contrasts (paired by seed)",
        "",
        "Per seed, the sum of the plus arms minus the sum of the minus arms, over the seeds every named arm "
        "finished; 95 % t-interval, t-test p against 0, Holm p over this table's contrasts (one family per "
        "metric), Wilcoxon signed-rank p where at least 6 seeds pair.",
        "",
        "| contrast | plus | minus | pairs | Δ success | 95 % CI | p | Holm p | Wilcoxon p | Δ panel AUC | 95 % CI "
        "| p | Holm p |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in contrasts:
        lines.append(
            f"| {r['contrast']} | {r['plus']} | {r['minus'] or '(none)'} | {r['pairs_success']} | "
            f"{diff(r, 'success')} | {fmt_ci(r['diff_success_ci_lo'], r['diff_success_ci_hi'], 3)} | "
            f"{fmt_p(r['p_success'])} | {fmt_p(r['p_success_holm'])} | {fmt_p(r['wilcoxon_p_success'])} | "
            f"{diff(r, 'auc')} | {fmt_ci(r['diff_auc_ci_lo'], r['diff_auc_ci_hi'], 3)} | {fmt_p(r['p_auc'])} | "
            f"{fmt_p(r['p_auc_holm'])} |"
        )
    return lines
