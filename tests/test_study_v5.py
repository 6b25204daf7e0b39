"""Study v5's grid (experiments/study/sokoban_v5.yaml, docs/studies/sokoban_v5.md): every arm from study v4's reading
warm start on 10 seeds, the bounds and schedules each arm says, the step-matched learning rates
those of the measured steps, and each arm contrasted with GRPO."""

from __future__ import annotations

from pathlib import Path

import pytest

from serl_cli.ablate import grid as ab
from serl_cli.ablate import grid_record as ab_record

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def arms():
    grid = ab.load_grid(str(ROOT / "experiments" / "study" / "sokoban_v5.yaml"))
    rec = ab_record.grid_record(grid, [])
    assert rec["axes"]["seeds"] == list(range(10)) and len(rec["cells"]) == 80 and grid.baseline == "grpo"
    assert grid.base["model"].endswith("runs/study-v4/warm_start")
    assert grid.base["rollout"]["sampling"]["coupled"] is True
    return {c["arm"]: c["overrides"] for c in rec["cells"]}, grid


def test_each_arm_has_the_bounds_and_schedule_it_says(arms):
    by_arm, _ = arms
    annotate = {a: o.get("annotate", {}) for a, o in by_arm.items()}
    assert by_arm["grpo"]["train"]["algo"] == "grpo" and "optim" not in by_arm["grpo"]["train"]
    held = {a: (x.get("weight_clip"), x.get("mixing_lambda"), x.get("lambda_decay_steps")) for a, x in annotate.items()}
    assert held["serl-oracle-loose-grpo-step"] == (1.0, 1.0, 0)
    assert held["serl-oracle-middle-held"] == (0.5, 0.5, 0)
    assert held["serl-oracle-held"] == (None, None, 0)  # the authors' c 0.2 and lambda 0.5, held
    assert held["serl-ref-middle-held"] == (0.5, 0.5, 0) and annotate["serl-ref-middle-held"]["sources"] == "ref"
    assert held["serl-oracle"] == (None, None, None)  # v4's arm: the authors' schedule
    assert all(x.get("trajectory") == "aligned" for a, x in annotate.items() if a.startswith("serl"))


def test_the_step_matched_rates_are_the_measured_step_ratio(arms):
    by_arm, _ = arms
    ratio = 1.186  # loose SERL's mean step over GRPO's (docs/results/sokoban_v5/update_norms.json)
    assert by_arm["serl-oracle-loose-grpo-step"]["train"]["optim"]["lr"] == pytest.approx(1e-4 / ratio, rel=2e-3)
    assert by_arm["grpo-loose-step"]["train"]["optim"]["lr"] == pytest.approx(1e-4 * ratio, rel=4e-3)


def test_every_arm_is_contrasted_with_grpo(arms):
    by_arm, grid = arms
    assert {c["plus"][0] for c in grid.contrasts} == set(by_arm) - {"grpo"}
    assert all(c["minus"] == ["grpo"] for c in grid.contrasts)
