"""``experiments/sokoban/demo_arm.py``: one arm of ``serl demo`` from a given warm start, with the
demo's own ``--set`` keys, then the warm start, the kept and the last iterate on the test panel."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from envs.sokoban.env import SokobanWorld
from serl_cli.artifacts import io
from serl_cli.demo.pipeline import best_iteration
from serl_cli.models.tiny import init_model
from serl_cli.rollout.default_model import tokenizer_corpus

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "sokoban" / "demo_arm.py"


def _demo_arm_module():
    spec = importlib.util.spec_from_file_location("demo_arm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deadlock_shares_by_hand(tmp_path):
    def episode(n: int, *, won: bool = False, deadlock_at: int | None = None) -> str:
        turns = [
            {"info": {"won": won and i == n - 1, "deadlock": "corner" if i == deadlock_at else None, "invalid": i == 0}}
            for i in range(n)
        ]
        return json.dumps({"turns": turns})

    (tmp_path / "iter_0000").mkdir()
    (tmp_path / "iter_0001").mkdir()
    (tmp_path / "iter_0000" / "rollouts.jsonl").write_text(episode(2, won=True) + "\n" + episode(5, deadlock_at=1))
    (tmp_path / "iter_0001" / "rollouts.jsonl").write_text(episode(3) + "\n")
    # 2 failed episodes, 1 deadlocked; 10 turns, 3 of them after the deadlocking push (turns 2, 3, 4 of 5);
    # every episode bumps on its first turn, so the deadlocked one bumped once before its push
    assert _demo_arm_module().deadlocks(tmp_path) == {
        "failed_episodes": 2,
        "deadlocked_share": 0.5,
        "turns_after_deadlock_share": 0.3,
        "invalid_before_deadlock": 1.0,
    }


@pytest.mark.slow
def test_demo_arm_runs_the_demo_s_arm_with_its_settings_and_scores_three_policies(tmp_path, capsys):
    micro = init_model("micro", tmp_path / "micro", tokenizer_corpus(SokobanWorld(), episodes=50))
    out = tmp_path / "arms" / "grpo"
    small = ["online.iterations=2", "online.rollout.tasks=2", "online.eval.episodes=2", "online.eval.every=1"]
    settings = [*small, "online.save_every=1", "online.train.optim.lr=2.0e-4", "env.max_turns=3"]
    argv = [str(micro), "--algo", "grpo", "--seed", "1", "--episodes", "4", "--out", str(out)]
    result = _demo_arm_module().main([*argv, *[a for s in settings for a in ("--set", s)]])

    # the demo's arm, with the settings given: 2 iterations, lr 2e-4, episodes cut at 3 turns
    arm = yaml.safe_load((out / "online.yaml").read_text())
    assert (
        arm["iterations"] == 2
        and arm["env"]["max_turns"] == 3
        and arm["train"]["optim"]["lr"] == 2.0e-4
        and arm["seed"] == 1
    )
    train_turns = [len(json.loads(line)["turns"]) for line in (out / "iter_0001" / "rollouts.jsonl").open()]
    assert len(train_turns) == 4 and max(train_turns) <= 3
    # the test panel plays the environment's own turn limit: a random model fails and runs past 3 turns
    test_turns = [json.loads(line)["num_turns"] for line in (out / "test_last" / "episodes.jsonl").open()]
    assert len(test_turns) == 4 and max(test_turns) > 3

    # the kept iterate is the demo's choice, and each gain is its rate minus the warm start's
    kept = best_iteration(out)
    assert result["kept_iteration"] == kept["iteration"] in (1, 2) and result["iterations"] == 2
    test = result["test"]
    for name in ("kept", "last"):
        assert result["gain_points"][name] == round(100 * (test[name]["success"] - test["warm_start"]["success"]), 1)
        assert io.read_json(out / f"test_{name}" / "eval.json")["episodes"] == 4
    assert result["deadlocks"] == _demo_arm_module().deadlocks(out)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert json.loads((out.parent / "demo_arm.jsonl").read_text().splitlines()[-1]) == result
