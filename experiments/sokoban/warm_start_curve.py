"""Success of the Sokoban warm start against SFT steps: the curve behind the demo's choice.

    serl rollout --config experiments/sokoban/expert.yaml --out runs/sokoban/expert
    python experiments/sokoban/warm_start_curve.py runs/sokoban/expert [--every 20] [--steps 400]
           [--batch 128] [--lr 1e-3] [--hindsight error,diff] [--episodes 200] [--save 200,250] [--out FILE]

The SFT of ``serl train RUN --algo sft`` (the same examples, hindsight ones included with
``--hindsight``, and the same ``Learner``), cut into updates of ``--every`` optimizer steps
of ``--batch`` examples each, drawn in a seeded shuffle, a new shuffle each pass; after
each update the policy plays the first ``--episodes`` rooms of the test panel, sampled at
T 0.4 and greedy. Those are the checkpoints a single ``serl train`` run of that many steps
would pass through, up to which examples fall into which step.

The jump from a few per cent to most rooms solved is sharp and comes after a long flat
stretch, so the steps that land a warm start in 15-50 % are read off this curve.
Writes the curve as JSON (``--out``, default ``RUN/warm_start_curve.json``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace
from pathlib import Path

from serl_cli.artifacts import io
from serl_cli.artifacts.records import Episode
from serl_cli.artifacts.schema import read_rollouts
from serl_cli.rollout.engines import ModelPolicy, SamplingConfig, make_engine
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.evaluate import EvalConfig, run_eval
from serl_cli.stages.train import hindsight_sft_examples
from serl_cli.training.learner import Learner, training_episodes
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig

TEMPERATURES = (0.4, 0.0)


def examples(run: Path, cfg: TrainConfig, tokenizer) -> list[Episode]:
    """Every SFT example of the run as a one-turn episode: the expert's turns and the hindsight ones."""
    rollout_cfg = io.load_manifest(run)["stages"]["rollout"]["config"]
    episodes = training_episodes(read_rollouts(run), cfg, run)
    episodes += hindsight_sft_examples(episodes, cfg, tokenizer, rollout_cfg)
    return [replace(e, turns=[t]) for e in episodes for t in e.turns if not t.off_expert]


def evaluate(learner: Learner, prompt: PromptConfig, env: EnvConfig, episodes: int, out: Path) -> dict:
    engine = make_engine("hf", learner.model, learner.tokenizer)
    row = {}
    for t in TEMPERATURES:
        policy = ModelPolicy(engine, SamplingConfig(t, 1.0, 3), prompt, seed=0)
        ecfg = EvalConfig(
            env=env, policy="model", episodes=episodes, temperature=t, history_turns=prompt.history_turns, out=str(out)
        )
        row[f"success_T{t:g}"] = run_eval(ecfg, overwrite=True, policy=policy)["success_rate"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hindsight", default=None, help="train.hindsight_sft sources (default: none)")
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--save", default="", help="comma-separated steps whose policy is saved to RUN/warm_start_STEP")
    args = ap.parse_args()
    run = Path(args.run)
    manifest = io.load_manifest(run)["stages"]["rollout"]["config"]
    prompt, env = PromptConfig(**manifest["prompt"]), EnvConfig(name=manifest["env"]["name"], split=None)
    cfg = TrainConfig(
        algo="sft", optim=OptimConfig(lr=args.lr), mini_batches=args.every, hindsight_sft=args.hindsight, seed=args.seed
    )
    learner = Learner(manifest["model"], cfg)
    pool = examples(run, cfg, learner.tokenizer)
    rng, order, curve, train_s = random.Random(args.seed), [], [], 0.0
    for step in range(args.every, args.steps + 1, args.every):
        while len(order) < args.every * args.batch:  # a new seeded shuffle each pass over the examples
            order += rng.sample(range(len(pool)), len(pool))
        chunk, order = order[: args.every * args.batch], order[args.every * args.batch :]
        t0 = time.time()
        loss = learner.update([pool[i] for i in chunk], 1.0)["loss"]
        train_s += time.time() - t0
        row = {
            "step": step,
            "loss": round(loss, 4),
            "train_s": round(train_s, 1),
            **evaluate(learner, prompt, env, args.episodes, run / "curve_eval"),
        }
        curve.append(row)
        if step in {int(s) for s in args.save.split(",") if s}:
            learner.save(run / f"warm_start_{step}", prompt)
        print(json.dumps(row), flush=True)
    out = Path(args.out) if args.out else run / "warm_start_curve.json"
    io.write_json(
        out,
        {
            "run": str(run),
            "examples": len(pool),
            "batch": args.batch,
            "lr": args.lr,
            "hindsight_sft": args.hindsight,
            "episodes": args.episodes,
            "curve": curve,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
