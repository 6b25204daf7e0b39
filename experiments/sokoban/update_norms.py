"""The size of each step of online runs, from their kept iteration checkpoints (study v5's step-matched
learning rates, docs/studies/sokoban_v5.md).

    python experiments/sokoban/update_norms.py --start MODEL RUN [RUN ...]

Each RUN is an online run trained with ``keep_last: 0`` (every ``iter_XXXX/checkpoint`` kept) from
the warm start MODEL. Printed as JSON: per run, ``|theta_j - theta_(j-1)|`` for each iteration j
(iteration 0 against MODEL) and their mean; with two or more runs, each run's mean step over the
first run's. Study v5 scales a learning rate by that ratio to give two arms the same step: under
AdamW the step is not proportional to the gradient's norm (``update_diagnostics``'s
``grad_norm_ratio``), so the gradients cannot say it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean

from serl_cli.method.diagnostics.update import parameter_steps


def run_steps(start: str, run: str) -> list[float]:
    iterations = sorted(Path(run).glob("iter_*/checkpoint"))
    if not iterations:
        raise SystemExit(f"{run}: no iter_*/checkpoint (train it with --set keep_last=0)")
    return parameter_steps([Path(start), *iterations])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", required=True, help="the model every run started from")
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args(argv)
    result = {"start": args.start, "runs": {}}
    for run in args.runs:
        steps = run_steps(args.start, run)
        result["runs"][run] = {"steps": steps, "mean_step": mean(steps)}
    first = result["runs"][args.runs[0]]["mean_step"]
    result["mean_step_over_first"] = {run: r["mean_step"] / first for run, r in result["runs"].items()}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
