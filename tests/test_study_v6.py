"""Study v6 (docs/studies/sokoban_v6.md): its three pre-registered grids, its analysis, and the second
reading of study v5 that motivates it, recomputed from the committed per-cell files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from serl_cli.ablate import grid as ab
from serl_cli.ablate import grid_record as ab_record

ROOT = Path(__file__).parent.parent
STUDY = ROOT / "experiments" / "study"
sys.path.insert(0, str(STUDY))

import sokoban_v6_analysis as analysis  # noqa: E402
import sokoban_v6_recheck as recheck  # noqa: E402

LOOSE = {"trajectory": "aligned", "weight_clip": 1.0, "mixing_lambda": 1.0, "lambda_decay_steps": 0}


@pytest.fixture(scope="module")
def grids():
    out = []
    for k in range(3):
        grid = ab.load_grid(str(STUDY / f"sokoban_v6_sft{k}.yaml"))
        out.append((grid, ab_record.grid_record(grid, [])))
    return out


def test_three_starts_of_thirty_cells_on_disjoint_seeds_and_rooms(grids):
    seeds = []
    for k, (grid, rec) in enumerate(grids):
        assert len(rec["cells"]) == 30 and grid.baseline == "grpo"
        assert rec["axes"]["seeds"] == list(range(10 * k, 10 * k + 10))
        assert grid.base["model"].endswith(f"runs/study-v6/warm_start-sft{k}")
        assert grid.base["env"]["settings"] == {"disjoint_rooms": True}
        assert grid.base["rollout"]["sampling"]["coupled"] is True and grid.base["iterations"] == 30
        assert rec["final_eval"]["episodes"] == 500 and rec["final_eval"]["split"] == "test"
        seeds += rec["axes"]["seeds"]
    assert len(set(seeds)) == 30  # no room sequence or sampling stream shared between two pairs


def test_the_oracle_and_the_shuffled_arm_differ_in_the_source_alone(grids):
    for _, rec in grids:
        by_arm = {c["arm"]: c["overrides"] for c in rec["cells"]}
        assert set(by_arm) == {"grpo", "serl-oracle-loose", "serl-shuffled-loose"}
        oracle, shuffled = by_arm["serl-oracle-loose"], by_arm["serl-shuffled-loose"]
        assert oracle["annotate"]["sources"] == "expert" and shuffled["annotate"]["sources"] == "shuffled"
        assert {k: v for k, v in oracle["annotate"].items() if k in LOOSE} == LOOSE
        assert {**oracle["annotate"], "sources": None} == {**shuffled["annotate"], "sources": None}
        assert "optim" not in oracle["train"] and "optim" not in by_arm["grpo"]["train"]  # the base's lr 1e-4


def test_the_analysis_pools_the_pairs_of_every_start_and_holms_the_two_contrasts():
    def start(offset, oracle, shuffled, grpo):
        return {
            "serl-oracle-loose": {offset + i: x for i, x in enumerate(oracle)},
            "serl-shuffled-loose": {offset + i: x for i, x in enumerate(shuffled)},
            "grpo": {offset + i: x for i, x in enumerate(grpo)},
        }

    by_start = {
        "sft0": start(0, [0.3, 0.4, 0.5], [0.2, 0.3, 0.3], [0.3, 0.4, 0.5]),
        "sft1": start(10, [0.2, 0.2], [0.1, 0.2], [0.2, 0.3]),  # one shuffled seed unfinished below
    }
    del by_start["sft1"]["serl-shuffled-loose"][11]
    rows = analysis.with_holm(analysis.pooled(by_start))
    primary, secondary = rows["oracle_minus_shuffled"], rows["oracle_minus_grpo"]
    assert primary["pairs"] == 4 and primary["diff"] == pytest.approx((0.1 + 0.1 + 0.2 + 0.1) / 4)
    assert secondary["pairs"] == 5 and secondary["diff"] == pytest.approx(-0.1 / 5)
    assert primary["holm_p"] == pytest.approx(min(1.0, 2 * min(primary["p"], secondary["p"])))
    assert analysis.same_order([0.1, 0.3, 0.2], [0.01, 0.05, 0.02]) is True
    assert analysis.same_order([0.1, 0.3, 0.2], [0.05, 0.01, 0.02]) is False
    assert analysis.same_order([0.1, None, 0.2], [0.05, 0.01, 0.02]) is None


# -- study v5's second reading (docs/studies/sokoban_v5.md), from its committed cells ---------------


@pytest.fixture(scope="module")
def v5():
    return recheck.merged("success"), recheck.merged("auc")


def test_the_other_step_matched_pair_and_both_pairs_together(v5):
    success, auc = v5
    rows = recheck.step_matched(success, auc)
    other = rows["serl_loose_lr1e-4_minus_grpo_at_loose_step"]
    assert round(other["diff"], 3) == -0.009 and [round(x, 3) for x in other["ci95"]] == [-0.045, 0.028]
    assert round(other["p"], 2) == 0.61
    both = rows["both_pairs_averaged_per_seed"]
    assert round(both["diff"], 3) == 0.018 and [round(x, 3) for x in both["ci95"]] == [-0.0, 0.037]
    step_auc = rows["grpo_at_loose_step_minus_grpo_auc"]
    assert round(step_auc["diff"], 3) == -0.008 and [round(x, 3) for x in step_auc["ci95"]] == [-0.034, 0.018]
    ratios = recheck.step_ratios()["per_iteration"]
    assert len(ratios) == 10 and round(ratios[0], 2) == 1.08 and round(ratios[-1], 2) == 1.57


def test_grpo_drew_lowest_of_twelve_arms(v5):
    success, _ = v5
    rest = recheck.against_the_rest(success)
    assert len(rest) == 12 and min(rest, key=lambda a: rest[a]["mean"]) == "grpo"
    assert round(rest["grpo"]["mean"], 3) == 0.179 and round(rest["grpo"]["diff"], 3) == -0.040
    assert [round(x, 3) for x in rest["grpo"]["ci95"]] == [-0.078, -0.002]
    assert all(r["p"] > 0.15 for a, r in rest.items() if a != "grpo")  # no other arm differs from the rest
    others = [r["mean"] for a, r in rest.items() if a != "grpo"]
    assert round(min(others), 4) == 0.2025 and round(max(others), 4) == 0.2335


def test_without_grpos_lowest_seed(v5):
    success, _ = v5
    low = min(recheck.SEEDS, key=lambda s: success["grpo"][s])
    assert low == 7 and success["grpo"][low] == pytest.approx(0.11)
    rows = recheck.without_seed(success, low)
    v5_arms = set(recheck.per_seed(recheck.V5, "success")) - {"grpo"}
    assert min(rows[a]["p"] for a in v5_arms) > 0.07  # study v5's seven contrasts
    assert rows["serl-ref"]["p"] < 0.05  # but v4's grid rebuilt keeps one: SERL-ref, p 0.034
