"""The two tables docs/RESULTS.md shows for each grid of the study.

    python experiments/study/summarize.py runs/study/webshop-baselines [--json OUT] [--versus ARM]

1. Outcomes, from ``report.csv`` (``serl ablate --report`` must have run): per arm the final
   evaluation's success and score over seeds with 95 % t-intervals, the paired difference in
   score from the report's baseline arm with its interval and t-test p, the mean selected
   fraction and the teacher tokens scored.
2. What the cells learned from, summed over each arm's seeds and iterations (from
   ``cells/*/train/metrics.jsonl`` and ``cells/*/cell.json``): the training rollouts' mean
   reward and success, turns with a gradient (a nonzero advantage) over all turns, optimizer
   steps, the final score per seed and the cells' wall time.
3. With ``--versus ARM``: ARM's final score minus each other arm's, paired by seed, with a 95 %
   t-interval and the paired t-test p (the report pairs every arm with one baseline only).
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path


def arm_rows(out: Path) -> list[dict]:
    cells = defaultdict(list)
    for cell_json in sorted(out.glob("cells/*/cell.json")):
        cell = json.loads(cell_json.read_text())
        if cell.get("status") != "done":
            continue
        metrics = [json.loads(line) for line in (cell_json.parent / "train" / "metrics.jsonl").read_text().splitlines()]
        cells[cell["arm"]].append((cell, metrics))
    rows = []
    for arm, members in cells.items():
        members.sort(key=lambda cm: cm[0]["seed"])
        its = [m for _, ms in members for m in ms]
        episodes = sum(m.get("episodes", 0) for m in its)
        rows.append(
            {
                "arm": arm,
                "cells": len(members),
                "train_mean_reward": sum(m.get("mean_reward", 0.0) * m.get("episodes", 0) for m in its)
                / max(episodes, 1),
                "train_success": sum(m.get("success_rate", 0.0) * m.get("episodes", 0) for m in its) / max(episodes, 1),
                "turns_with_gradient": sum(m.get("turns_with_gradient", 0) for m in its),
                "turns": sum(m.get("turns", 0) for m in its),
                "optimizer_steps": sum(m.get("optimizer_steps", 0) for m in its),
                "teacher_tokens": sum(m.get("teacher_action_tokens", 0) for m in its),
                "seeds": [c["seed"] for c, _ in members],
                "final_score_exact": [c["eval"]["score"] for c, _ in members],
                "final_score_per_seed": [round(c["eval"]["score"], 1) for c, _ in members],
                "final_success_per_seed": [round(c["eval"]["success_rate"], 3) for c, _ in members],
                "wall_time_s": round(sum(c.get("wall_time_s", 0.0) for c, _ in members), 1),
            }
        )
    return rows


def _num(text: str, fmt: str) -> str:
    return "n/a" if text in ("", None) else format(float(text), fmt)


def outcome_table(out: Path) -> str:
    with open(out / "report.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    head = (
        "| arm | seeds | success (mean ± std) | score 0-100 (mean ± std) | 95 % t-interval (score) "
        f"| Δ score vs {rows[0]['baseline']}, paired [95 % CI] | p (paired t) | selected fraction | teacher tokens |"
    )
    lines = [head, "| --- " * 9 + "|"]
    for r in rows:
        base = r["arm"] == r["baseline"]
        delta = (
            "(baseline)"
            if base
            else (
                f"{_num(r['diff_score'], '+.1f')} [{_num(r['diff_score_ci_lo'], '.1f')}, "
                f"{_num(r['diff_score_ci_hi'], '.1f')}]"
            )
        )
        lines.append(
            f"| {r['arm']} | {r['seeds_done']} | {_num(r['success_mean'], '.3f')} ± {_num(r['success_std'], '.3f')} "
            f"| {_num(r['score_mean'], '.1f')} ± {_num(r['score_std'], '.1f')} "
            f"| [{_num(r['score_ci_lo'], '.1f')}, {_num(r['score_ci_hi'], '.1f')}] | {delta} "
            f"| {'' if base else _num(r['p_score'], '.3g')} | {_num(r['selected_fraction'], '.3f')} "
            f"| {r['teacher_tokens_total'] or 0} |"
        )
    return "\n".join(lines)


def versus_table(rows: list[dict], arm: str) -> str:
    from scipy import stats

    by_arm = {r["arm"]: r for r in rows}
    if arm not in by_arm:
        raise SystemExit(f"error: no arm {arm!r} here (arms: {', '.join(by_arm)})")
    mine = dict(zip(by_arm[arm]["seeds"], by_arm[arm]["final_score_exact"], strict=True))
    lines = [f"| {arm} minus | pairs | Δ score (mean) | 95 % CI | p (paired t) |", "| --- " * 5 + "|"]
    for other in rows:
        if other["arm"] == arm:
            continue
        theirs = dict(zip(other["seeds"], other["final_score_exact"], strict=True))
        seeds = sorted(set(mine) & set(theirs))
        diffs = [mine[s] - theirs[s] for s in seeds]
        n, mean = len(diffs), sum(diffs) / max(len(diffs), 1)
        if n > 1 and stats.tstd(diffs) > 0:
            half = stats.t.ppf(0.975, n - 1) * stats.tstd(diffs) / n**0.5
            p = stats.ttest_rel([mine[s] for s in seeds], [theirs[s] for s in seeds]).pvalue
            ci, p = f"[{mean - half:+.1f}, {mean + half:+.1f}]", f"{p:.3g}"
        else:  # one pair, or every difference equal: no variance to test against
            ci, p = f"[{mean:+.1f}, {mean:+.1f}]", "n/a"
        lines.append(f"| {other['arm']} | {n} | {mean:+.1f} | {ci} | {p} |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    head = (
        "| arm | cells | training rollouts: mean reward | success | turns with a gradient / all | optimizer steps "
        "| final score per seed | final success per seed | cell wall s |\n" + "| --- " * 9 + "|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['cells']} | {r['train_mean_reward']:.3f} | {r['train_success']:.3f} "
            f"| {r['turns_with_gradient']} / {r['turns']} | {r['optimizer_steps']} "
            f"| {', '.join(f'{s:.1f}' for s in r['final_score_per_seed'])} "
            f"| {', '.join(f'{s:.2f}' for s in r['final_success_per_seed'])} | {r['wall_time_s']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ablation_dir", type=Path)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--versus", metavar="ARM", help="also pair ARM against every other arm")
    args = parser.parse_args()
    rows = arm_rows(args.ablation_dir)
    if not rows:
        raise SystemExit(f"error: {args.ablation_dir} holds no finished cell")
    if (args.ablation_dir / "report.csv").is_file():
        print(outcome_table(args.ablation_dir) + "\n")
    print(markdown(rows))
    if args.versus:
        print("\n" + versus_table(rows, args.versus))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
