"""Study v5's reading rechecked from its committed per-cell files, and those of v4's grid rebuilt from
the same start (docs/studies/sokoban_v5.md, "A second reading"; docs/studies/sokoban_v6.md, why v6).

    python experiments/study/sokoban_v6_recheck.py > recheck.json

Reads ``docs/results/sokoban_v5/`` and ``docs/results/sokoban_v4/rebuilt_start/`` (``serl ablate
--report``'s own reader: final success on the 200-room panel, panel AUC over training) and prints:

* ``step_matched``: the two step-matched pairs of v5 (SERL loose at GRPO's step vs GRPO; SERL loose at
  lr 1e-4 vs GRPO at loose SERL's step), and both averaged per seed; GRPO at loose SERL's step vs GRPO
  on panel AUC; the step ratio of ``update_norms.json`` iteration by iteration.
* ``arms``: every distinct arm of the two grids (12: three are shared, and their cells checked equal)
  with its mean final success; each arm against the mean of the other 11, paired by seed.
* ``without_grpo_seed``: every arm against GRPO with one GRPO seed (its lowest) left out of every pair.
* ``v5_contrasts``: v5's own table (each arm against GRPO, Holm over the seven), to check the page.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from serl_cli.ablate.report import collect
from serl_cli.stats.paired import holm, paired_t_test
from serl_cli.stats.summary import mean

ROOT = Path(__file__).resolve().parents[2]
V5 = ROOT / "docs" / "results" / "sokoban_v5"
V4_REBUILT = ROOT / "docs" / "results" / "sokoban_v4" / "rebuilt_start"
SEEDS = list(range(10))


def per_seed(out: Path, metric: str) -> dict[str, list[float]]:
    """Each finished arm's ``metric`` (success | auc) by seed 0-9."""
    arms = collect(out)["arms"]
    return {name: [float(a["cells"][s][metric]) for s in SEEDS] for name, a in arms.items() if len(a["cells"]) == 10}


def merged(metric: str) -> dict[str, list[float]]:
    """The distinct arms of v5 and v4 rebuilt; an arm in both must hold the same cells."""
    v5, v4 = per_seed(V5, metric), per_seed(V4_REBUILT, metric)
    for name in set(v5) & set(v4):
        if v5[name] != v4[name]:
            raise SystemExit(f"arm {name} differs between the two grids: {v5[name]} vs {v4[name]}")
    return {**v5, **{k: v for k, v in v4.items() if k not in v5}}


def test(a: list[float], b: list[float]) -> dict:
    """a - b paired by position: mean, 95 % t-interval, p."""
    r = paired_t_test(a, b)
    return {"n": r["n"], "diff": r["mean_diff"], "ci95": r["ci95"], "p": r["p"]}


def step_matched(success: dict[str, list[float]], auc: dict[str, list[float]]) -> dict:
    one = [x - y for x, y in zip(success["serl-oracle-loose-grpo-step"], success["grpo"], strict=True)]
    other = [x - y for x, y in zip(success["serl-oracle-loose"], success["grpo-loose-step"], strict=True)]
    both = [(x + y) / 2 for x, y in zip(one, other, strict=True)]
    zeros = [0.0] * len(both)
    return {
        "serl_loose_at_grpo_step_minus_grpo": test(success["serl-oracle-loose-grpo-step"], success["grpo"]),
        "serl_loose_lr1e-4_minus_grpo_at_loose_step": test(success["serl-oracle-loose"], success["grpo-loose-step"]),
        "both_pairs_averaged_per_seed": test(both, zeros),
        "grpo_at_loose_step_minus_grpo_auc": test(auc["grpo-loose-step"], auc["grpo"]),
    }


def step_ratios() -> dict:
    """Loose SERL's step over GRPO's at each of the probe's iterations (one seed, 10 iterations)."""
    runs = json.loads((V5 / "update_norms.json").read_text())["runs"]
    grpo = next(v["steps"] for k, v in runs.items() if k.endswith("/grpo"))
    serl = next(v["steps"] for k, v in runs.items() if k.endswith("/serl-oracle-loose"))
    return {
        "per_iteration": [s / g for s, g in zip(serl, grpo, strict=True)],
        "mean_steps": mean(serl) / mean(grpo),
    }


def against_the_rest(success: dict[str, list[float]]) -> dict:
    """Each arm minus the mean of every other arm, paired by seed."""
    out = {}
    for name, values in success.items():
        rest = [mean([success[o][s] for o in success if o != name]) for s in SEEDS]
        out[name] = {"mean": mean(values), **test(values, rest)}
    return out


def without_seed(success: dict[str, list[float]], dropped: int) -> dict:
    keep = [s for s in SEEDS if s != dropped]
    base = [success["grpo"][s] for s in keep]
    return {n: test([v[s] for s in keep], base) for n, v in success.items() if n != "grpo"}


def v5_contrasts() -> dict:
    success, auc = per_seed(V5, "success"), per_seed(V5, "auc")
    arms = [n for n in success if n != "grpo"]
    rows = {n: {"success": test(success[n], success["grpo"]), "auc": test(auc[n], auc["grpo"])} for n in arms}
    for metric in ("success", "auc"):
        for n, p in zip(arms, holm([rows[n][metric]["p"] for n in arms]), strict=True):
            rows[n][metric]["holm_p"] = p
    return rows


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    success, auc = merged("success"), merged("auc")
    grpo_low = min(SEEDS, key=lambda s: success["grpo"][s])
    out = {
        "arms": len(success),
        "step_matched": step_matched(success, auc),
        "step_ratio": step_ratios(),
        "against_the_rest": against_the_rest(success),
        "grpo_lowest_seed": {"seed": grpo_low, "success": success["grpo"][grpo_low]},
        "without_grpo_seed": without_seed(success, grpo_low),
        "v5_contrasts": v5_contrasts(),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
