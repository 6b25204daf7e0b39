"""WebShop environment speed: step latency by action kind, and expert episodes per second.

    python -m benchmarks.env_webshop [--episodes 500] [--catalog real|synthetic] [--out FILE]

Runs the expert over the test panel on one thread; every step is timed and binned by
its action kind (search, click, buy). A world caches search results per query; the cache
is cleared before every search, so each search is timed as a first search.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from benchmarks.common import percentiles_ms, report
from envs import make_world


@dataclass
class EnvBench:
    episodes: int = 500
    catalog: str = "auto"


def measure(cfg: EnvBench) -> dict:
    """Step latency by action kind over ``cfg.episodes`` expert episodes of the test panel."""
    t0 = time.perf_counter()
    world = make_world("webshop", catalog=cfg.catalog)
    build_s = time.perf_counter() - t0
    world.engine.search("warm up")  # first call pays numpy/bm25s lazy setup
    from envs.webshop.reward import title_nouns

    title_nouns("warm up the tagger")  # the spaCy model loads on the first purchase

    times: dict[str, list[float]] = {"search": [], "click": [], "buy": [], "reset": []}
    n = min(cfg.episodes, world.num_tasks("test"))
    ep = world.new_episode("test")
    t_all = time.perf_counter()
    for task in range(n):
        t = time.perf_counter()
        step = ep.reset(task)
        times["reset"].append(time.perf_counter() - t)
        while not step.done:
            action = step.expert_action
            if action.startswith("search["):
                world._search_cache.clear()
                kind = "search"
            else:
                kind = "buy" if action == "click[buy now]" else "click"
            t = time.perf_counter()
            step = ep.step(action)
            times[kind].append(time.perf_counter() - t)
    wall = time.perf_counter() - t_all
    all_steps = [x for k, v in times.items() if k != "reset" for x in v]
    stats = {k: percentiles_ms(v) for k, v in times.items() if v}
    stats["all steps"] = percentiles_ms(all_steps)
    return {
        "catalog": world.catalog.source,
        "episodes": n,
        "world_build_s": build_s,
        "latency": stats,
        "expert_episodes_per_s": n / wall,
    }


def rows(data: dict) -> list[list]:
    return [[k, s["n"], s["p50_ms"], s["p95_ms"], s["mean_ms"]] for k, s in data["latency"].items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=EnvBench.episodes)
    ap.add_argument("--catalog", default=EnvBench.catalog)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    data = measure(EnvBench(episodes=args.episodes, catalog=args.catalog))
    report(
        "env_webshop",
        f"WebShop env latency ({data['catalog'].split(':')[0]}, expert, {data['episodes']} episodes)",
        ["step kind", "n", "p50 ms", "p95 ms", "mean ms"],
        rows(data),
        data,
        args.out,
    )
    print(f"world build {data['world_build_s']:.2f} s; expert episodes/s {data['expert_episodes_per_s']:.1f}")


if __name__ == "__main__":
    main()
