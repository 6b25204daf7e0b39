"""The range of ``serl demo`` over seeds and thread counts: what the README's demo block quotes.

Each run is ``serl demo --seed S [--threads T] --out OUT/seedS-threadsT --overwrite`` in a
fresh process, one after another (each run uses every core it is given: two side by side
would time neither). A thread count of ``default`` passes no ``--threads``: the demo's own
default. The table gives, per run, the warm start (the SFT step the band chose and its
success on the test rooms), each arm's gain over it, and the wall time.

    python -m benchmarks.demo_range --seeds 0 1 2 --threads 1 default --out runs/demo-range

Writes ``benchmarks/results/demo_range.json`` (or ``--json``): every run's ``demo.json``
numbers and wall time, and the range of each gain.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import report
from serl_cli.artifacts import io
from serl_cli.demo.pipeline import ARM_PREFIX, gain_text


def run_one(seed: int, threads: str, out: Path, extra: list[str]) -> dict:
    """One demo in a fresh process; its summary (``demo.json``) with the wall time measured here."""
    cmd = [sys.executable, "-m", "serl_cli", "demo", "--seed", str(seed), "--out", str(out), "--overwrite", "-q"]
    if threads != "default":
        cmd += ["--threads", threads]
    started = time.perf_counter()
    subprocess.run(cmd + extra, check=True)
    wall = time.perf_counter() - started
    demo = io.read_json(out / "demo.json")
    results = demo["results"]
    gains = {algo: round(g["points"], 1) for algo, g in demo["gains"].items()}
    return {
        "seed": seed,
        "threads": threads,
        "wall_s": round(wall, 1),
        "sft_step": demo["warm_start"]["step"],
        "validation_success": demo["warm_start"].get("success"),
        "warm_start": results["warm start"]["success_rate"],
        "final": {algo: results[ARM_PREFIX + algo]["success_rate"] for algo in gains},
        "gain_points": gains,
        # paired over the test rooms (demo.pipeline.paired_gain)
        "gain_ci95_points": {algo: g["ci95"] and [round(x, 1) for x in g["ci95"]] for algo, g in demo["gains"].items()},
        "kept_iterations": demo.get("kept_iterations"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", nargs="+", default=["1", "default"], help="thread counts; 'default': no --threads")
    ap.add_argument("--out", default="runs/demo-range", help="each run's folder goes under this one")
    ap.add_argument("--json", default=None, help="the results file (default benchmarks/results/demo_range.json)")
    ap.add_argument("--set", action="append", default=[], help="passed on to every demo as --set")
    ap.add_argument("--quick", action="store_true", help="serl demo --quick: checks this script, measures nothing")
    args = ap.parse_args(argv)
    extra = [a for s in args.set for a in ("--set", s)] + (["--quick"] if args.quick else [])
    runs = []
    for threads in args.threads:
        for seed in args.seeds:
            run = run_one(seed, threads, Path(args.out) / f"seed{seed}-threads{threads}", extra)
            runs.append(run)
            print(f"seed {seed}, threads {threads}: {run['gain_points']} points, {run['wall_s']:.0f} s", flush=True)
    arms = sorted({a for r in runs for a in r["gain_points"]})
    gains = [f"{a} gain [95% CI] (points)" for a in arms]
    columns = ["seed", "threads", "SFT step", "warm start", *gains, "wall (min:s)"]
    rows = [
        [
            r["seed"],
            r["threads"],
            r["sft_step"],
            r["warm_start"],
            *[gain_text(r["gain_points"][a], r["gain_ci95_points"][a]) if a in r["gain_points"] else "-" for a in arms],
            f"{int(r['wall_s'] // 60)}:{int(r['wall_s'] % 60):02d}",
        ]
        for r in runs
    ]
    ranges = {a: [min(r["gain_points"][a] for r in runs), max(r["gain_points"][a] for r in runs)] for a in arms}
    data = {
        "runs": runs,
        "gain_range_points": ranges,
        "wall_range_s": [min(r["wall_s"] for r in runs), max(r["wall_s"] for r in runs)],
        "extra": extra,
    }
    title = "serl demo: gain over the warm start on the first 200 test rooms"
    report("demo_range", title, columns, rows, data, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
