"""Copy finished cells from one ablation directory into another where they are the same cell.

    python experiments/study/reuse_cells.py SRC_OUT GRID_FILE DST_OUT

DST's grid is GRID_FILE's (``DST/grid.json`` is written as ``serl ablate GRID_FILE --out DST`` would
write it, or checked against the one there). A cell of it is the same as a cell of SRC when its name, its overrides, the grid's base (as serl resolves
it now) and its final evaluation are all equal: then its online run and evaluation would be identical, and SRC's finished
copy is copied into DST (nothing already in DST is touched). Study v3's grids share arms (serl-obs in
(a), (b) and (d); grpo in (a) and (e); ...), so each shared cell is trained once.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from serl_cli.ablate.cells import cell_dir, is_done
from serl_cli.ablate import grid as ab


def same_cell(a: dict, b: dict, rec_a: dict, rec_b: dict) -> bool:
    """Same name, overrides and final evaluation, and the same base as serl resolves it now (a
    grid.json written before a setting existed has it at its default)."""
    def key(rec, c):
        return json.dumps([c["name"], c["overrides"], ab.resolved_base(rec["base"]), rec["final_eval"]], sort_keys=True)
    return key(rec_a, a) == key(rec_b, b)


def main() -> None:
    src, grid_file, dst = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    dst.mkdir(parents=True, exist_ok=True)
    ab.write_grid(dst, ab.grid_record(ab.load_grid(str(grid_file)), [str(grid_file.resolve())]))
    rec_src, rec_dst = ab.load_grid_record(src), ab.load_grid_record(dst)
    by_name = {c["name"]: c for c in rec_src["cells"]}
    copied = 0
    for cell in rec_dst["cells"]:
        other = by_name.get(cell["name"])
        if other is None or not same_cell(other, cell, rec_src, rec_dst) or not is_done(src, other):
            continue
        target = cell_dir(dst, cell)
        if target.exists():
            continue
        shutil.copytree(cell_dir(src, other), target)
        info_path = target / "cell.json"
        info = json.loads(info_path.read_text())
        info["index"] = cell["index"]  # this grid's numbering
        info_path.write_text(json.dumps(info, indent=2))
        copied += 1
    print(f"{copied} finished cells copied from {src} to {dst}")


if __name__ == "__main__":
    main()
