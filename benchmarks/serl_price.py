"""SERL's price against GRPO's on the CPU: the demo's Sokoban recipe, the authors' placement.

    python -m benchmarks.serl_price --model runs/warm/expert/checkpoint [--iterations 4] [--rounds 3]
                                    [--threads 1] [--seed 0] [--out FILE] [--work DIR]

Each round runs ``serl train --config experiments/sokoban/serl.yaml --set annotate.placement=all
--set annotate.sources=obs`` and ``serl train --config experiments/sokoban/grpo.yaml`` (the
issue-39 comparison), one after the other in fresh processes, from the same warm start with the
same seed and ``--iterations``, the periodic evaluation off (``eval.episodes=0``: the same for both
arms, and not an iteration's price). The order alternates between rounds (the machine is shared:
whoever runs second in a round would otherwise always meet the same neighbours).

The figures come from each run's ``timings.jsonl``: iteration k of SERL is paired with iteration k
of GRPO in the same round (same rollout seed), and the ratio of their ``iteration_s`` is reported
as a median with its range; SERL's phases (``annotate``: the teacher's forward passes and the
rest, ``teacher_signal`` included) against its update. Targets (issue 39): the ratio at most 1.15,
the teacher's forward less than the update, the annotate stage outside the teacher's forward under
a quarter of the teacher's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import report
from serl_cli.artifacts import io

ARMS = {
    "serl": [
        "--config",
        "experiments/sokoban/serl.yaml",
        "--set",
        "annotate.placement=all",
        "--set",
        "annotate.sources=obs",
    ],
    "grpo": ["--config", "experiments/sokoban/grpo.yaml"],
}


def run_arm(arm: str, args, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "serl_cli", "train", *ARMS[arm], "--model", args.model, "--out", str(out)]
    cmd += ["--iterations", str(args.iterations), "--seed", str(args.seed), "--threads", str(args.threads)]
    cmd += ["--set", "eval.episodes=0", "--overwrite", "-q"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return list(io.iter_jsonl(out / "timings.jsonl"))


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def phases(t: dict) -> dict:
    """One SERL iteration's phases, in seconds."""
    a = t["update"].get("annotate", {})
    return {
        "iteration_s": t["iteration_s"],
        "rollout_s": t["rollout_s"],
        "update_s": t["update"]["update_s"],
        "annotate_s": a.get("annotate_s"),
        "teacher_forward_s": a.get("teacher_forward_s"),
        "annotate_rest_s": a.get("rest_s"),
    }


def measure(args) -> dict:
    pairs, serl_phases = [], []
    with tempfile.TemporaryDirectory(prefix="serl-price-") as tmp:
        work = Path(args.work or tmp)
        for r in range(args.rounds):
            order = ["serl", "grpo"] if r % 2 == 0 else ["grpo", "serl"]
            found = {arm: run_arm(arm, args, work / f"round{r}-{arm}") for arm in order}
            for s, g in zip(found["serl"], found["grpo"], strict=True):
                pairs.append(
                    {"round": r, "iteration": s["iteration"], "serl_s": s["iteration_s"], "grpo_s": g["iteration_s"]}
                )
                serl_phases.append(phases(s))
    ratios = [p["serl_s"] / p["grpo_s"] for p in pairs]
    summary = {
        k: spread([p[k] for p in serl_phases if p[k] is not None])
        for k in serl_phases[0]
        if any(p[k] is not None for p in serl_phases)
    }
    return {
        "config": vars(args),
        "pairs": pairs,
        "serl_phases": serl_phases,
        "ratio": spread(ratios),
        "serl": summary,
        "grpo_iteration_s": spread([p["grpo_s"] for p in pairs]),
    }


def rows(data: dict) -> list[list]:
    r, s = data["ratio"], data["serl"]
    out = [["SERL / GRPO iteration (target <= 1.15)", r["median"], r["min"], r["max"]]]
    out.append(["GRPO iteration s", *(data["grpo_iteration_s"][k] for k in ("median", "min", "max"))])
    for k, v in s.items():
        out.append([f"SERL {k}", v["median"], v["min"], v["max"]])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the warm start (both arms start from it)")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    data = measure(args)
    report(
        "serl_price",
        f"SERL (placement all, sources obs) against GRPO on Sokoban: {args.rounds} round(s) x {args.iterations} "
        f"iteration(s), {args.threads} thread(s); median, min, max over paired iterations",
        ["figure", "median", "min", "max"],
        rows(data),
        data,
        args.out,
    )


if __name__ == "__main__":
    main()
