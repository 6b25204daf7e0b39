"""One online arm of the Sokoban demo, with its knobs exposed: how the demo's RL settings were chosen.

    python experiments/sokoban/online_probe.py WARM_START --algo grpo --lr 1e-4 --iterations 40 \
        --tasks 32 --group-size 2 --mini-batches 4 [--group-norm cross_steps] [--invalid-penalty 0]
        [--eval-every 20] [--temperature 1.0] [--episodes 200] --out runs/sokoban/probe

``serl train --iterations K`` (``serl_cli.online.loop.run_online``) from ``WARM_START`` with
the demo's prompt (the grid alone, bare replies), sampling (T 1.0, 3 new tokens) and SERL
annotation (``error,diff`` on the flagged turns); then the final policy on the first 200
rooms of the test panel at T 0.4 and greedy, with 95 % Wilson intervals. One JSON line per
iteration on stdout, then one per evaluation.
"""

from __future__ import annotations

import argparse
import json
import time

from serl_cli.method.annotation import AnnotateConfig
from serl_cli.online.config import OnlineConfig, OnlineEvalConfig
from serl_cli.online.loop import run_online
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.evaluate import EvalConfig, run_eval
from serl_cli.stages.rollout import RolloutConfig
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig

SHOWN = ("iteration", "success_rate", "eval_success_rate", "loss", "weight_mean", "selected_fraction")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("warm_start")
    ap.add_argument("--algo", default="grpo")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--group-norm", default="cross_steps")
    ap.add_argument("--invalid-penalty", type=float, default=0.0)
    ap.add_argument("--eval-every", type=int, default=0, help="panel evaluation (200 rooms, T 0.4) every K iterations")
    ap.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    ap.add_argument("--episodes", type=int, default=200, help="panel rooms in each evaluation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    prompt = PromptConfig(history_turns=0, max_admissible=0, system=False, bare_replies=True)
    cfg = OnlineConfig(
        env=EnvConfig(name="sokoban", split="train"),
        model=args.warm_start,
        iterations=args.iterations,
        seed=args.seed,
        rollout=RolloutConfig(
            tasks=args.tasks,
            group_size=args.group_size,
            sampling=SamplingConfig(args.temperature, 1.0, 3),
            prompt=prompt,
        ),
        train=TrainConfig(
            algo=args.algo,
            optim=OptimConfig(lr=args.lr),
            mini_batches=args.mini_batches,
            group_norm=args.group_norm,
            invalid_action_penalty=args.invalid_penalty,
        ),
        annotate=AnnotateConfig(sources="error,diff", placement="feedback"),
        out=args.out,
    )
    if args.eval_every:
        cfg.eval = OnlineEvalConfig(episodes=args.episodes, every=args.eval_every, temperature=0.4)
    t0 = time.time()
    run_online(
        cfg,
        overwrite=True,
        on_iteration=lambda h: print(
            json.dumps(
                {k: round(v, 4) if isinstance(v, float) else v for k, v in h.items() if k in SHOWN}
                | {"t": round(time.time() - t0, 1)}
            ),
            flush=True,
        ),
    )
    for temperature in (0.4, 0.0):
        result = run_eval(
            EvalConfig(
                env=EnvConfig(name="sokoban", split=None),
                policy="model",
                model=f"{args.out}/checkpoint",
                episodes=args.episodes,
                temperature=temperature,
                max_new_tokens=3,
                history_turns=0,
                out=f"{args.out}/eval_T{temperature:g}",
            ),
            overwrite=True,
        )
        print(
            json.dumps(
                {"eval_temperature": temperature, "success": result["success_rate"], "ci95": result["success_ci95"]}
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
