"""Does a stale policy learn as well? The demo's Sokoban GRPO recipe at max_staleness 1 against 0, paired seeds.

    python -m benchmarks.async_learning --model runs/sokoban/expert/checkpoint [--seeds 0 1 2 3 4]
                                        [--staleness 1] [--iterations 80] [--threads 1] [--out FILE] [--work DIR]

For each seed, ``serl train --config experiments/sokoban/grpo.yaml`` runs from the same warm start
synchronously and at ``max_staleness`` k (the producer on a thread of its own), one after the
other, the order alternating by seed. Both arms evaluate on the recipe's 200-room panel every 10
iterations (``eval.*`` of grpo.yaml). Per seed:

* **final success**: the last evaluation's success, k minus synchronous;
* **success at equal wall time**: the stale run's final success against the synchronous run's at
  the moment the stale run finished (its last evaluation by then; wall time is the sum of
  ``iteration_s`` in ``timings.jsonl``, the start of a process not counted) -- positive: the stale
  run got there sooner.

Each difference's mean over seeds with its 95 % t-interval (acceptance: both intervals
inside +-6 points). Runs are resumable: a seed whose two runs are finished in ``--work`` is read,
not run again.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from benchmarks.common import report
from serl_cli.artifacts import io
from serl_cli.stats.summary import describe


def run(k: int, seed: int, args, out: Path) -> None:
    manifest = out / "manifest.json"
    if manifest.is_file() and io.read_json(manifest)["stages"].get("online", {}).get("status") == "done":
        return
    cmd = [sys.executable, "-m", "serl_cli", "train", "--config", "experiments/sokoban/grpo.yaml"]
    cmd += ["--model", args.model, "--out", str(out), "--seed", str(seed), "--threads", str(args.threads)]
    cmd += ["--set", f"max_staleness={k}", "--set", f"producer.threads={args.threads}", "-q"]
    if args.iterations:
        cmd += ["--iterations", str(args.iterations)]
    cmd += ["--resume"] if manifest.is_file() else ["--overwrite"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def curve(out: Path) -> list[tuple[float, float]]:
    """(wall seconds so far, panel success) after each evaluation."""
    wall = {}
    total = 0.0
    for t in io.iter_jsonl(out / "timings.jsonl"):
        total += t["iteration_s"]
        wall[t["iteration"]] = total
    return [
        (wall[m["iteration"]], m["eval_success_rate"])
        for m in io.iter_jsonl(out / "metrics.jsonl")
        if "eval_success_rate" in m
    ]


def success_at(points: list[tuple[float, float]], seconds: float) -> float:
    """The success of the last evaluation at or before ``seconds`` (the first one if none yet)."""
    before = [s for t, s in points if t <= seconds]
    return before[-1] if before else points[0][1]


def measure(args) -> dict:
    work = Path(args.work)
    seeds = []
    for i, seed in enumerate(args.seeds):
        order = [0, args.staleness] if i % 2 == 0 else [args.staleness, 0]
        for k in order:
            run(k, seed, args, work / f"seed{seed}-k{k}")
        sync, stale = curve(work / f"seed{seed}-k0"), curve(work / f"seed{seed}-k{args.staleness}")
        finish = stale[-1][0]
        seeds.append(
            {
                "seed": seed,
                "sync_final": sync[-1][1],
                "stale_final": stale[-1][1],
                "sync_wall_s": sync[-1][0],
                "stale_wall_s": finish,
                "sync_at_stale_finish": success_at(sync, finish),
                "sync_curve": sync,
                "stale_curve": stale,
            }
        )
    final = describe([100 * (s["stale_final"] - s["sync_final"]) for s in seeds])
    equal_wall = describe([100 * (s["stale_final"] - s["sync_at_stale_finish"]) for s in seeds])
    speed = describe([s["sync_wall_s"] / s["stale_wall_s"] for s in seeds])
    return {
        "config": vars(args),
        "seeds": seeds,
        "final_points": final,
        "equal_wall_points": equal_wall,
        "speed": speed,
    }


def rows(data: dict) -> list[list]:
    out = []
    for s in data["seeds"]:
        out.append(
            [
                s["seed"],
                s["sync_final"],
                s["stale_final"],
                s["sync_at_stale_finish"],
                s["sync_wall_s"],
                s["stale_wall_s"],
            ]
        )
    for name, key in (("final, points", "final_points"), ("equal wall, points", "equal_wall_points")):
        d = data[key]
        out.append([name, f"{d['mean']:+.1f}", f"[{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}]", "", "", ""])
    d = data["speed"]
    out.append(["wall speed-up", f"{d['mean']:.2f}", f"[{d['ci95'][0]:.2f}, {d['ci95'][1]:.2f}]", "", "", ""])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the warm start (every run starts from it)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=None, help="default: the recipe's 80")
    ap.add_argument("--threads", type=int, default=1, help="the trainer's threads, and the producer's")
    ap.add_argument("--work", default="runs/async_learning", help="the runs (kept: a second call reads them)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    data = measure(args)
    report(
        "async_learning",
        f"Sokoban GRPO at max_staleness {args.staleness} against 0, seeds {args.seeds}: panel success (200 rooms); "
        "the last rows: stale minus synchronous, mean [95 % t-interval] over seeds",
        ["seed", "sync final", "stale final", "sync at stale's finish", "sync wall s", "stale wall s"],
        rows(data),
        data,
        args.out,
    )


if __name__ == "__main__":
    main()
