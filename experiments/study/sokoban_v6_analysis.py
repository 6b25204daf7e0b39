"""Study v6's pre-registered analysis (docs/studies/sokoban_v6.md), from the kept per-cell summaries of
its three grids (one per warm start: experiments/study/sokoban_v6_sft0/1/2.yaml).

    python experiments/study/sokoban_v6_analysis.py docs/results/sokoban_v6 > analysis.json

Final success on the whole 500-room test panel (T 0.4), paired by seed within a start; the three starts'
seeds are disjoint (10k..10k+9), so the 30 pairs are independent given the start:

* primary: SERL with the aligned oracle minus SERL with the shuffled oracle, over the 30 pairs (paired
  t-test, 95 % t-interval);
* secondary: SERL with the aligned oracle minus GRPO, over the 30 pairs;
* Holm over those two p-values, and nothing else in that family;
* per start: both contrasts over its 10 pairs, beside its alignment gap (the cosine of SERL's added
  component with SFT toward the expert, minus GRPO's own cosine with it: ``diagnostics/loose.json``
  of the start, ``cos_added_sft - cos_grpo_sft``) and its gate (``gate.json``). Exploratory: with three
  starts no test is made; whether the gains follow the gaps' order is reported.
* SERL-shuffled minus GRPO (final success), and the panel AUC of all three contrasts: exploratory, outside
  the Holm family.

A start or a pair not finished is reported as missing, never replaced.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from serl_cli.ablate.report import collect
from serl_cli.stats.paired import holm, paired_t_test

STARTS = ("sft0", "sft1", "sft2")
ORACLE, SHUFFLED, GRPO = "serl-oracle-loose", "serl-shuffled-loose", "grpo"
CONTRASTS = {"oracle_minus_shuffled": (ORACLE, SHUFFLED), "oracle_minus_grpo": (ORACLE, GRPO)}  # the Holm family
# exploratory: the shuffled block misleads a teacher that copies it (its gate), so is it worse than no block?
EXPLORATORY = {"shuffled_minus_grpo": (SHUFFLED, GRPO)}


def start_cells(out: Path, metric: str) -> dict[str, dict[int, float]]:
    """One start's arms: seed -> ``metric`` (success | auc) of each finished cell."""
    arms = collect(out)["arms"]
    return {
        name: {seed: float(c[metric]) for seed, c in a["cells"].items() if c[metric] is not None}
        for name, a in arms.items()
    }


def pairs(cells: dict[str, dict[int, float]], plus: str, minus: str) -> tuple[list[float], list[float]]:
    """(plus, minus) values over the seeds both arms finished, in seed order."""
    seeds = sorted(set(cells.get(plus, {})) & set(cells.get(minus, {})))
    return [cells[plus][s] for s in seeds], [cells[minus][s] for s in seeds]


def contrast(a: list[float], b: list[float]) -> dict:
    r = paired_t_test(a, b)
    return {"pairs": r["n"], "diff": r["mean_diff"], "ci95": r["ci95"], "p": r["p"]}


def pooled(by_start: dict[str, dict[str, dict[int, float]]], contrasts: dict = CONTRASTS) -> dict[str, dict]:
    """Each of ``contrasts`` over every start's pairs together."""
    out = {}
    for name, (plus, minus) in contrasts.items():
        a, b = [], []
        for cells in by_start.values():
            x, y = pairs(cells, plus, minus)
            a, b = a + x, b + y
        out[name] = contrast(a, b)
    return out


def with_holm(rows: dict[str, dict]) -> dict[str, dict]:
    """The pre-registered family: Holm over the primary and the secondary contrast."""
    names = list(CONTRASTS)
    for name, p in zip(names, holm([rows[n]["p"] for n in names]), strict=True):
        rows[name]["holm_p"] = p
    return rows


def alignment_gap(diagnostics: Path) -> float | None:
    """cos(SERL - GRPO, SFT->expert) - cos(GRPO, SFT->expert) of a start's first loose update."""
    if not diagnostics.is_file():
        return None
    d = json.loads(diagnostics.read_text())
    return float(d["cos_added_sft"]) - float(d["cos_grpo_sft"])


def gate_figures(path: Path) -> dict | None:
    """The gate's right direction and expert-move gain per block (the oracle's and the shuffled one's)."""
    if not path.is_file():
        return None
    blocks = json.loads(path.read_text())["blocks"]
    keys = ("right_direction", "expert_prob_gain", "held_out_turns")
    wanted = [name for name in blocks if name.split()[0] in ("expert", "shuffled")]
    return {name: {k: blocks[name].get(k) for k in keys} for name in wanted}


def same_order(gaps: list[float | None], gains: list[float | None]) -> bool | None:
    """Whether the starts' gains rank as their gaps do (None while any is missing)."""
    if any(x is None for x in gaps + gains) or len(gaps) < 2:
        return None

    def rank(xs):
        return sorted(range(len(xs)), key=lambda i: xs[i])

    return rank(gaps) == rank(gains)


def analyse(kept: Path) -> dict:
    present = [s for s in STARTS if (kept / s / "grid.json").is_file()]
    success = {s: start_cells(kept / s, "success") for s in present}
    auc = {s: start_cells(kept / s, "auc") for s in present}
    per_start = {}
    for s in present:
        row: dict = {name: contrast(*pairs(success[s], plus, minus)) for name, (plus, minus) in CONTRASTS.items()}
        row["alignment_gap"] = alignment_gap(kept / s / "diagnostics" / "loose.json")
        row["gate"] = gate_figures(kept / s / "gate.json")
        per_start[s] = row
    gaps = [per_start[s]["alignment_gap"] for s in present]
    return {
        "starts": present,
        "missing_starts": [s for s in STARTS if s not in present],
        "final_success": with_holm(pooled(success)),
        "final_success_exploratory": pooled(success, EXPLORATORY),
        "panel_auc_exploratory": pooled(auc, {**CONTRASTS, **EXPLORATORY}),
        "per_start": per_start,
        "gains_follow_gaps": {
            name: same_order(gaps, [per_start[s][name]["diff"] for s in present]) for name in CONTRASTS
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kept", nargs="?", default="docs/results/sokoban_v6", help="holds sft0/, sft1/, sft2/")
    print(json.dumps(analyse(Path(ap.parse_args().kept)), indent=2))


if __name__ == "__main__":
    main()
