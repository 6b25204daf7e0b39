"""One online arm of ``serl demo``, from a warm start already made: how the demo's RL settings are tried.

    python experiments/sokoban/demo_arm.py WARM_START --algo grpo --seed S \
        [--set online.train.optim.lr=2.0e-4 ...] [--episodes 500] --out DIR

The arm is exactly the one ``serl demo --seed S`` would run from ``WARM_START``
(``demo.config.online_arm_config``): the same prompt, rollouts, update, periodic evaluation on train rooms
and kept iterate. ``--set`` takes the demo's own keys (``online.*``, ``env.*``, as ``serl demo --set``
would), so a setting of ``online.*`` found here is one ``--set`` away from the demo. ``--set
env.max_turns=8`` shortens the arm's episodes here (its rollouts and train-room evaluations) while
the test panel plays the environment's own turn limit; in ``serl demo`` it would cut every stage's.

Then three policies play the first ``--episodes`` rooms of the test panel at the demo's evaluation
temperature (0.4), all with sampling seed 0, so they are compared on the same draws: the warm
start, the kept iterate (the demo's policy) and the last. Prints one JSON line, also appended to
``DIR/../demo_arm.jsonl``: the gains in points, and each rate with its 95 % Wilson interval (at 500
rooms about ±4 points; at the demo's 200, about ±7). The arm's settings are in ``DIR/online.yaml``.
Without the SFT that ``serl demo`` runs first, an arm takes about 3 minutes on one core, so two
settings run side by side on a 2-core machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from serl_cli.cli.common import save_resolved
from serl_cli.config import resolve
from serl_cli.demo.config import DemoConfig, online_arm_config, panel_eval_config
from serl_cli.demo.pipeline import best_iteration
from serl_cli.stages.evaluate import run_eval

EVAL_SEED = 0  # every policy on the same draws, whatever the arm's seed


def deadlocks(run: Path) -> dict:
    """How the arm's failed rollouts failed, over every ``iter_*/rollouts.jsonl`` of ``run``: the
    share of failed episodes in which a push deadlocked the room, the share of all trained turns
    that came after such a push (turns whose outcome no move could change any more), and the mean
    number of invalid moves (bumps) a deadlocked episode made before its deadlocking push."""
    failed = deadlocked = turns = after = bumps_before = 0
    for path in sorted(run.glob("iter_*/rollouts.jsonl")):
        for line in path.read_text().splitlines():
            played = json.loads(line)["turns"]
            turns += len(played)
            if any(t["info"].get("won") for t in played):
                continue
            failed += 1
            dead = [i for i, t in enumerate(played) if t["info"].get("deadlock")]
            if dead:
                deadlocked += 1
                after += len(played) - dead[0] - 1
                bumps_before += sum(bool(t["info"].get("invalid")) for t in played[: dead[0]])
    return {
        "failed_episodes": failed,
        "deadlocked_share": round(deadlocked / failed, 4) if failed else None,
        "turns_after_deadlock_share": round(after / turns, 4) if turns else None,
        "invalid_before_deadlock": round(bumps_before / deadlocked, 4) if deadlocked else None,
    }


def test_panel(cfg: DemoConfig, model: str, episodes: int, out: Path) -> dict:
    """``model`` on the first ``episodes`` rooms of the test panel, as the demo's last step plays them
    (``demo.config.panel_eval_config``), but with sampling seed 0 and the environment's own turn limit."""
    env = dataclasses.replace(cfg.env, max_turns=None)
    panel = dataclasses.replace(cfg, env=env, eval_episodes=episodes, seed=EVAL_SEED)
    r = run_eval(panel_eval_config(panel, model, out), overwrite=True)
    return {"success": r["success_rate"], "ci95": [round(x, 3) for x in r["success_ci95"]]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("warm_start", help="a checkpoint directory: serl demo's OUT/expert/checkpoint")
    ap.add_argument("--algo", default="grpo")
    ap.add_argument("--seed", type=int, default=0, help="the arm's seed, as serl demo --seed")
    ap.add_argument("--set", action="append", default=[], help="a serl demo setting, KEY=VALUE (repeatable)")
    ap.add_argument("--episodes", type=int, default=500, help="test-panel rooms for each policy")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = resolve(DemoConfig, config_file=None, flags={"seed": args.seed}, overrides=args.set,
                  base=dataclasses.asdict(DemoConfig()))  # fmt: skip
    out = Path(args.out)
    arm = online_arm_config(cfg, args.algo, args.warm_start)
    arm.out = str(out)
    from serl_cli.online.loop import run_online  # torch

    started = time.perf_counter()
    run_online(arm, overwrite=True, on_iteration=lambda h: None)
    wall = time.perf_counter() - started
    save_resolved(out, "online.yaml", arm)  # as `serl train --iterations` keeps its settings
    kept = best_iteration(out)
    policies = {"warm_start": args.warm_start, "last": str(out / "checkpoint")}
    if kept is not None:
        policies["kept"] = kept["checkpoint"]
    panel = {name: test_panel(cfg, model, args.episodes, out / f"test_{name}") for name, model in policies.items()}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    window = min(10, len(rows))
    result = {
        "out": str(out),
        "algo": args.algo,
        "seed": args.seed,
        "set": args.set,
        "iterations": len(rows),
        "wall_s": round(wall),
        "kept_iteration": kept and kept["iteration"],
        "kept_train_success": kept and kept["success"],
        "test": panel,
        "gain_points": {
            name: round(100 * (p["success"] - panel["warm_start"]["success"]), 1)
            for name, p in panel.items()
            if name != "warm_start"
        },
        # the rollouts' own success (T of the rollouts), first and last iterations: the training curve's ends
        "rollout_success_first": round(sum(r["success_rate"] for r in rows[:window]) / window, 4),
        "rollout_success_last": round(sum(r["success_rate"] for r in rows[-window:]) / window, 4),
        "deadlocks": deadlocks(out),
    }
    print(json.dumps(result), flush=True)
    with open(out.parent / "demo_arm.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
