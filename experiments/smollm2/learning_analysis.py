"""SmolLM2's learning pre-study, analysed as pre-registered (experiments/study/smollm2_prestudy.yaml).

    python experiments/smollm2/learning_analysis.py --start runs/smollm2/start-s --grid runs/smollm2/prestudy \
        --out docs/results/smollm2/prestudy/analysis.json
    python experiments/smollm2/learning_analysis.py --kept docs/results/smollm2/prestudy/episodes --out FILE

Reads each cell's final evaluation (``GRID/cells/ARM-sSEED/episodes.jsonl``) and the pretrained start's on the
same panel with the same seed (``START{SEED}/episodes.jsonl``). Per episode (one room of the panel, one
sampling stream: coupled sampling, the cell's seed), three measures over its turns:

* ``valid``: the share of turns the environment accepted (a reply with no move, or a move into a wall, is not);
* ``parsed``: the share of replies that are a move at all (serl's parser, bare replies);
* ``success``: the room solved.

For each arm, its gain over the start; for each contrast, arm minus GRPO. Each is paired by room within a seed
(the mean difference over the 64 rooms, with a t interval over rooms), then over seeds (the mean of the seeds'
differences, with a t interval over the 3 seeds: 2 degrees of freedom, the interval the pre-registration names).
Prints a table and writes ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table
from scipy import stats

from serl_cli.artifacts import io
from serl_cli.rollout.prompts import action_format_of, parse_action
from serl_cli.rollout.worlds import EnvConfig, build_world

ARMS = ("grpo", "serl", "serl-loose")
SEEDS = (0, 1, 2)
MEASURES = ("valid", "parsed", "success")
CONTRASTS = {"SERL - GRPO": ("serl", "grpo"), "SERL loose - GRPO": ("serl-loose", "grpo")}


def per_room(episodes_file: Path) -> dict[str, dict[str, float]]:
    """Each episode's measures, by task id."""
    fmt = action_format_of(build_world(EnvConfig(name="sokoban")))
    out = {}
    for line in episodes_file.read_text().splitlines():
        ep = json.loads(line)
        turns = max(int(ep["num_turns"]), 1)
        parsed = sum(parse_action(a, fmt)[1] is None for a in ep["actions"])
        out[str(ep["task_id"])] = {
            "valid": 1 - ep["invalid_actions"] / turns,
            "parsed": parsed / turns,
            "success": float(ep["success"]),
        }
    return out


def mean_ci(values: list[float]) -> dict:
    """The mean with its 95 % t interval (None where there is a single value or no spread)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return {"mean": mean, "ci95": None, "n": n}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": n}


def paired(a: dict, b: dict, measure: str) -> list[float]:
    assert a.keys() == b.keys(), "the two evaluations scored different rooms"
    return [a[k][measure] - b[k][measure] for k in sorted(a)]


def difference(plus: dict[int, dict], minus: dict[int, dict]) -> dict:
    """plus - minus per measure: per seed over rooms, then over seeds."""
    out = {}
    for m in MEASURES:
        by_seed = {s: mean_ci(paired(plus[s], minus[s], m)) for s in SEEDS}
        out[m] = {"by_seed": by_seed, "over_seeds": mean_ci([by_seed[s]["mean"] for s in SEEDS])}
    return out


def level(rooms: dict[int, dict]) -> dict:
    return {m: mean_ci([r[m] for s in SEEDS for r in rooms[s].values()])["mean"] for m in MEASURES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", help="the start's evaluations: START0, START1, START2")
    ap.add_argument("--grid", help="the ablation directory")
    ap.add_argument("--kept", help="instead: the kept episodes, KEPT/start-sS.jsonl and KEPT/ARM-sS.jsonl")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.kept:
        start = {s: per_room(Path(args.kept) / f"start-s{s}.jsonl") for s in SEEDS}
        arms = {a: {s: per_room(Path(args.kept) / f"{a}-s{s}.jsonl") for s in SEEDS} for a in ARMS}
    else:
        start = {s: per_room(Path(f"{args.start}{s}") / "episodes.jsonl") for s in SEEDS}
        cells = Path(args.grid) / "cells"
        arms = {a: {s: per_room(cells / f"{a}-s{s}" / "episodes.jsonl") for s in SEEDS} for a in ARMS}
    result = {
        "levels": {"start": level(start), **{a: level(arms[a]) for a in ARMS}},
        "gain_over_start": {a: difference(arms[a], start) for a in ARMS},
        "contrasts": {name: difference(arms[p], arms[m]) for name, (p, m) in CONTRASTS.items()},
        "rooms": len(start[0]),
        "seeds": list(SEEDS),
    }
    io.write_json(args.out, result)
    table = Table(title="SmolLM2 pre-study: mean over 3 seeds [95 % t interval over seeds]; per seed over rooms")
    for col in ("", "measure", "over seeds", *(f"seed {s}" for s in SEEDS)):
        table.add_column(col)
    rows = [(f"{a} - start", result["gain_over_start"][a]) for a in ARMS] + list(result["contrasts"].items())
    for name, diff in rows:
        for m in MEASURES:
            table.add_row(name, m, fmt_ci(diff[m]["over_seeds"]), *(fmt_ci(diff[m]["by_seed"][s]) for s in SEEDS))
    Console().print(table)


def fmt_ci(x: dict) -> str:
    ci = x["ci95"]
    return f"{x['mean']:+.3f}" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "")


if __name__ == "__main__":
    main()
