"""Environments stepping in worker processes (rollout.env_workers): the same episodes as in one process,
an environment's failure still ends only its episode, and a worker that dies ends the run in one line."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from envs.base import EnvError
from serl_cli.errors import SerlError
from serl_cli.rollout.engines import model_policy
from serl_cli.rollout.env_pool import EnvPool
from serl_cli.rollout.policies import ExpertPolicy
from serl_cli.rollout.runner import EpisodeSpec, run_episodes
from serl_cli.rollout.worlds import EnvConfig, build_world
from tests.reliability.test_env_isolation import ToyWorld
from tests.support import synthetic_env


def _specs(tasks: list[int], group: int = 2) -> list[EpisodeSpec]:
    return [EpisodeSpec(task_id=t, group_id=g, rollout_index=r) for g, t in enumerate(tasks) for r in range(group)]


def _run(env: EnvConfig, policy, specs, pool=None, batch_size: int = 4) -> list[dict]:
    records = run_episodes(
        build_world(env), env.split, specs, policy, max_turns=env.max_turns, batch_size=batch_size, pool=pool
    )
    return [dataclasses.asdict(r) for r in records]


@pytest.fixture(scope="module")
def sokoban_pool():
    pool = EnvPool(EnvConfig(name="sokoban", split="train", max_turns=4), workers=2)
    yield pool
    pool.close()


def test_a_model_policy_plays_the_same_episodes_in_two_workers_as_in_one_process(tiny_model_dir, sokoban_pool):
    env = EnvConfig(name="sokoban", split="train", max_turns=4)
    specs = _specs([3, 11, 7, 20, 5])  # ten episodes, four live at once: places are reused as episodes end

    def policy():
        return model_policy(str(tiny_model_dir), temperature=1.0, seed=5, max_new_tokens=4, threads=1)

    here = _run(env, policy(), specs)
    pooled = _run(env, policy(), specs, sokoban_pool)
    assert pooled == here
    assert sum(len(r["turns"]) for r in here) > len(specs)  # the episodes went on past their first turn


def test_the_noisy_expert_reads_its_episodes_through_the_workers(sokoban_pool):
    """Its detours and blunders ask the episode for its optimal and solvable moves: a call into the worker."""
    env = EnvConfig(name="sokoban", split="train", max_turns=4)
    specs = _specs([1, 2, 3, 4], group=2)
    here = _run(env, ExpertPolicy(noise=0.5, blunders=0.3, seed=2), specs)
    pooled = _run(env, ExpertPolicy(noise=0.5, blunders=0.3, seed=2), specs, sokoban_pool)
    assert pooled == here
    assert any(t["off_expert"] for r in here for t in r["turns"])  # the noise was drawn on


def test_webshop_episodes_are_the_same_in_two_workers(tiny_model_dir):
    env = synthetic_env(max_turns=3)
    specs = _specs([0, 4, 9], group=2)

    def policy():
        return model_policy(str(tiny_model_dir), temperature=1.0, seed=1, max_new_tokens=6, threads=1)

    pool = EnvPool(env, workers=2)
    try:
        assert _run(env, policy(), specs, pool) == _run(env, policy(), specs)
    finally:
        pool.close()


def make_faulty_world():  # spawn pickles a worker's world builder by name
    return ToyWorld({1: (2, "raise"), 4: (1, "sleep"), 5: (0, "raise")})


def make_bad_task_world():
    return ToyWorld({2: (0, "env-error")})


def test_an_environment_failing_in_a_worker_ends_only_its_episode():
    env = EnvConfig(name="toy", split="train", step_timeout_s=0.5)
    specs = [EpisodeSpec(task_id=t) for t in range(6)]
    pool = EnvPool(env, workers=2, step_timeout_s=0.5, make_world=make_faulty_world)
    try:
        pooled = run_episodes(make_faulty_world(), "train", specs, ExpertPolicy(), batch_size=3, pool=pool)
    finally:
        pool.close()
    here = run_episodes(make_faulty_world(), "train", specs, ExpertPolicy(), batch_size=3, step_timeout_s=0.5)
    assert [dataclasses.asdict(r) for r in pooled] == [dataclasses.asdict(r) for r in here]
    assert pooled[1].error == "environment raised ValueError: corrupt state in task 1"
    assert pooled[4].error == "environment timed out: no answer within 0.5 s (env.step_timeout_s)"
    assert pooled[5].turns == [] and pooled[5].error.startswith("environment raised ValueError")
    assert [pooled[t].success for t in (0, 2, 3)] == [True] * 3


def test_a_bad_task_id_in_a_worker_still_stops_the_run():
    pool = EnvPool(EnvConfig(name="toy", split="train"), workers=2, make_world=make_bad_task_world)
    try:
        with pytest.raises(EnvError, match="task 2 does not exist"):
            run_episodes(
                make_bad_task_world(), "train", [EpisodeSpec(task_id=t) for t in range(4)], ExpertPolicy(), pool=pool
            )
    finally:
        pool.close()


def test_a_worker_that_dies_ends_the_run_in_one_line():
    env = EnvConfig(name="sokoban", split="train", max_turns=3)
    pool = EnvPool(env, workers=2)
    try:
        _run(env, ExpertPolicy(), _specs([0, 1]), pool)  # both workers up and serving
        os.kill(pool._procs[1].pid, signal.SIGKILL)
        with pytest.raises(SerlError) as err:
            _run(env, ExpertPolicy(), _specs([0, 1]), pool)
    finally:
        pool.close()
    line = str(err.value)
    assert "\n" not in line and line.startswith("environment worker 1 of 2 (sokoban, pid ")
    assert "was killed by SIGKILL" in line


def test_a_call_that_raises_in_a_worker_is_raised_to_the_caller_and_the_worker_goes_on(sokoban_pool):
    from serl_cli.rollout.runner import InWorkers

    envs = InWorkers(sokoban_pool, "train", 4)
    ((ep, first),) = envs.start([0], [EpisodeSpec(task_id=2)])
    with pytest.raises(RuntimeError, match=r"optimal_actions\(\) raised TypeError"):
        ep.optimal_actions("an argument it does not take")
    assert ep.optimal_actions() and set(ep.optimal_actions()) <= set(first.admissible_actions)
    with pytest.raises(AttributeError):
        ep.no_such_method  # noqa: B018 -- only the episode's own public methods are offered
    envs.drop([ep])
