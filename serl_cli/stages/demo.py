"""``serl demo``: the whole pipeline on the embedded default, in minutes on a laptop CPU.

On Sokoban, the default (no data download), it shows a model learning:

1. the embedded ``micro`` model for the environment (0.9M parameters, built on first use,
   then cached);
2. noisy-expert data on train rooms (``serl rollout --policy expert`` with ``expert_noise``
   and ``expert_blunders``): the expert's moves, and random detours and blunders marked
   ``off_expert`` that only serve to reach the states a learner's mistakes lead to;
3. one warm start: SFT on the expert's moves, plus ``train.hindsight_sft``, the same
   network trained to read the hindsight block SERL's teacher is shown (a small-scale
   necessity: a model trained from scratch cannot read one otherwise, ``method.hindsight_sft``);
4. from that same warm start, each online algorithm of ``algos`` (GRPO and SERL):
   ``serl train --iterations K``. Both arms start from the hindsight-capable warm start, so
   the comparison is of the update alone; GRPO never looks at a block, so the extra
   examples only give it a slightly different start;
5. the expert (a reference), the warm start and every arm on the first tasks of the test
   panel, with 95 % Wilson intervals: sampled at ``eval_temperature`` (0.4, the paper's
   validation setting; greedy decoding of a small model repeats a bump into a wall until
   the turn limit), and SERL's teacher signal where the annotation measured it.

Any other environment (``--env webshop``) runs the original demo: the tiny model, plain
expert data, SFT, two GRPO iterations and a greedy evaluation (:func:`demo_defaults`).

Every step writes the same artifacts its own command would, under ``out``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

from serl_cli.artifacts import io
from serl_cli.artifacts.schema import SELECTION_REPORT_FILE
from serl_cli.errors import SerlError
from serl_cli.method.annotation import AnnotateConfig
from serl_cli.rollout.default_model import default_model_dir
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.rollout.worlds import EnvConfig, build_world
from serl_cli.stages.evaluate import EvalConfig, run_eval
from serl_cli.stages.online import OnlineConfig, run_online
from serl_cli.stages.rollout import RolloutConfig, run_rollout
from serl_cli.stages.train import train_on_run
from serl_cli.training.learner import TrainConfig
from serl_cli.training.step import OptimConfig


@dataclass
class DemoConfig:
    env: EnvConfig = field(default_factory=lambda: EnvConfig(name="sokoban", split="train"))
    model: str | None = None  # None: the embedded default model of `preset` for the environment
    preset: str = "micro"
    expert_tasks: int = 2000  # noisy-expert episodes for the warm start
    expert_noise: float = 0.2
    expert_blunders: float = 0.1
    # the grid alone: a model trained from scratch gains nothing from constant text and pays for every token of it
    prompt: PromptConfig = field(default_factory=lambda: PromptConfig(history_turns=0, max_admissible=0, system=False))
    sft: TrainConfig = field(default_factory=lambda: TrainConfig(
        algo="sft", mini_batches=150, optim=OptimConfig(lr=1e-3, betas=(0.9, 0.95)), hindsight_sft="error,diff"))
    online: OnlineConfig = field(default_factory=lambda: OnlineConfig(
        iterations=20,
        rollout=RolloutConfig(tasks=8, group_size=8, sampling=SamplingConfig(1.0, 1.0, 8)),
        train=TrainConfig(optim=OptimConfig(lr=1e-4)),
        annotate=AnnotateConfig(sources="error,diff", placement="feedback")))
    algos: list[str] = field(default_factory=lambda: ["grpo", "serl"])  # online arms, each from the warm start
    eval_episodes: int = 200  # first tasks of the test panel
    eval_temperature: float = 0.4  # 0: greedy
    eval_max_new_tokens: int = 8
    seed: int = 0
    threads: int | None = None
    out: str = "runs/demo"


def demo_defaults(env_name: str) -> DemoConfig:
    """The demo's settings for an environment: Sokoban's (above), or for any other
    environment the original WebShop demo's, unchanged."""
    if env_name == "sokoban":
        return DemoConfig()
    return DemoConfig(
        # 10 turns: the expert needs about 6; a tiny model that never buys would burn 15 per episode
        env=EnvConfig(name=env_name, split="train", max_turns=10), preset="tiny", expert_tasks=60,
        expert_noise=0.0, expert_blunders=0.0,
        # no history: the expert's next action depends only on the page and the task, and short
        # prompts let a tiny model take many more optimizer steps in the same CPU time
        prompt=PromptConfig(history_turns=0),
        sft=TrainConfig(algo="sft", epochs=4, mini_batches=32, optim=OptimConfig(lr=2e-3)),
        online=OnlineConfig(iterations=2, rollout=RolloutConfig(tasks=4, group_size=4, sampling=SamplingConfig(1.0, 1.0, 32)),
                            train=TrainConfig(algo="grpo", optim=OptimConfig(lr=5e-5))),
        algos=["grpo"], eval_episodes=30, eval_temperature=0.0, eval_max_new_tokens=48)


def quick(cfg: DemoConfig) -> DemoConfig:
    """``cfg`` as a smoke run (``serl demo --quick``): every stage, at sizes that take seconds."""
    q = copy.deepcopy(cfg)
    q.expert_tasks = min(q.expert_tasks, 16)
    q.sft.epochs, q.sft.mini_batches = 1, 2
    q.online.iterations = 1
    q.online.rollout.tasks, q.online.rollout.group_size = 2, 2
    q.eval_episodes = min(q.eval_episodes, 4)
    return q


def run_demo(cfg: DemoConfig, *, overwrite: bool = False, log=print) -> dict:
    out = Path(cfg.out)
    if not cfg.algos:
        raise SerlError("the demo needs at least one online algorithm in `algos`")
    io.prepare_output(out / "demo.json", overwrite=overwrite, what="a demo run")
    started = time.time()
    world = build_world(cfg.env)
    model = cfg.model or str(default_model_dir(world, cfg.env.name, cfg.preset))
    steps = 4 + len(cfg.algos)
    log(f"[1/{steps}] model: {model}")

    expert_cfg = RolloutConfig(env=cfg.env, model=model, policy="expert", tasks=cfg.expert_tasks, group_size=1,
                               expert_noise=cfg.expert_noise, expert_blunders=cfg.expert_blunders, prompt=cfg.prompt,
                               seed=cfg.seed, threads=cfg.threads, out=str(out / "expert"))
    s = run_rollout(expert_cfg, overwrite=True)
    log(f"[2/{steps}] expert data: {s['episodes']} episodes, {s['turns']} turns")

    sft = copy.deepcopy(cfg.sft)
    sft.threads, sft.seed, sft.model = cfg.threads, cfg.seed, model
    m = train_on_run(str(out / "expert"), sft, overwrite=True)
    hindsight = f", {m['hindsight_examples']} hindsight examples" if "hindsight_examples" in m else ""
    log(f"[3/{steps}] warm start (SFT): {m['turns']} examples{hindsight}, {m['optimizer_steps']} steps, "
        f"mean loss {m['loss']:.3f}")
    policies = {"expert": None, "warm start": str(out / "expert" / "checkpoint")}

    for k, algo in enumerate(cfg.algos, start=4):
        online = _online_arm(cfg, algo, policies["warm start"])
        run_online(online, overwrite=True,
                   on_iteration=lambda h, algo=algo, k=k: log(
                       f"[{k}/{steps}] {algo} iteration {h['iteration']}: "
                       f"reward {h['mean_reward']:.3f}, success {h['success_rate']:.3f}"))
        policies[f"warm start + {algo}"] = str(Path(online.out) / "checkpoint")

    results = {name: _evaluate(cfg, name, model_dir, log, steps) for name, model_dir in policies.items()}
    summary = {"results": results, "iterations": cfg.online.iterations, "wall_time_s": round(time.time() - started, 1),
               "model": model, "eval_temperature": cfg.eval_temperature}
    if "serl" in cfg.algos:
        summary["teacher_signal"] = teacher_signal(out / "serl")
    io.write_json(out / "demo.json", summary)
    return summary


def _online_arm(cfg: DemoConfig, algo: str, warm_start: str) -> OnlineConfig:
    online = copy.deepcopy(cfg.online)
    online.env, online.model, online.seed, online.out = cfg.env, warm_start, cfg.seed, str(Path(cfg.out) / algo)
    online.train.algo = algo
    online.rollout.prompt, online.rollout.threads, online.train.threads = cfg.prompt, cfg.threads, cfg.threads
    return online


def _evaluate(cfg: DemoConfig, name: str, model_dir: str | None, log, steps: int) -> dict:
    """One row of the table: ``name`` on the first ``eval_episodes`` tasks of the test panel."""
    test = EnvConfig(cfg.env.name, None, cfg.env.max_turns, cfg.env.settings)  # None: the evaluation split
    ecfg = EvalConfig(env=test, policy="expert" if model_dir is None else "model", model=model_dir,
                      episodes=cfg.eval_episodes, seed=cfg.seed, temperature=cfg.eval_temperature,
                      history_turns=cfg.prompt.history_turns, max_new_tokens=cfg.eval_max_new_tokens,
                      threads=cfg.threads, out=str(Path(cfg.out) / f"eval_{name.replace(' + ', '+').replace(' ', '_')}"))
    result = run_eval(ecfg, overwrite=True)
    log(f"[{steps}/{steps}] eval {name}: success {result['success_rate']:.3f}")
    return result


def teacher_signal(run: Path) -> dict | None:
    """SERL's teacher signal over an online run: each iteration's
    ``selection_report.json["teacher"]["teacher_signal"]`` (``method.teacher_signal``),
    pooled weighted by scored turns. None where no iteration measured one."""
    signals = []
    for path in sorted(run.glob(f"iter_*/{SELECTION_REPORT_FILE}")):
        try:
            signal = io.read_json(path)["teacher"]["teacher_signal"]
            turns, right, gain = int(signal["turns"]), signal["right_direction"], signal["expert_prob_gain"]
        except (SerlError, KeyError, TypeError, ValueError):
            continue  # an iteration that measured none (or an older report): left out
        if turns > 0 and isinstance(right, (int, float)) and isinstance(gain, (int, float)):
            signals.append((turns, float(right), float(gain)))
    if not signals:
        return None
    n = sum(t for t, _, _ in signals)
    return {"turns": n, "iterations": len(signals), "right_direction": sum(t * r for t, r, _ in signals) / n,
            "expert_prob_gain": sum(t * g for t, _, g in signals) / n}
