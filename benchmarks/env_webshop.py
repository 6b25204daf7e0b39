"""WebShop environment speed: step latency by action kind, and expert episodes per second.

    python -m benchmarks.env_webshop [--episodes 500] [--catalog real|synthetic] [--out FILE]

Runs the expert over the test panel on one thread; every step is timed and binned by
its action kind (search, click, buy). Search results are cached per query inside a
world, so the first search of each query is reported separately from repeats.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import percentiles_ms, report
from envs import make_world


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=500)
    ap.add_argument("--catalog", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    t0 = time.perf_counter()
    world = make_world("webshop", catalog=args.catalog)
    build_s = time.perf_counter() - t0
    world.engine.search("warm up")  # first call pays numpy/bm25s lazy setup
    from envs.webshop.reward import title_nouns
    title_nouns("warm up the tagger")  # the spaCy model loads on the first purchase

    times: dict[str, list[float]] = {"search": [], "click": [], "buy": [], "reset": []}
    n = min(args.episodes, world.num_tasks("test"))
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
    rows = [[k, s["n"], s["p50_ms"], s["p95_ms"], s["mean_ms"]] for k, s in stats.items()]
    report("env_webshop", f"WebShop env latency ({world.catalog.source.split(':')[0]}, expert, {n} episodes)",
           ["step kind", "n", "p50 ms", "p95 ms", "mean ms"], rows,
           {"catalog": world.catalog.source, "episodes": n, "world_build_s": build_s, "latency": stats,
            "expert_episodes_per_s": n / wall}, args.out)
    print(f"world build {build_s:.2f} s; expert episodes/s {n / wall:.1f}")


if __name__ == "__main__":
    main()
