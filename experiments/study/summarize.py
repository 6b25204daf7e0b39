"""What the study's cells learned from: training-side figures per arm of an ablation directory.

    python experiments/study/summarize.py runs/study/webshop-baselines [--json OUT]

For each arm, summed over its seeds and iterations (from ``cells/*/train/metrics.jsonl`` and
``cells/*/cell.json``): the training rollouts' mean reward and success, turns with a gradient
(a nonzero advantage) over all turns, optimizer steps taken, teacher tokens scored, the final
evaluation score per seed, and the cells' wall time. ``serl ablate --report`` covers the final
evaluations and the paired tests; this covers why they came out as they did.
"""

from __future__ import annotations

import argparse
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
        rows.append({
            "arm": arm,
            "cells": len(members),
            "train_mean_reward": sum(m.get("mean_reward", 0.0) * m.get("episodes", 0) for m in its) / max(episodes, 1),
            "train_success": sum(m.get("success_rate", 0.0) * m.get("episodes", 0) for m in its) / max(episodes, 1),
            "turns_with_gradient": sum(m.get("turns_with_gradient", 0) for m in its),
            "turns": sum(m.get("turns", 0) for m in its),
            "optimizer_steps": sum(m.get("optimizer_steps", 0) for m in its),
            "teacher_tokens": sum(m.get("teacher_action_tokens", 0) for m in its),
            "final_score_per_seed": [round(c["eval"]["score"], 1) for c, _ in members],
            "final_success_per_seed": [round(c["eval"]["success_rate"], 3) for c, _ in members],
            "wall_time_s": round(sum(c.get("wall_time_s", 0.0) for c, _ in members), 1),
        })
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| arm | cells | training rollouts: mean reward | success | turns with a gradient / all | optimizer steps "
            "| final score per seed | final success per seed | cell wall s |\n" + "| --- " * 9 + "|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['cells']} | {r['train_mean_reward']:.3f} | {r['train_success']:.3f} "
                     f"| {r['turns_with_gradient']} / {r['turns']} | {r['optimizer_steps']} "
                     f"| {', '.join(f'{s:.1f}' for s in r['final_score_per_seed'])} "
                     f"| {', '.join(f'{s:.2f}' for s in r['final_success_per_seed'])} | {r['wall_time_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ablation_dir", type=Path)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = arm_rows(args.ablation_dir)
    if not rows:
        raise SystemExit(f"error: {args.ablation_dir} holds no finished cell")
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
