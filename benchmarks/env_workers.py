"""Environment steps in worker processes (``rollout.env_workers``) against one process, and turns per episode
(``rollout.dispatch``) against rounds: rollout wall time at identical episodes.

    python -m benchmarks.env_workers [--envs webshop,alfworld] [--workers 1 2] [--dispatch round episode]
                                     [--engine hf|vllm] [--tasks 8] [--group-size 2] [--max-turns 6]
                                     [--rounds 2] [--model DIR] [--set KEY=VALUE ...] [--out FILE]

An arm is a worker count and a dispatch (``episode`` needs ``--engine vllm``; every arm then samples with
``sampling.coupled``, which episode dispatch needs, so that all arms play the same episodes). Each round runs
``serl rollout`` once per arm, in fresh processes, the order reversed every other
round (a shared machine: the arm that runs second would otherwise always meet the same neighbours), with the
hf engine on one torch thread and the environment's embedded tiny model unless ``--model`` is given (a small
model makes generation cheap, so the environment's share of a round, the part workers can overlap, is as
large as it gets; a real model's generation shrinks it). Per run: the rollout's own wall time (its
manifest's, the workers' start included, vLLM's start not) and the process's; and the sha256 of its episodes
without their log-probs, which must be the same for every arm (the benchmark stops if not), with the largest
log-prob gap to the first arm's first run (vLLM's kernels are not batch-invariant: a turn decoded beside other
requests under dispatch episode rounds differently in float32; the hf engine's arms are byte for byte).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import report
from serl_cli.artifacts import io

COLUMNS = ["env", "workers", "dispatch", "rollout s (median)", "process s (median)", "speed-up", "episodes"]
COLUMNS += ["turns", "same", "log-prob gap"]


def run_arm(env: str, arm: tuple[int, str], args, out: Path) -> dict:
    workers, dispatch = arm
    cmd = [sys.executable, "-m", "serl_cli", "rollout", "--env", env, "--tasks", str(args.tasks)]
    cmd += ["--group-size", str(args.group_size), "--max-turns", str(args.max_turns), "--threads", "1"]
    cmd += ["--seed", str(args.seed), "--set", f"env_workers={workers}", "--out", str(out), "--overwrite", "-q"]
    cmd += ["--engine", args.engine, "--set", f"dispatch={dispatch}"]
    if args.engine == "vllm":  # the arms' episodes are the same only where each turn draws from its own seed
        cmd += ["--set", "sampling.coupled=true"]
    if args.model:
        cmd += ["--model", args.model]
    for setting in args.set:  # the rollout's own settings (serl rollout --set), the same in every arm
        cmd += ["--set", setting]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    process = time.perf_counter() - t0
    summary = io.load_manifest(out)["stages"]["rollout"]["summary"]
    rows = list(io.iter_jsonl(out / "rollouts.jsonl"))
    logprobs = [t.pop("behaviour_logprobs") for r in rows for t in r["turns"]]
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    turns = sum(len(r["turns"]) for r in rows)
    return {"rollout_s": summary["wall_time_s"], "process_s": process, "sha256": digest, "episodes": len(rows)} | {
        "turns": turns,
        "logprobs": logprobs,
    }


def gap(run: dict, first: dict) -> float:
    """The largest log-prob difference between two runs of the same episodes."""
    pairs = zip(run["logprobs"], first["logprobs"], strict=True)
    return max((abs(a - b) for x, y in pairs for a, b in zip(x, y, strict=True)), default=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envs", default="webshop,alfworld")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dispatch", nargs="+", default=["round"], choices=["round", "episode"])
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    arms = [(w, d) for w in args.workers for d in args.dispatch]
    runs: dict[str, dict[str, list[dict]]] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for env in args.envs.split(","):
            done: dict[tuple[int, str], list[dict]] = {arm: [] for arm in arms}
            for r in range(args.rounds):
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    done[arm].append(run_arm(env, arm, args, Path(tmp) / f"{env}-{arm[0]}-{arm[1]}-{r}"))
            digests = {run["sha256"] for arm in arms for run in done[arm]}
            if len(digests) != 1:
                sys.exit(f"{env}: the arms gave different episodes ({len(digests)} distinct rollouts)")
            base = statistics.median(run["rollout_s"] for run in done[arms[0]])
            reference = done[arms[0]][0]
            for arm in arms:
                med = statistics.median(run["rollout_s"] for run in done[arm])
                proc = statistics.median(run["process_s"] for run in done[arm])
                first = done[arm][0]
                rows.append([env, *arm, f"{med:.1f}", f"{proc:.1f}", f"{base / med:.2f}x", first["episodes"]])
                rows[-1] += [first["turns"], "yes", f"{max(gap(run, reference) for run in done[arm]):.1e}"]
            for run in (run for arm in arms for run in done[arm]):
                run["logprob_gap"] = gap(run, reference)
            for run in (run for arm in arms for run in done[arm]):
                del run["logprobs"]
            runs[env] = {f"{w} worker(s), dispatch {d}": done[(w, d)] for w, d in arms}
    keys = ("tasks", "group_size", "max_turns", "rounds", "seed", "model", "engine", "set")
    settings = {k: getattr(args, k) for k in keys}
    data = {"settings": settings, "runs": runs}
    report("env_workers", "rollout wall time by env_workers", COLUMNS, rows, data, out=args.out)


if __name__ == "__main__":
    main()
