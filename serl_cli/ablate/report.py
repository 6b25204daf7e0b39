"""``serl ablate --report OUT``: aggregate the finished cells of an ablation.

Reads ``OUT/grid.json`` and each finished cell's ``eval.json`` / ``cell.json`` /
``train/metrics.jsonl`` (a cell is finished when cell.json says done and eval.json exists;
the others are listed as unfinished) and writes:

* ``report.csv``: one row per arm, full precision: success rate and score (0-100) as
  mean, std (ddof 1) and 95 % t-interval over seeds; the difference from the baseline arm
  with its paired t-test (and Wilcoxon signed-rank where n >= 6); selection-bias summary;
  cost (wall time, teacher tokens scored).
* ``report.md``: the same, rounded, for a person.
* ``curves.png``: success rate and mean reward of the training rollouts against cumulative
  environment steps (running sum of ``env_steps``), one line per arm: the mean over seeds
  at each iteration (x is the seeds' mean cumulative steps there), shaded +- std; and, where
  the cells evaluated during training (``eval.every``), the test-panel success of those
  evaluations. Needs matplotlib (``serl[plots]``); without it the report says so and skips the PNG.

This module computes every number; :mod:`serl_cli.ablate.report_render` lays them out (the markdown,
the CSV tables, the PNG).

**Curves as numbers.** Per cell, from the evaluations during training: the panel AUC (the
trapezoid rule over cumulative environment steps from the first evaluation to the last,
divided by that span: the mean panel success over training), compared with the baseline
like the final success; and the panel success at fixed environment-step budgets (one per
evaluation round: the most steps any cell had taken by that round; the last evaluation within the
budget), so arms whose episodes differ
in length are compared at equal experience.

**Multiple comparisons.** Each metric's p-values against the baseline (one per arm) are one
family, adjusted with Holm's step-down method (``p_<metric>_holm``), which holds the
family-wise error rate at the nominal level whatever the dependence between arms.

**Advantage mass moved.** Per arm, the mean over iterations and seeds of
``advantage_mass_moved``: the share of the update's advantage mass the SERL weights
change (0 for unweighted algorithms).

**Baseline and pairing.** The baseline is the grid's ``baseline:`` arm, else the first grpo
arm where one exists, else the first arm. Each arm is paired with the baseline by seed, over the seeds both have
finished; pairing is valid because every cell is evaluated on the same fixed test panel
(``final_eval.episodes`` tasks of the split, the first ones or, with ``panel: spread``,
evenly spaced ones; decoded at the base's eval temperature with seed 0), so seed s of two
arms differs only in the arm. Undefined statistics (one seed, zero variance) print n/a.

**Selection bias.** Per arm, from the last iteration's ``selection_report.json`` of each
seed: the mean selected fraction of turns and the verdicts (how many seeds gave each).

**Contrasts.** The grid file's ``contrasts:`` (kept in grid.json) name sums of arms to compare
seed by seed: ``{name, plus: [arms], minus: [arms]}`` is, per seed, the sum of the plus arms'
metric minus the sum of the minus arms', over the seeds every named arm finished (a 2x2
interaction is two arms plus, two minus). For the final success and the panel AUC: the mean
contrast, its 95 % t-interval, the t-test p (against 0) and Wilcoxon's signed-rank p; the
contrasts are one family per metric for Holm's adjustment (:mod:`serl_cli.ablate.contrasts`).
They go to ``report.md`` and ``contrasts.csv``.

**Teacher signal.** Per arm, where the environment has an expert action, from the last
iteration's report that has one (``teacher.teacher_signal``, ``method.teacher_signal``; after
lambda has decayed to 0 the teacher is not run): the mean over seeds of ``right_direction``
and ``expert_prob_gain``, and how many seeds measured it.
"""

from __future__ import annotations

from pathlib import Path

from serl_cli.ablate.cells import cell_dir, is_done
from serl_cli.ablate.contrasts import contrast_rows
from serl_cli.ablate.grid_record import load_grid_record
from serl_cli.ablate.report_render import csv_text, plot_curves, render_markdown
from serl_cli.algos.registry import OBJECTIVES
from serl_cli.artifacts import io
from serl_cli.artifacts.records import Metrics
from serl_cli.artifacts.schema import METRICS_FILE, read_metrics
from serl_cli.stats.paired import holm, paired_t_test, wilcoxon_signed_rank
from serl_cli.stats.summary import describe

COMPARED = ("success", "score", "auc")  # final success, final score, area under the panel curve


def _curve(train: Path) -> list[dict]:
    path = train / METRICS_FILE
    if not path.is_file():
        return []
    by_iter: dict[int, Metrics] = {}
    for rec in read_metrics(path):
        by_iter[int(rec.get("iteration", len(by_iter)))] = rec  # a resumed run may repeat an iteration: keep the last
    steps, out = 0, []
    for k in sorted(by_iter):
        rec = by_iter[k]
        steps += int(rec.get("env_steps", 0) or 0)
        out.append(
            {
                "iteration": k,
                "env_steps": steps,
                "success_rate": rec.get("success_rate"),
                "mean_reward": rec.get("mean_reward"),
                "panel_success": rec.get("eval_success_rate"),
                "advantage_mass_moved": rec.get("advantage_mass_moved"),
            }
        )
    return out


def panel_points(curve: list[dict]) -> list[tuple[float, float]]:
    """(cumulative environment steps, test-panel success) at each of the run's evaluations."""
    return [(float(p["env_steps"]), float(p["panel_success"])) for p in curve if p.get("panel_success") is not None]


def curve_auc(points: list[tuple[float, float]]) -> float | None:
    """Area under the panel curve, divided by its span: the trapezoid rule over environment steps
    from the first evaluation to the last, so a run's mean success over training (one point: itself)."""
    if not points:
        return None
    if len(points) == 1 or points[-1][0] == points[0][0]:
        return points[-1][1]
    # pairwise (each point with the next): points[1:] is one shorter by design
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False))
    return area / (points[-1][0] - points[0][0])


def success_at_budget(points: list[tuple[float, float]], budget: float) -> float | None:
    """Panel success of the last evaluation within ``budget`` environment steps (None: none yet)."""
    within = [y for x, y in points if x <= budget]
    return within[-1] if within else None


def _count_verdicts(said) -> str | None:
    """Seeds' verdicts counted by what they say, without each seed's own p-values."""
    verdicts: dict[str, int] = {}
    for v in said:
        v = (v or "none").split(" (")[0]
        verdicts[v] = verdicts.get(v, 0) + 1
    return "; ".join(f"{v} (x{k})" for v, k in verdicts.items()) if verdicts else None


def _teacher_signal(train: Path) -> dict | None:
    """The teacher signal of the online run's last iteration that measured one (once lambda
    has decayed to 0 the teacher is not run, and its iterations have none)."""
    for path in sorted(train.glob("iter_*/selection_report.json"), reverse=True):
        signal = io.read_json(path).get("teacher", {}).get("teacher_signal")
        if signal:
            return signal
    return None


def collect(out: str | Path) -> dict:
    out = Path(out)
    record = load_grid_record(out)
    arms = {a["name"]: {**a, "cells": {}} for a in record["arms"]}
    unfinished = []
    for cell in record["cells"]:
        d = cell_dir(out, cell)
        if not is_done(out, cell):
            status = "not started"
            if (d / "cell.json").is_file():
                status = io.read_json(d / "cell.json").get("status", "unknown")
            unfinished.append({"index": cell["index"], "name": cell["name"], "status": status})
            continue
        ev, info = io.read_json(d / "eval.json"), io.read_json(d / "cell.json")
        arms[cell["arm"]]["cells"][cell["seed"]] = {
            "success": float(ev["success_rate"]),
            "score": float(ev["score"]),
            "episodes": ev.get("episodes"),
            "wall_time_s": float(info.get("wall_time_s", 0.0)),
            "teacher_tokens": int(info.get("teacher_tokens_scored", 0)),
            "selection": info.get("selection"),
            "teacher_signal": _teacher_signal(d / "train"),
            "curve": _curve(d / "train"),
        }
        c = arms[cell["arm"]]["cells"][cell["seed"]]
        c["panel"] = panel_points(c["curve"])
        c["auc"] = curve_auc(c["panel"])
        moved = [p["advantage_mass_moved"] for p in c["curve"] if p.get("advantage_mass_moved") is not None]
        c["advantage_mass_moved"] = sum(moved) / len(moved) if moved else None
    # a budget per evaluation round every cell reached: the most steps any cell had taken by it, so every
    # cell has evaluated that many times within it (and a cell that steps faster may have once more)
    panels = [c["panel"] for a in arms.values() for c in a["cells"].values() if c["panel"]]
    rounds = min((len(p) for p in panels), default=0)
    budgets = [int(max(p[k][0] for p in panels)) for k in range(rounds)]
    for a in arms.values():
        for c in a["cells"].values():
            c["at_budget"] = [success_at_budget(c["panel"], b) for b in budgets]
    names = list(arms)
    baseline = record.get("baseline") or next(
        (n for n in names if arms[n]["algo"] in OBJECTIVES and OBJECTIVES[arms[n]["algo"]].baseline),
        names[0] if names else None,
    )
    return {"record": record, "arms": arms, "baseline": baseline, "unfinished": unfinished, "budgets": budgets}


def summarize(data: dict) -> list[dict]:
    rows = []
    arms, baseline = data["arms"], data["baseline"]
    base_cells = arms[baseline]["cells"] if baseline else {}
    for name, arm in arms.items():
        c = arm["cells"]
        seeds = sorted(c)
        row = {
            "arm": name,
            **{k: arm[k] for k in ("env", "algo", "sources", "granularity", "placement")},
            "seeds_done": len(seeds),
            "seeds": " ".join(map(str, seeds)),
        }
        for label in COMPARED:
            d = describe([c[s][label] for s in seeds if c[s][label] is not None])
            row.update(
                {
                    f"{label}_mean": d["mean"],
                    f"{label}_std": d["std"],
                    f"{label}_ci_lo": d["ci95"][0] if d["ci95"] else None,
                    f"{label}_ci_hi": d["ci95"][1] if d["ci95"] else None,
                }
            )
        paired = sorted(set(seeds) & set(base_cells))
        row["baseline"] = baseline
        row["pairs"] = len(paired) if name != baseline else 0
        for label in COMPARED:
            both = [s for s in paired if c[s][label] is not None and base_cells[s][label] is not None]
            if name == baseline or not both:
                row.update(
                    {
                        f"diff_{label}": None,
                        f"diff_{label}_ci_lo": None,
                        f"diff_{label}_ci_hi": None,
                        f"t_{label}": None,
                        f"p_{label}": None,
                        f"wilcoxon_p_{label}": None,
                    }
                )
                continue
            a, b = [c[s][label] for s in both], [base_cells[s][label] for s in both]
            t = paired_t_test(a, b)
            w = wilcoxon_signed_rank(a, b)
            row.update(
                {
                    f"diff_{label}": t["mean_diff"],
                    f"diff_{label}_ci_lo": t["ci95"][0] if t["ci95"] else None,
                    f"diff_{label}_ci_hi": t["ci95"][1] if t["ci95"] else None,
                    f"t_{label}": t["t"],
                    f"p_{label}": t["p"],
                    f"wilcoxon_p_{label}": w["p"] if w else None,
                }
            )
        sel = [c[s]["selection"] for s in seeds if c[s]["selection"]]
        fracs = [x["selected_fraction"] for x in sel if x.get("selected_fraction") is not None]
        row["selected_fraction"] = sum(fracs) / len(fracs) if fracs else None
        row["selection_verdicts"] = _count_verdicts(x.get("verdict") for x in sel)
        scorable = [x["verdict_scorable"] for x in sel if "verdict_scorable" in x]  # cells before it have none
        row["selection_verdicts_scorable"] = _count_verdicts(scorable)
        signals = [c[s]["teacher_signal"] for s in seeds if c[s]["teacher_signal"]]
        for k, budget in enumerate(data["budgets"]):
            vals = [c[s]["at_budget"][k] for s in seeds if c[s]["at_budget"][k] is not None]
            row[f"success_at_{budget}_steps"] = sum(vals) / len(vals) if vals else None
        moved = [c[s]["advantage_mass_moved"] for s in seeds if c[s]["advantage_mass_moved"] is not None]
        row["advantage_mass_moved"] = sum(moved) / len(moved) if moved else None
        row["teacher_signal_seeds"] = len(signals)
        for key in ("right_direction", "expert_prob_gain"):
            row[f"teacher_{key}"] = sum(x[key] for x in signals) / len(signals) if signals else None
        walls = [c[s]["wall_time_s"] for s in seeds]
        row["wall_time_s_total"] = sum(walls) if walls else None
        row["wall_time_s_mean"] = sum(walls) / len(walls) if walls else None
        row["teacher_tokens_total"] = sum(c[s]["teacher_tokens"] for s in seeds) if seeds else None
        rows.append(row)
    # the comparisons with the baseline are one family per metric: Holm keeps its error rate at 5 %
    for label in COMPARED:
        for r, adjusted in zip(rows, holm([r[f"p_{label}"] for r in rows]), strict=True):
            r[f"p_{label}_holm"] = adjusted
    return rows


def write_report(out: str | Path) -> dict:
    out = Path(out)
    data = collect(out)
    rows = summarize(data)
    contrasts = contrast_rows(data)
    note = plot_curves(data, out / "curves.png")
    md = render_markdown(data, rows, None if note else "curves.png", note, contrasts)
    io.atomic_write_text(out / "report.md", md)
    io.atomic_write_text(out / "report.csv", csv_text(rows, "arm"))
    if contrasts:
        io.atomic_write_text(out / "contrasts.csv", csv_text(contrasts, "contrast"))
    elif (out / "contrasts.csv").is_file():  # the grid no longer names any: no stale table beside the report
        (out / "contrasts.csv").unlink()
    return {
        "rows": rows,
        "contrasts": contrasts,
        "unfinished": data["unfinished"],
        "baseline": data["baseline"],
        "plot": note is None,
    }
