"""SmolLM2's learning pre-study (experiments/study/smollm2_prestudy.yaml, docs/MODELS.md): the grid as pre-registered,
and its analysis (experiments/smollm2/learning_analysis.py) against values worked by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from serl_cli.ablate import grid as ab

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "smollm2"))
import learning_analysis as la  # noqa: E402


def test_the_grid_is_grpo_serl_and_loose_serl_over_three_coupled_seeds():
    grid = ab.load_grid(str(ROOT / "experiments" / "study" / "smollm2_prestudy.yaml"))
    assert grid.axes["seeds"] == [0, 1, 2] and grid.baseline == "grpo"
    assert [c["name"] for c in ab.cells(grid)][:3] == ["grpo-s0", "grpo-s1", "grpo-s2"]
    assert len(ab.cells(grid)) == 9
    assert grid.base["rollout"]["sampling"]["coupled"] is True  # arms of one seed share their sampling streams
    assert grid.base["rollout"]["prompt"]["instruction"] == "Answer with one word: up, down, left or right."
    assert grid.base["iterations"] == 10 and grid.base["train"]["optim"]["lr"] == 5e-5
    assert grid.final_eval == {"episodes": 64, "split": "test"}
    loose = next(a for a in grid.extra_arms if a["name"] == "serl-loose")
    assert loose["set"]["annotate"] == {"weight_clip": 1.0, "mixing_lambda": 1.0, "lambda_decay_steps": 0}


def test_the_t_interval_over_three_seeds_by_hand():
    # mean 2, sd 1, t(0.975, 2 df) = 4.3027: half-width 4.3027 / sqrt(3) = 2.4841
    out = la.mean_ci([1.0, 2.0, 3.0])
    assert out["mean"] == 2.0 and out["n"] == 3
    assert out["ci95"] == pytest.approx([2 - 2.4841, 2 + 2.4841], abs=1e-4)
    assert la.mean_ci([0.5])["ci95"] is None


def test_each_episode_counts_valid_and_parsed_turns(tmp_path):
    # a reply into a wall is parsed but invalid; prose is neither
    rows = [
        {"task_id": 0, "num_turns": 3, "invalid_actions": 2, "success": False, "actions": ["up", "The answer", "left"]},
        {"task_id": 1, "num_turns": 1, "invalid_actions": 0, "success": True, "actions": ["down"]},
    ]
    f = tmp_path / "episodes.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rooms = la.per_room(f)
    assert rooms["0"] == {"valid": pytest.approx(1 / 3), "parsed": pytest.approx(2 / 3), "success": 0.0}
    assert rooms["1"] == {"valid": 1.0, "parsed": 1.0, "success": 1.0}


def test_a_difference_pairs_rooms_within_a_seed_then_averages_the_seeds():
    def seed(*valid):
        return {str(i): {"valid": v, "parsed": v, "success": 0.0} for i, v in enumerate(valid)}

    plus = {0: seed(1.0, 0.5), 1: seed(0.5, 0.5), 2: seed(1.0, 1.0)}
    minus = {0: seed(0.5, 0.5), 1: seed(0.5, 0.0), 2: seed(0.0, 1.0)}
    diff = la.difference(plus, minus)["valid"]
    assert [diff["by_seed"][s]["mean"] for s in (0, 1, 2)] == [0.25, 0.25, 0.5]
    assert diff["over_seeds"]["mean"] == pytest.approx(1 / 3)
    with pytest.raises(AssertionError, match="different rooms"):
        la.paired(seed(1.0), seed(1.0, 1.0), "valid")
