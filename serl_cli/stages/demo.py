"""``serl demo``: the whole pipeline on the embedded default, in minutes on a laptop CPU.

1. the default tiny model for the environment (built on first use, then cached);
2. expert trajectories on the train split, tokenized for that model (``serl rollout --policy expert``);
3. an SFT warm start on them (``serl train RUN --algo sft``);
4. a few iterations of the online loop (``serl train --iterations K``, GRPO by default);
5. evaluation of the SFT and the final policy on the first tasks of the test panel, and
   of the expert as a reference, printed side by side.

Every step writes the same artifacts its own command would, under ``out``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

from serl_cli.artifacts import io
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.rollout.worlds import EnvConfig, build_world
from serl_cli.stages.evaluate import EvalConfig, run_eval
from serl_cli.stages.online import OnlineConfig, run_online
from serl_cli.stages.rollout import RolloutConfig, resolve_model, run_rollout
from serl_cli.stages.train import train_on_run
from serl_cli.training.learner import TrainConfig
from serl_cli.training.step import OptimConfig


@dataclass
class DemoConfig:
    # 10 turns: the expert needs about 6; a tiny model that never buys would burn 15 per episode
    env: EnvConfig = field(default_factory=lambda: EnvConfig(split="train", max_turns=10))
    model: str | None = None  # None: the embedded default tiny model
    expert_tasks: int = 60  # expert episodes for SFT
    # no history: the expert's next action depends only on the page and the task, and short
    # prompts let a tiny model take many more optimizer steps in the same CPU time
    prompt: PromptConfig = field(default_factory=lambda: PromptConfig(history_turns=0))
    sft: TrainConfig = field(default_factory=lambda: TrainConfig(
        algo="sft", epochs=4, mini_batches=32, optim=OptimConfig(lr=2e-3)))
    online: OnlineConfig = field(default_factory=lambda: OnlineConfig(
        iterations=2,
        rollout=RolloutConfig(tasks=4, group_size=4, sampling=SamplingConfig(1.0, 1.0, 32)),
        train=TrainConfig(algo="grpo", optim=OptimConfig(lr=5e-5))))
    eval_episodes: int = 30  # first tasks of the test panel
    seed: int = 0
    threads: int | None = None
    out: str = "runs/demo"


def run_demo(cfg: DemoConfig, *, overwrite: bool = False, log=print) -> dict:
    out = Path(cfg.out)
    io.prepare_output(out / "demo.json", overwrite=overwrite, what="a demo run")
    started = time.time()
    world = build_world(cfg.env)
    model = resolve_model(RolloutConfig(env=cfg.env, model=cfg.model), world)
    log(f"[1/5] model: {model}")

    expert_cfg = RolloutConfig(env=cfg.env, model=model, policy="expert", tasks=cfg.expert_tasks, group_size=1,
                               prompt=cfg.prompt, seed=cfg.seed, threads=cfg.threads, out=str(out / "expert"))
    s = run_rollout(expert_cfg, overwrite=True)
    log(f"[2/5] expert data: {s['episodes']} episodes, {s['turns']} turns")

    sft = copy.deepcopy(cfg.sft)
    sft.threads, sft.seed, sft.model = cfg.threads, cfg.seed, model
    m = train_on_run(str(out / "expert"), sft, overwrite=True)
    log(f"[3/5] SFT: {sft.epochs} epochs, final loss {m['loss']:.3f}")
    sft_model = str(out / "expert" / "checkpoint")

    online = copy.deepcopy(cfg.online)
    online.env, online.model, online.seed, online.out = cfg.env, sft_model, cfg.seed, str(out / "online")
    online.rollout.prompt, online.rollout.threads, online.train.threads = cfg.prompt, cfg.threads, cfg.threads
    history = run_online(online, overwrite=True,
                         on_iteration=lambda h: log(f"[4/5] {online.train.algo} iteration {h['iteration']}: "
                                                    f"reward {h['mean_reward']:.3f}, success {h['success_rate']:.3f}"))

    results = {}
    test = EnvConfig(cfg.env.name, "test", cfg.env.max_turns, cfg.env.settings)
    for name, policy, model_dir in (("expert", "expert", None), ("sft", "model", sft_model),
                                    (f"sft+{online.train.algo}", "model", str(out / "online" / "checkpoint"))):
        ecfg = EvalConfig(env=test, policy=policy, model=model_dir, episodes=cfg.eval_episodes, seed=cfg.seed,
                          history_turns=cfg.prompt.history_turns, threads=cfg.threads, out=str(out / f"eval_{name}"))
        results[name] = run_eval(ecfg, overwrite=True)
        log(f"[5/5] eval {name}: success {results[name]['success_rate']:.3f}, score {results[name]['score']:.1f}")
    summary = {"results": results, "iterations": len(history), "wall_time_s": round(time.time() - started, 1),
               "model": model}
    io.write_json(out / "demo.json", summary)
    return summary
