"""``serl demo``'s settings (:class:`DemoConfig`) and the configs of the stages it runs, derived
from them: the expert data, each online arm, the panel evaluation. The pipeline that runs them, and
why each default is what it is, is ``demo.pipeline``.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, replace
from pathlib import Path

from serl_cli.config import setting
from serl_cli.method.annotate_config import AnnotateConfig
from serl_cli.online.config import OnlineConfig, OnlineEvalConfig
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.evaluate import EvalConfig
from serl_cli.stages.rollout import RolloutConfig
from serl_cli.stages.warm_start import WarmStartConfig
from serl_cli.training.train_config import OptimConfig, TrainConfig


@dataclass
class DemoConfig:
    env: EnvConfig = setting(
        factory=lambda: EnvConfig(name="sokoban", split="train"), doc="the environment: sokoban (default) or webshop"
    )
    model: str | None = setting(None, "the starting model; null: the embedded default model of `preset`")
    preset: str | None = setting(
        None, "the default model's size; null: the environment's own (Sokoban: micro, 0.9M parameters; others: tiny)"
    )
    expert_tasks: int = setting(2000, "noisy-expert episodes for the warm start")
    expert_noise: float = setting(0.2, "random detours: the states a learner's mistakes lead to")
    expert_blunders: float = setting(0.1, "deadlocking pushes: the mistakes hindsight SFT teaches the teacher to read")
    prompt: PromptConfig = setting(
        factory=lambda: PromptConfig(history_turns=0, max_admissible=0, system=False, bare_replies=True),
        doc="the grid alone, bare replies: a model trained from scratch gains nothing from constant text and "
        "pays for every token of it; with tagged replies it sits at chance for hundreds of steps (PromptConfig)",
    )
    sft: TrainConfig = setting(
        factory=lambda: TrainConfig(algo="sft", epochs=4, mini_batches=150, optim=OptimConfig(lr=1e-3)),
        doc="the warm start, ~76 examples a step; with warm_start, epochs is the most SFT may run (600 steps; seeds "
        "0-2 and 4 reached the band in 260-390, seed 3 ended below it: at lr 5e-4 every seed 0-6 reached it, but RL "
        "from those starts gained less on seeds 0 and 1, docs/studies/sokoban_testbed.md). No hindsight SFT: from "
        "the start that has it, RL gained half as much (docs/RESULTS.md, the demo)",
    )
    warm_start: WarmStartConfig | None = setting(
        factory=WarmStartConfig,
        doc="SFT stops in this band of success on train rooms (stages.warm_start); null: sft's steps, all of them",
    )
    online: OnlineConfig = setting(
        factory=lambda: OnlineConfig(
            iterations=80,
            rollout=RolloutConfig(tasks=32, group_size=2, sampling=SamplingConfig(1.0, 1.0, 3)),
            train=TrainConfig(optim=OptimConfig(lr=1e-4), group_norm="cross_steps", mini_batches=4),
            # the turns the environment flagged (a bump, a blocked push, a deadlock), shown with what they changed
            annotate=AnnotateConfig(sources="error,diff", placement="feedback"),
            eval=OnlineEvalConfig(episodes=100, every=10, split="train", temperature=0.4),
            save_every=10,
            keep_last=0,
        ),
        doc="each online arm: many rooms, small groups (updates from 8 rooms at a time fit those rooms and lose "
        "the panel); cross_steps pools a group's turns, so the long failed episodes do not outweigh the short "
        "wins; four optimizer steps an iteration cost no more compute than one and moved the panel +9 points in "
        "40 iterations where one step moved it +0.5 (docs/RESULTS.md, the Sokoban demo). Each arm's policy is "
        "its best checkpoint, not its last: every 10 iterations it plays the first 100 train rooms at the "
        "evaluation's temperature (the test panel only scores); the last iterate is a noisy draw "
        "(docs/studies/sokoban_testbed.md)",
    )
    arm_settings: dict = setting(
        factory=lambda: {"end_on_deadlock": True},
        doc="environment settings the online arms add to env.settings (their rollouts and train-room checks; "
        "the expert data, the warm start and the test panel play env as it is). Sokoban's end_on_deadlock: a "
        "deadlocking push ends the episode, so an update no longer trains on the turns after a room was lost "
        "(34-49 % of them) and an iteration takes half the time (docs/studies/sokoban_testbed.md, the demo)",
    )
    algos: list[str] = setting(factory=lambda: ["grpo", "serl"], doc="online arms, each from the warm start")
    parallel_arms: bool = setting(True, "the arms side by side, one process each, the cores shared out between them")
    eval_episodes: int = setting(
        500,
        "first tasks of the test panel (all 500 on Sokoban): a gain's paired 95 % interval is about +/-4.5 points, "
        "against +/-6.5 on 200 rooms, for seconds of evaluation (docs/studies/sokoban_testbed.md, the demo)",
    )
    eval_temperature: float = setting(0.4, "0: greedy")
    eval_max_new_tokens: int = setting(3, "a bare move and the end of the turn, with one token to spare")
    seed: int = setting(0, "every stage's seed")
    threads: int | None = setting(
        1, "torch threads per process (demo.pipeline's docstring); null: the stages' own default"
    )
    out: str = setting("runs/demo", "the directory for every artifact of the demo")


def demo_defaults(env_name: str) -> DemoConfig:
    """The demo's settings for an environment: Sokoban's (above), or for any other
    environment the original WebShop demo's, unchanged."""
    if env_name == "sokoban":
        return DemoConfig()
    return DemoConfig(
        # 10 turns: the expert needs about 6; a tiny model that never buys would burn 15 per episode
        env=EnvConfig(name=env_name, split="train", max_turns=10),
        preset="tiny",
        expert_tasks=60,
        expert_noise=0.0,
        expert_blunders=0.0,
        # no history: the expert's next action depends only on the page and the task, and short
        # prompts let a tiny model take many more optimizer steps in the same CPU time
        prompt=PromptConfig(history_turns=0),
        sft=TrainConfig(algo="sft", epochs=4, mini_batches=32, optim=OptimConfig(lr=2e-3)),
        warm_start=None,  # the tiny model never solves a WebShop task in this budget: no band to aim at
        arm_settings={},
        online=OnlineConfig(
            iterations=2,
            rollout=RolloutConfig(tasks=4, group_size=4, sampling=SamplingConfig(1.0, 1.0, 32)),
            train=TrainConfig(algo="grpo", optim=OptimConfig(lr=5e-5)),
        ),
        algos=["grpo"],
        eval_episodes=30,
        eval_temperature=0.0,
        eval_max_new_tokens=48,
    )


QUICK_OUT = "runs/demo-quick"  # serl demo --quick's folder, unless --out names another


def quick(cfg: DemoConfig) -> DemoConfig:
    """``cfg`` as a smoke run (``serl demo --quick``): every stage, at sizes that take seconds."""
    q = copy.deepcopy(cfg)
    q.expert_tasks = min(q.expert_tasks, 16)
    q.sft.epochs, q.sft.mini_batches = 1, 2
    if q.warm_start is not None:
        q.warm_start.every, q.warm_start.every_near, q.warm_start.rooms = 1, 1, 4
    q.online.iterations = 1
    q.online.eval.episodes, q.online.eval.every, q.online.save_every = min(q.online.eval.episodes, 2), 1, 1
    q.online.rollout.tasks, q.online.rollout.group_size = 2, 2
    q.eval_episodes = min(q.eval_episodes, 4)
    if q.out == DemoConfig().out:  # its own folder: `serl demo --quick` then `serl demo` must not collide
        q.out = QUICK_OUT
    return q


def expert_data_config(cfg: DemoConfig, model: str, out: str | Path) -> RolloutConfig:
    """The demo's step 2: the noisy-expert games the warm start learns from, written to ``out``."""
    return RolloutConfig(
        env=cfg.env,
        model=model,
        policy="expert",
        tasks=cfg.expert_tasks,
        group_size=1,
        expert_noise=cfg.expert_noise,
        expert_blunders=cfg.expert_blunders,
        prompt=cfg.prompt,
        seed=cfg.seed,
        threads=cfg.threads,
        out=str(out),
    )


def online_arm_config(cfg: DemoConfig, algo: str, warm_start: str) -> OnlineConfig:
    """The online run of one arm. Side by side, each arm gets its share of the cores."""
    online = copy.deepcopy(cfg.online)
    online.env = replace(cfg.env, settings={**cfg.env.settings, **cfg.arm_settings})
    online.model, online.seed, online.out = warm_start, cfg.seed, str(Path(cfg.out) / algo)
    online.train.algo = algo
    threads = cfg.threads
    if threads is None and cfg.parallel_arms and len(cfg.algos) > 1:
        threads = max(1, (os.cpu_count() or 1) // len(cfg.algos))
    online.rollout.prompt, online.rollout.threads, online.train.threads = cfg.prompt, threads, threads
    return online


def panel_eval_config(cfg: DemoConfig, model_dir: str | None, out: str | Path) -> EvalConfig:
    """How the demo scores a policy (None: the expert): the first ``eval_episodes`` tasks of the
    test panel, at ``eval_temperature`` with the demo's seed, as the arms were prompted."""
    return EvalConfig(
        env=EnvConfig(cfg.env.name, None, cfg.env.max_turns, cfg.env.settings),  # None: the evaluation split
        policy="expert" if model_dir is None else "model",
        model=model_dir,
        episodes=cfg.eval_episodes,
        seed=cfg.seed,
        temperature=cfg.eval_temperature,
        history_turns=cfg.prompt.history_turns,
        max_new_tokens=cfg.eval_max_new_tokens,
        threads=cfg.threads,
        out=str(out),
    )
