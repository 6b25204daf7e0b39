"""Sokoban environment speed: room generation, solver tables, resets, and step latency.

    python -m benchmarks.env_sokoban [--episodes 500] [--seed 0] [--out FILE]

On one thread over the test panel: a fresh world pays each room's generation and solver
table on its first reset (the table alone is timed again beside it); later passes reset
from the cached rooms. Steps are timed under a seeded random policy (it walks into walls,
pushes boxes and deadlocks, so every branch is timed) with ``Step.expert_action`` filled
in (first visits of a state pay its lookup of four successors, later ones a dict hit) and
left out, and under the expert itself.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from benchmarks.common import percentiles_ms, report
from envs.sokoban.env import SokobanWorld
from envs.sokoban.solver import Solver


@dataclass
class EnvBench:
    episodes: int = 500
    seed: int = 0


def measure(cfg: EnvBench) -> dict:
    world = SokobanWorld()
    n = min(cfg.episodes, world.num_tasks("test"))
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "reset, new room",
            "reset, cached room",
            "solver table",
            "step, random, expert off",
            "step, random, expert on",
            "step, expert",
        )
    }
    ep = world.new_episode("test")
    for task in range(n):
        t = time.perf_counter()
        ep.reset(task)
        times["reset, new room"].append(time.perf_counter() - t)
        t = time.perf_counter()
        Solver(world.room("test", task))
        times["solver table"].append(time.perf_counter() - t)

    def run(policy: str, expert: bool) -> list[float]:
        rng, out = random.Random(cfg.seed), []
        episode = world.new_episode("test")
        if not expert:  # the one extra a step pays to fill Step.expert_action: a lookup in the solver's table
            episode.expert_action = lambda: None
        for task in range(n):
            t = time.perf_counter()
            step = episode.reset(task)
            if policy == "random":
                times["reset, cached room"].append(time.perf_counter() - t)
            while not step.done:
                action = step.expert_action if policy == "expert" else rng.choice(step.admissible_actions)
                t = time.perf_counter()
                step = episode.step(action)
                out.append(time.perf_counter() - t)
        return out

    times["step, random, expert on"] = run("random", expert=True)  # warms each state's expert cache once
    times["step, random, expert off"] = run("random", expert=False)
    times["step, expert"] = run("expert", expert=True)
    return {"episodes": n, "latency": {k: percentiles_ms(v) for k, v in times.items()}}


def rows(data: dict) -> list[list]:
    return [
        [k, s["n"], s["p50_ms"] * 1000, s["p95_ms"] * 1000, s["mean_ms"] * 1000] for k, s in data["latency"].items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=EnvBench.episodes)
    ap.add_argument("--seed", type=int, default=EnvBench.seed)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    data = measure(EnvBench(episodes=args.episodes, seed=args.seed))
    report(
        "env_sokoban",
        f"Sokoban env latency (6x6, 1 box, test panel, {data['episodes']} episodes)",
        ["what", "n", "p50 us", "p95 us", "mean us"],
        rows(data),
        data,
        args.out,
    )


if __name__ == "__main__":
    main()
