"""Copy the small per-cell summaries of an ablation into a folder that is committed, so that
``serl ablate --report FOLDER`` rebuilds the report without the run directories.

    python experiments/study/keep_summaries.py runs/study-v3/methods docs/results/sokoban_v3/methods

Per cell: ``cell.json`` (config overrides, status, wall time, teacher tokens, selection summary),
``eval.json`` (the final evaluation), ``train/metrics.jsonl`` (the training curve and the panel
evaluations during training) and the selection reports the report reads (the last iteration's,
for the bias check, and the last one that measured the teacher signal). Plus ``grid.json``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def keep(src: Path, dst: Path) -> int:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "grid.json", dst / "grid.json")
    kept = 0
    for cell in sorted((src / "cells").iterdir()):
        if not (cell / "eval.json").is_file():
            continue
        out = dst / "cells" / cell.name
        (out / "train").mkdir(parents=True, exist_ok=True)
        for name in ("cell.json", "eval.json", "train/metrics.jsonl"):
            shutil.copy2(cell / name, out / name)
        reports = sorted((cell / "train").glob("iter_*/selection_report.json"))
        with_signal = [r for r in reports if json.loads(r.read_text()).get("teacher", {}).get("teacher_signal")]
        for r in {*reports[-1:], *with_signal[-1:]}:
            (out / "train" / r.parent.name).mkdir(exist_ok=True)
            shutil.copy2(r, out / "train" / r.parent.name / r.name)
        kept += 1
    return kept


if __name__ == "__main__":
    print(f"{keep(Path(sys.argv[1]), Path(sys.argv[2]))} cells kept in {sys.argv[2]}")
