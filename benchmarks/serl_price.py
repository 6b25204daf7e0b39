"""SERL's price against GRPO's on the CPU: the demo's Sokoban recipe, the authors' placement.

    python -m benchmarks.serl_price --model runs/sokoban/warm_start [--iterations 4] [--rounds 3]
                                    [--threads 1] [--seed 0] [--serl-set KEY=VALUE ..] [--out FILE] [--work DIR]

Each round runs ``serl train --config experiments/sokoban/serl.yaml --set annotate.placement=all
--set annotate.sources=obs`` and ``serl train --config experiments/sokoban/grpo.yaml`` (the comparison
of docs/SCALING.md, "SERL's price"), one after the other in fresh processes, from the same warm start with the
same seed and ``--iterations``, the periodic evaluation off (``eval.episodes=0``: the same for both
arms, and not an iteration's price). The order alternates between rounds (the machine is shared:
whoever runs second in a round would otherwise always meet the same neighbours).

The figures come from each run's ``timings.jsonl``: iteration k of SERL is paired with iteration k
of GRPO in the same round (same rollout seed), and the ratio of their ``iteration_s`` is reported
as a median with its range and a 95 % bootstrap interval (pairs resampled); also apart for the
iterations that measure the teacher signal (the first, every ``annotate.teacher_signal_every``-th
and the last: ``teacher_expert_prob_gain`` in SERL's ``metrics.jsonl``) and for the others, and
as the ratio of the runs' summed iteration times. The arms' episodes part after iteration 0 (each
update changes what the next rollout meets: one arm's iteration may have twice the other's turns
with a gradient), so the paired ratio mixes SERL's price with that difference; the same-batch ratio,
each SERL iteration against itself less its annotate stage (what GRPO's rollout and update cost on
those episodes), is SERL's price alone. SERL's phases (``annotate``: the teacher's
forward passes and the rest, ``teacher_signal`` included) against its update. Targets (docs/SCALING.md, "SERL's price"):
the ratio at most 1.15, the teacher's forward less than the update, the annotate stage outside the
teacher's forward under a quarter of the teacher's.
"""

from __future__ import annotations

import argparse
import random
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


def run_arm(arm: str, args, out: Path) -> tuple[list[dict], set[int]]:
    """The run's timings, and the iterations that measured the teacher signal."""
    cmd = [sys.executable, "-m", "serl_cli", "train", *ARMS[arm], "--model", args.model, "--out", str(out)]
    cmd += ["--iterations", str(args.iterations), "--seed", str(args.seed), "--threads", str(args.threads)]
    cmd += ["--set", "eval.episodes=0", "--overwrite", "-q"]
    if arm == "serl":
        cmd += [part for kv in args.serl_set for part in ("--set", kv)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    signal = {m["iteration"] for m in io.iter_jsonl(out / "metrics.jsonl") if "teacher_expert_prob_gain" in m}
    return list(io.iter_jsonl(out / "timings.jsonl")), signal


def bootstrap_median(values: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval of the median (values resampled with replacement)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def ratio_spread(values: list[float]) -> dict:
    low, high = bootstrap_median(values)
    return {**spread(values), "ci95": [low, high]}


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
            (serl, signal), (grpo, _) = found["serl"], found["grpo"]
            for s, g in zip(serl, grpo, strict=True):
                pairs.append(
                    {
                        "round": r,
                        "iteration": s["iteration"],
                        "serl_s": s["iteration_s"],
                        "grpo_s": g["iteration_s"],
                        "teacher_signal": s["iteration"] in signal,
                    }
                )
                serl_phases.append(phases(s))
    return {"config": vars(args), **summarize(pairs, serl_phases)}


def by_signal(flagged: list[tuple[bool, float]]) -> dict[str, list[float]]:
    """Values flagged by whether their iteration measured the teacher signal: all, with it, without it."""
    return {
        "all": [v for _, v in flagged],
        "with_signal": [v for flag, v in flagged if flag],
        "without_signal": [v for flag, v in flagged if not flag],
    }


def summarize(pairs: list[dict], serl_phases: list[dict]) -> dict:
    """The figures of paired iterations (``pairs``: each with ``serl_s``, ``grpo_s``, ``teacher_signal``)
    and SERL's phases in the same order."""
    paired = by_signal([(p["teacher_signal"], p["serl_s"] / p["grpo_s"]) for p in pairs])
    # the same batch: a SERL iteration against itself less its annotate stage, which is what GRPO's
    # iteration costs on SERL's own episodes (the arms' episodes part after iteration 0)
    same_batch = by_signal(
        [
            (p["teacher_signal"], ph["iteration_s"] / (ph["iteration_s"] - ph["annotate_s"]))
            for ph, p in zip(serl_phases, pairs, strict=True)
            if ph["annotate_s"] is not None
        ]
    )
    summary = {
        k: spread([p[k] for p in serl_phases if p[k] is not None])
        for k in serl_phases[0]
        if any(p[k] is not None for p in serl_phases)
    }
    return {
        "pairs": pairs,
        "serl_phases": serl_phases,
        "ratio": ratio_spread(paired.pop("all")),
        "ratio_apart": {name: ratio_spread(v) for name, v in paired.items() if v},
        "same_batch_ratio": {name: ratio_spread(v) for name, v in same_batch.items() if v},
        "ratio_of_sums": sum(p["serl_s"] for p in pairs) / sum(p["grpo_s"] for p in pairs),
        "teacher_forward_per_grpo_iteration": spread(
            [
                ph["teacher_forward_s"] / p["grpo_s"]
                for ph, p in zip(serl_phases, pairs, strict=True)
                if ph["teacher_forward_s"]
            ]
        ),
        "serl": summary,
        "grpo_iteration_s": spread([p["grpo_s"] for p in pairs]),
    }


def rows(data: dict) -> list[list]:
    r, s = data["ratio"], data["serl"]
    out = [["SERL / GRPO iteration (target <= 1.15)", r["median"], r["min"], r["max"], _ci(r)]]
    for name, a in data["ratio_apart"].items():
        out.append([f"  iterations {name.replace('_', ' ')} (n={a['n']})", a["median"], a["min"], a["max"], _ci(a)])
    out.append(["SERL / GRPO, summed iteration times", data["ratio_of_sums"], "", "", ""])
    for name, a in data["same_batch_ratio"].items():
        label = "SERL / itself less annotate" + ("" if name == "all" else f": {name.replace('_', ' ')}")
        out.append([f"{label} (n={a['n']})", a["median"], a["min"], a["max"], _ci(a)])
    t = data["teacher_forward_per_grpo_iteration"]
    out.append(["teacher's forward / GRPO iteration", t["median"], t["min"], t["max"], ""])
    out.append(["GRPO iteration s", *(data["grpo_iteration_s"][k] for k in ("median", "min", "max")), ""])
    for k, v in s.items():
        out.append([f"SERL {k}", v["median"], v["min"], v["max"], ""])
    return out


def _ci(r: dict) -> str:
    return f"{r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the warm start (both arms start from it)")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--serl-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for the SERL arm, applied after its own (annotate.placement=all, annotate.sources=obs) "
        "(repeatable), e.g. annotate.placement=feedback",
    )
    ap.add_argument("--work", default=None, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    data = measure(args)
    serl = ", ".join(["placement all", "sources obs", *args.serl_set])
    report(
        "serl_price",
        f"SERL ({serl}) against GRPO on Sokoban: {args.rounds} round(s) x {args.iterations} "
        f"iteration(s), {args.threads} thread(s); median, min, max over paired iterations",
        ["figure", "median", "min", "max", "median's 95% CI"],
        rows(data),
        data,
        args.out,
    )


if __name__ == "__main__":
    main()
