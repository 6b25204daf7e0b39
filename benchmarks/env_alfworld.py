"""ALFWorld environment speed: reset and step latency, the cost of a group's resets, expert episodes/s.

    python -m benchmarks.env_alfworld [--split valid_unseen] [--per-type 2] [--group 8] [--out FILE]

Needs the extra (pip install -e '.[alfworld]') and the games ($SERL_DATA_DIR/alfworld).
On ``--per-type`` games of each task type, one at a time and each in a fresh world:

* uncached load: ``textworld.start`` + ``reset`` in a process without serl's caches, i.e.
  what every rollout would pay with TextWorld as it comes;
* first reset: the group's first episode (a new engine, the game's first translation);
* group resets: the other G-1 episodes of the group, live side by side as the runner keeps
  them (each a new engine on the cached translation);
* pooled reset: a later group's reset, on an engine an earlier episode gave back;
* steps: every step of G expert episodes of the game, admissible and not, timed apart.

The table's last lines are the group's total reset cost in units of one first load (target:
a group of 8 under 2 first loads). A second table measures the off-plan reference: on
``2 x --per-type`` games per type, follow the plan to a random point, make k random
state-changing commands (``--strays``), then follow ``expert_action``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import time
from dataclasses import dataclass

from benchmarks.common import percentiles_ms, print_table, report, require, rss_mb
from envs import make_world


@dataclass
class AlfBench:
    split: str = "valid_unseen"
    per_type: int = 2
    group: int = 8


def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def _plain_load(game_file: str) -> float:
    """``textworld.start`` + ``reset`` as alfworld's own env does it, without serl's caches."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

    infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=True, extras=["gamefile"])
    t = time.perf_counter()
    textworld.start(game_file, request_infos=infos, wrappers=[AlfredDemangler(), AlfredInfos]).reset()
    return time.perf_counter() - t


def measure(cfg: AlfBench) -> dict:
    require("alfworld", "alfworld")
    from envs.alfworld import engine

    probe = make_world("alfworld")
    tasks = probe.corpus_tasks(cfg.split, per_type=cfg.per_type)
    times: dict[str, list[float]] = {
        k: [] for k in ("uncached load", "first reset", "group reset", "pooled reset", "step", "invalid step")
    }
    group_costs, rss_per_engine, episodes, wall = [], [], 0, 0.0
    with mp.get_context("spawn").Pool(1) as pool:  # a process where serl's caches are never installed
        times["uncached load"] = pool.map(_plain_load, [str(probe.game(cfg.split, t).path) for t in tasks])
    for task in tasks:
        engine._TRANSLATIONS.clear()  # the game's first load translates it (grammar parses stay cached)
        world = make_world("alfworld")  # an empty engine pool
        rss0 = rss_mb()
        t_all = time.perf_counter()
        group = [world.new_episode(cfg.split) for _ in range(cfg.group)]
        steps = []
        for i, ep in enumerate(group):
            step, dt = _timed(ep.reset, task)
            times["first reset" if i == 0 else "group reset"].append(dt)
            steps.append(step)
        group_costs.append(sum(times["first reset"][-1:] + times["group reset"][-(cfg.group - 1) :]))
        rss1 = rss_mb()
        if rss0 is not None and rss1 is not None:
            rss_per_engine.append((rss1 - rss0) / cfg.group)
        for i, (ep, step) in enumerate(zip(group, steps, strict=True)):
            if i == 0:  # one invalid command per game: answered without stepping the engine
                _, dt = _timed(ep.step, "take the moon from the sky")
                times["invalid step"].append(dt)
            while not step.done:
                step, dt = _timed(ep.step, step.expert_action)
                times["step"].append(dt)
            episodes += 1
        wall += time.perf_counter() - t_all
        ep = world.new_episode(cfg.split)  # the next group: engines come back from the pool
        _, dt = _timed(ep.reset, task)
        times["pooled reset"].append(dt)
        ep.close()
    first = percentiles_ms(times["first reset"])["mean_ms"]
    return {
        "split": cfg.split,
        "games": len(tasks),
        "group_size": cfg.group,
        "latency": {k: percentiles_ms(v) for k, v in times.items() if v},
        "group_reset_cost_in_first_loads": sum(group_costs) / len(group_costs) / (first / 1000.0),
        "group_reset_cost_in_uncached_loads": sum(group_costs) / sum(times["uncached load"]),
        "rss_mb_per_live_engine": sum(rss_per_engine) / len(rss_per_engine) if rss_per_engine else None,
        "expert_episodes_per_s": episodes / wall,
    }


def measure_reference(split: str, per_type: int, strays: int, seed: int = 0) -> dict:
    """The off-plan reference: follow the plan to a random point, make ``strays`` random
    state-changing commands, then follow ``expert_action`` to the end of the episode."""
    world = make_world("alfworld")
    rng = random.Random(seed)
    won = off_plan = with_ref = turns = 0
    tasks = world.corpus_tasks(split, per_type=per_type)
    for task in tasks:
        ep = world.new_episode(split)
        step = ep.reset(task)
        for command in ep.plan[: rng.randrange(len(ep.plan))] if ep.plan else []:
            step = ep.step(command)
        for _ in range(strays):
            if step.done:
                break
            moves = [
                a
                for a in step.admissible_actions
                if a != step.expert_action and not a.startswith(("look", "inventory", "examine"))
            ]
            step = ep.step(rng.choice(moves))
        while not step.done:
            if not step.info["on_plan"]:
                off_plan += 1
                with_ref += step.expert_action is not None
            step = ep.step(step.expert_action or "look")
        won += step.info["won"]
        turns += ep.turns
    return {
        "strays": strays,
        "games": len(tasks),
        "won": won,
        "win_rate": won / len(tasks),
        "off_plan_turns_with_reference": with_ref / max(off_plan, 1),
        "mean_turns": turns / len(tasks),
    }


def rows(data: dict) -> list[list]:
    out = [[k, s["n"], s["p50_ms"], s["p95_ms"], s["mean_ms"]] for k, s in data["latency"].items()]
    for unit in ("first", "uncached"):
        out.append(
            [
                f"group of {data['group_size']}: resets / {unit} load",
                "",
                "",
                "",
                f"{data[f'group_reset_cost_in_{unit}_loads']:.2f}",
            ]
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", default=AlfBench.split)
    ap.add_argument("--per-type", type=int, default=AlfBench.per_type)
    ap.add_argument("--group", type=int, default=AlfBench.group)
    ap.add_argument(
        "--strays",
        type=int,
        nargs="*",
        default=[1, 3],
        help="also measure the off-plan reference after this many random commands",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    data = measure(AlfBench(split=args.split, per_type=args.per_type, group=args.group))
    data["reference"] = [measure_reference(args.split, 2 * args.per_type, k) for k in args.strays]
    print_table(
        f"off-plan reference ({args.split}, {2 * args.per_type} games per task type)",
        ["strays", "games", "won", "win rate", "off-plan turns with a reference", "mean turns"],
        [
            [r["strays"], r["games"], r["won"], r["win_rate"], r["off_plan_turns_with_reference"], r["mean_turns"]]
            for r in data["reference"]
        ],
    )
    report(
        "env_alfworld",
        f"ALFWorld env latency ({data['split']}, {data['games']} games, expert, group {data['group_size']})",
        ["what", "n", "p50 ms", "p95 ms", "mean ms"],
        rows(data),
        data,
        args.out,
    )
    rss = data["rss_mb_per_live_engine"]
    print(
        f"expert episodes/s {data['expert_episodes_per_s']:.2f}; "
        f"memory per live engine {'-' if rss is None else f'{rss:.0f} MB'}"
    )


if __name__ == "__main__":
    main()
