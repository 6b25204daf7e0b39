"""Environment steps in worker processes (``rollout.env_workers``) against one process: rollout wall time
at identical episodes.

    python -m benchmarks.env_workers [--envs webshop,alfworld] [--workers 1 2] [--tasks 8] [--group-size 2]
                                     [--max-turns 6] [--rounds 2] [--model DIR] [--out FILE]

Each round runs ``serl rollout`` once per worker count, in fresh processes, the order reversed every other
round (a shared machine: the arm that runs second would otherwise always meet the same neighbours), with the
hf engine on one torch thread and the environment's embedded tiny model unless ``--model`` is given (a small
model makes generation cheap, so the environment's share of a round, the part workers can overlap, is as
large as it gets; a real model's generation shrinks it). Per run: the rollout's own wall time (its
manifest's, the workers' start included) and the process's; and the sha256 of its episodes, which must be
the same for every worker count (the benchmark stops if not).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import report
from serl_cli.artifacts import io

COLUMNS = ["env", "workers", "rollout s (median)", "process s (median)", "speed-up", "episodes", "turns", "same"]


def run_arm(env: str, workers: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "serl_cli", "rollout", "--env", env, "--tasks", str(args.tasks)]
    cmd += ["--group-size", str(args.group_size), "--max-turns", str(args.max_turns), "--threads", "1"]
    cmd += ["--seed", str(args.seed), "--set", f"env_workers={workers}", "--out", str(out), "--overwrite", "-q"]
    if args.model:
        cmd += ["--model", args.model]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    process = time.perf_counter() - t0
    summary = io.load_manifest(out)["stages"]["rollout"]["summary"]
    rows = list(io.iter_jsonl(out / "rollouts.jsonl"))
    digest = hashlib.sha256((out / "rollouts.jsonl").read_bytes()).hexdigest()
    turns = sum(len(r["turns"]) for r in rows)
    return {"rollout_s": summary["wall_time_s"], "process_s": process, "sha256": digest, "episodes": len(rows)} | {
        "turns": turns
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envs", default="webshop,alfworld")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs: dict[str, dict[int, list[dict]]] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for env in args.envs.split(","):
            runs[env] = {w: [] for w in args.workers}
            for r in range(args.rounds):
                order = args.workers if r % 2 == 0 else args.workers[::-1]
                for w in order:
                    runs[env][w].append(run_arm(env, w, args, Path(tmp) / f"{env}-{w}-{r}"))
            digests = {run["sha256"] for w in args.workers for run in runs[env][w]}
            if len(digests) != 1:
                sys.exit(f"{env}: the worker counts gave different episodes ({len(digests)} distinct rollouts)")
            base = statistics.median(run["rollout_s"] for run in runs[env][args.workers[0]])
            for w in args.workers:
                med = statistics.median(run["rollout_s"] for run in runs[env][w])
                proc = statistics.median(run["process_s"] for run in runs[env][w])
                first = runs[env][w][0]
                rows.append([env, w, f"{med:.1f}", f"{proc:.1f}", f"{base / med:.2f}x", first["episodes"]])
                rows[-1] += [first["turns"], "yes"]
    settings = {k: getattr(args, k) for k in ("tasks", "group_size", "max_turns", "rounds", "seed", "model")}
    data = {"settings": settings, "runs": runs}
    report("env_workers", "rollout wall time by env_workers", COLUMNS, rows, data, out=args.out)


if __name__ == "__main__":
    main()
