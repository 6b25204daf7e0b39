"""Moving finished cells between ablation directories.

* ``serl ablate GRID --out DST --reuse SRC``: a study's grids share arms (GRPO in every question,
  one SERL arm as two questions' baseline). A cell of DST that SRC has already finished is
  copied instead of trained again, when it is the same cell: the same name, overrides and final
  evaluation, the same base as serl resolves it now, and the same starting model by content (the
  ``start_model`` a cell records as it trains; a cell without one is not copied). Then its online
  run and evaluation would be identical (a seed fixes everything on CPU), so the copy is what
  training would give. SRC may be an ablation directory or a folder of kept summaries.
* ``serl ablate --report OUT --keep DIR``: the small per-cell summaries the report reads, copied
  to a folder that is committed, so that ``serl ablate --report DIR`` rebuilds the tables and
  ``curves.png`` without the run directories.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from serl_cli.ablate.cells import cell_config, cell_dir, is_done, start_model_identity
from serl_cli.ablate.grid_record import load_grid_record, resolved_base
from serl_cli.artifacts import io
from serl_cli.errors import SerlError


def _cell_key(record: dict, cell: dict) -> str:
    return json.dumps(
        [cell["name"], cell["overrides"], resolved_base(record["base"]), record["final_eval"]], sort_keys=True
    )


def same_cell(record_a: dict, cell_a: dict, record_b: dict, cell_b: dict) -> bool:
    """Whether the two cells would train and evaluate identically (module docstring)."""
    return _cell_key(record_a, cell_a) == _cell_key(record_b, cell_b)


def reuse_finished_cells(src: str | Path, dst: str | Path) -> tuple[int, list[str]]:
    """Copy SRC's finished cells into DST (whose ``grid.json`` is written) where they are the same
    cell; a cell directory DST already has is left alone. Returns the number copied and the names
    of the cells that matched but started from another model (or did not record theirs)."""
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise SerlError(f"--reuse {src} is the ablation directory itself")
    record_src, record_dst = load_grid_record(src), load_grid_record(dst)
    by_name = {c["name"]: c for c in record_src["cells"]}
    copied, other_start, identities = 0, [], {}
    for cell in record_dst["cells"]:
        other = by_name.get(cell["name"])
        target = cell_dir(dst, cell)
        if (
            other is None
            or target.exists()
            or not is_done(src, other)
            or not same_cell(record_src, other, record_dst, cell)
        ):
            continue
        model = cell_config(record_dst, dst, cell).model  # the base's, or the arm's own
        if model not in identities:  # hashed once per model, not once per cell
            identities[model] = start_model_identity(model)
        if io.read_json(cell_dir(src, other) / "cell.json").get("start_model") != identities[model]:
            other_start.append(cell["name"])
            continue
        tmp = target.with_name(target.name + ".copying")  # a copy cut short never looks like a cell
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(cell_dir(src, other), tmp)
        info = io.read_json(tmp / "cell.json")
        info["index"] = cell["index"]  # this grid's numbering
        io.write_json(tmp / "cell.json", info)
        tmp.rename(target)
        copied += 1
    return copied, other_start


# what the report reads of a cell, besides the selection reports
_SUMMARY_FILES = ("cell.json", "eval.json", "train/metrics.jsonl")


def keep_summaries(out: str | Path, keep: str | Path) -> int:
    """Copy each finished cell's summary (``cell.json``, ``eval.json``, ``train/metrics.jsonl``, the
    last selection report for the bias check and the last one that measured the teacher signal) and
    ``grid.json`` from OUT to KEEP. Returns the number of cells kept."""
    out, keep = Path(out), Path(keep)
    load_grid_record(out)  # an ablation directory, or one clear line
    if out.resolve() == keep.resolve():
        raise SerlError(f"--keep {keep} is the ablation directory itself")
    keep.mkdir(parents=True, exist_ok=True)
    shutil.copy2(out / "grid.json", keep / "grid.json")
    kept = 0
    for cell in sorted((out / "cells").iterdir()) if (out / "cells").is_dir() else []:
        if not (cell / "eval.json").is_file():
            continue
        target = keep / "cells" / cell.name
        (target / "train").mkdir(parents=True, exist_ok=True)
        for name in _SUMMARY_FILES:
            if (cell / name).is_file():
                shutil.copy2(cell / name, target / name)
        reports = sorted((cell / "train").glob("iter_*/selection_report.json"))
        with_signal = [r for r in reports if io.read_json(r).get("teacher", {}).get("teacher_signal")]
        for r in {*reports[-1:], *with_signal[-1:]}:
            (target / "train" / r.parent.name).mkdir(exist_ok=True)
            shutil.copy2(r, target / "train" / r.parent.name / r.name)
        kept += 1
    return kept
