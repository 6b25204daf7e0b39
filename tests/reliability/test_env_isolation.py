"""An environment that raises or hangs ends that episode with a recorded error, not the run.

The environments here are real (tiny) implementations of ``envs.base``'s protocol that
misbehave on chosen tasks; the runner and the rollout stage are the real ones.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

import envs
from envs.base import EnvError, Feedback, Step, state_key
from serl_cli.rollout.env_step import time_limit
from serl_cli.rollout.policies import ExpertPolicy
from serl_cli.rollout.runner import EpisodeSpec, run_episodes


class ToyEpisode:
    """Three clicks to win. ``faults`` maps task id -> (turn, kind): at that step (turn 0 is
    reset) the episode raises, spins in a Python loop, or sleeps."""

    def __init__(self, faults: dict, max_turns: int):
        self.faults, self.max_turns = faults, max_turns
        self.task_id, self.turns, self.instruction = -1, 0, ""

    def _maybe_fail(self):
        turn, kind = self.faults.get(self.task_id, (None, None))
        if turn != self.turns:
            return
        if kind == "raise":
            raise ValueError(f"corrupt state in task {self.task_id}")
        if kind == "spin":
            while True:
                pass
        if kind == "sleep":
            time.sleep(3600)
        if kind == "env-error":
            raise EnvError(f"task {self.task_id} does not exist")

    def _step(self, reward=0.0, done=False) -> Step:
        obs = f"task {self.task_id} page {self.turns}"
        return Step(
            obs,
            reward,
            done,
            Feedback(None, "page changed"),
            ["click[next]"],
            state_key(obs),
            "click[next]",
            {"won": done},
        )

    def reset(self, task_id: int) -> Step:
        self.task_id, self.turns, self.instruction = task_id, 0, f"reach page 3 of task {task_id}"
        self._maybe_fail()
        return self._step()

    def step(self, action: str) -> Step:
        self.turns += 1
        self._maybe_fail()
        return self._step(reward=float(self.turns == 3), done=self.turns == 3)


class ToyWorld:
    name = "toy"
    rules = "Click next three times."

    def __init__(self, faults: dict | None = None):
        self.faults = faults or {}

    def splits(self):
        return ["train", "test"]

    def num_tasks(self, split):
        return 6

    def new_episode(self, split, max_turns=None):
        return ToyEpisode(self.faults, max_turns or 10)


def run(faults: dict, timeout: float | None = None, batch_size: int = 3) -> list:
    return run_episodes(
        ToyWorld(faults),
        "train",
        [EpisodeSpec(task_id=t) for t in range(6)],
        ExpertPolicy(),
        batch_size=batch_size,
        step_timeout_s=timeout,
    )


def test_healthy_world_every_episode_wins():
    records = run({})
    assert [r.success for r in records] == [True] * 6 and all(r.error is None for r in records)


def test_a_raising_step_ends_only_its_episode():
    records = run({1: (2, "raise")})
    bad = records[1]
    assert bad.error == "environment raised ValueError: corrupt state in task 1"
    assert bad.truncated and not bad.success and bad.reward == 0.0
    assert bad.num_turns == 1 == len(bad.turns)  # the turn whose step failed has no next state: not recorded
    assert all(r.success and r.error is None for i, r in enumerate(records) if i != 1)


@pytest.mark.parametrize("kind", ["spin", "sleep"])
def test_a_hanging_step_times_out(kind):
    t0 = time.monotonic()
    records = run({4: (1, kind)}, timeout=0.5)
    assert time.monotonic() - t0 < 30
    assert records[4].error == "environment timed out: no answer within 0.5 s (env.step_timeout_s)"
    assert records[4].num_turns == 0 and records[4].truncated
    assert all(r.success for i, r in enumerate(records) if i != 4)


def test_an_outer_timer_is_put_back_with_the_time_it_has_left():
    """A test runner's own SIGALRM limit (pytest-timeout) survives the step limits inside it."""
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(time.monotonic()))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        run({}, timeout=0.5)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 20.0 < left < 30.0 and not fired
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with time_limit(5.0):
            time.sleep(0.5)  # the outer timer's time runs out inside the block: it fires on the way out
        time.sleep(0.05)
        assert len(fired) == 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_failing_reset_records_an_empty_episode_and_the_queue_moves_on():
    records = run({0: (0, "raise"), 5: (0, "spin")}, timeout=0.5, batch_size=1)
    assert records[0].turns == [] and records[0].error.startswith("environment raised ValueError")
    assert records[5].turns == [] and "timed out" in records[5].error
    assert [r.success for r in records[1:5]] == [True] * 4


def test_bad_task_id_at_reset_still_stops_the_run():
    with pytest.raises(EnvError, match="does not exist"):
        run({2: (0, "env-error")})


def test_rollout_stage_records_env_errors(tiny_model_dir, tmp_path, monkeypatch):
    from serl_cli.artifacts.schema import read_rollouts
    from serl_cli.rollout.worlds import EnvConfig
    from serl_cli.stages.rollout import RolloutConfig, run_rollout

    monkeypatch.setitem(envs._REGISTRY, "toy", lambda **settings: ToyWorld({1: (1, "raise"), 3: (2, "sleep")}))
    cfg = RolloutConfig(
        env=EnvConfig(name="toy", split="train", step_timeout_s=0.5),
        model=str(tiny_model_dir),
        policy="expert",
        tasks=6,
        group_size=1,
        threads=1,
        out=str(tmp_path / "run"),
    )
    summary = run_rollout(cfg)
    assert summary["episodes"] == 6 and summary["env_errors"] == 2
    episodes = read_rollouts(tmp_path / "run")  # a record with an error is still a valid record
    errors = {e.task_id: e.error for e in episodes if e.error}
    assert errors.keys() == {1, 3} and "timed out" in errors[3] and "ValueError" in errors[1]
    saved = json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]["rollout"]
    assert saved["status"] == "done" and saved["config"]["env"]["step_timeout_s"] == 0.5
