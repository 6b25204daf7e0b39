"""Running one cell of an ablation (``serl ablate --cell i``): its directory, whether it is
done, its online run and its final evaluation, resumable and locked against a second runner.
The grid itself (the file, the arms) is :mod:`serl_cli.ablate.grid`, ``OUT/grid.json``
:mod:`serl_cli.ablate.grid_record`."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from serl_cli import config as cfgmod
from serl_cli.ablate.grid_record import check_data_dir
from serl_cli.artifacts import io, runlock
from serl_cli.artifacts.records import Manifest
from serl_cli.artifacts.schema import read_manifest
from serl_cli.errors import SerlError


def cell_dir(out: str | Path, cell: dict) -> Path:
    return Path(out) / "cells" / cell["name"]


def is_done(out: str | Path, cell: dict) -> bool:
    d = cell_dir(out, cell)
    if not (d / "cell.json").is_file() or not (d / "eval.json").is_file():
        return False
    try:
        return io.read_json(d / "cell.json").get("status") == "done"
    except SerlError:
        return False


def select_cell(record: dict, index: int) -> dict:
    n = len(record["cells"])
    if not 0 <= index < n:
        raise SerlError(f"--cell {index} out of range: this grid has {n} cells (0..{n - 1})")
    return record["cells"][index]


_WHOLE_FILE_LIMIT = 256 << 20  # hash files up to this size whole; larger weight shards by size and both ends
_END_BYTES = 16 << 20
# what a training writes beside the model, not the model: its optimizer state, and a single update's record
# (stages.train.UPDATE_RECORD), whose wall-clock timings differ on every rebuild of the same weights
_NOT_THE_MODEL = ("trainer_state", "serl_update.json")


def start_model_identity(model: str | None) -> str:
    """What a cell's online run starts from, by content: ``sha256:...`` over a local model directory's
    files (its trainer state and update record aside), ``name:...`` for a hub name, ``embedded`` for the
    default model.
    ``serl ablate --reuse`` copies a cell only where this matches, so a checkpoint retrained under
    the same path (other code, other data) is never mistaken for the one the cell started from."""
    if model is None:
        return "embedded"
    root = Path(model)
    if not root.is_dir():
        return f"name:{model}"
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(_NOT_THE_MODEL)):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(root).as_posix()}\0{size}\0".encode())
        with path.open("rb") as f:
            if size <= _WHOLE_FILE_LIMIT:
                digest.update(f.read())
            else:  # a multi-GB shard: its header (tensor names, shapes) and both ends
                digest.update(f.read(_END_BYTES))
                f.seek(size - _END_BYTES)
                digest.update(f.read())
    return "sha256:" + digest.hexdigest()[:16]


def _teacher_tokens(train: Path) -> int:
    total = 0
    for m in sorted(train.glob("iter_*/manifest.json")):
        try:
            stats = Manifest.from_dict(io.read_json(m), str(m)).stage("annotate").stats
        except SerlError:
            continue
        total += int(stats.get("teacher_tokens_scored", 0) or 0)
    return total


def _selection(train: Path) -> dict | None:
    reports = sorted(train.glob("iter_*/selection_report.json"))
    if not reports:
        return None
    r = io.read_json(reports[-1])
    return {
        "iteration": reports[-1].parent.name,
        "selected_fraction": r.get("counts", {}).get("selected_fraction"),
        "verdict": r.get("tests", {}).get("verdict"),
        # against the scorable turns alone (method.diagnostics.selection_report): the comparison a
        # matched-budget rule needs
        "verdict_scorable": r.get("scorable", {}).get("tests", {}).get("verdict"),
    }


def run_cell(record: dict, out: str | Path, index: int, log=print) -> str:
    """Train and evaluate cell ``index``; returns done | skipped. Under torchrun / the
    deepspeed launcher every process calls it: all of them train (the online loop is
    distributed), the main one keeps the cell's books and runs the final evaluation."""
    from serl_cli.training.backends import is_main_process

    cell = select_cell(record, index)
    d = cell_dir(out, cell)
    check_data_dir(record)  # the data the ablation was started with, or a refusal
    if is_done(out, cell):
        log(f"cell {index} {cell['name']}: done, skipped")
        return "skipped"
    if not is_main_process():
        return _follow_cell(record, out, cell)
    with runlock.run_lock(d):  # two runners given the same cell: the second refuses, naming the first
        return _run_cell(record, out, cell, index, log)


def cell_config(record: dict, out: str | Path, cell: dict):
    """The cell's online-run configuration, writing into ``cells/<name>/train``."""
    from serl_cli.online.config import OnlineConfig

    cfg = cfgmod.from_dict(OnlineConfig, cfgmod.merge(record["base"], cell["overrides"]), "cell")
    cfg.out = str(cell_dir(out, cell) / "train")
    return cfg


def _follow_cell(record: dict, out: str | Path, cell: dict) -> str:
    """A process other than the main one: its part of the cell's online run, nothing else."""
    from serl_cli.online.loop import run_online

    cfg = cell_config(record, out, cell)
    train = Path(cfg.out)
    if (train / "checkpoint" / "config.json").is_file() and _online_done(train):
        return "skipped"
    resume = (train / "manifest.json").is_file()  # read before the main process writes there (see run_online)
    run_online(cfg, resume=resume, overwrite=not resume)
    return "done"


def _run_cell(record: dict, out: str | Path, cell: dict, index: int, log) -> str:
    from serl_cli.models.device import release_memory
    from serl_cli.online.derive import eval_config
    from serl_cli.online.loop import run_online
    from serl_cli.stages.evaluate import run_eval

    d = cell_dir(out, cell)
    if is_done(out, cell):  # another runner finished it between the first check and the lock
        log(f"cell {index} {cell['name']}: done, skipped")
        return "skipped"
    d.mkdir(parents=True, exist_ok=True)
    prev = io.read_json(d / "cell.json") if (d / "cell.json").is_file() else {}
    info = {
        "index": index,
        "name": cell["name"],
        "arm": cell["arm"],
        "seed": cell["seed"],
        "params": cell["params"],
        "start_model": prev.get("start_model"),
        "status": "running",
        "attempts": int(prev.get("attempts", 0)) + 1,
        "wall_time_s": float(prev.get("wall_time_s", 0.0)),
        "teacher_tokens_scored": 0,
    }
    io.write_json(d / "cell.json", info)
    t0, before = time.perf_counter(), info["wall_time_s"]

    def checkpoint_time(_metrics=None):  # a killed cell keeps the time it spent
        info["wall_time_s"] = round(before + time.perf_counter() - t0, 3)
        io.write_json(d / "cell.json", info)

    cfg = cell_config(record, out, cell)
    train = Path(cfg.out)
    trained = (train / "checkpoint" / "config.json").is_file() and _online_done(train)
    if not trained:
        # what --reuse checks before copying the cell: the start of its first attempt
        info["start_model"] = info["start_model"] or start_model_identity(cfg.model)
        io.write_json(d / "cell.json", info)
        resume = (train / "manifest.json").is_file()
        log(f"cell {index} {cell['name']}: {'resuming' if resume else 'training'} ({cfg.iterations} iterations)")
        run_online(cfg, resume=resume, overwrite=not resume, on_iteration=checkpoint_time)
        release_memory()  # the trainer's GPU memory, before the evaluation's engine starts
    fe = record["final_eval"]
    if not (d / "eval.json").is_file():
        # the run's own evaluation (its engine -- vLLM for the paper grids --, device, precision, decoding
        # at the base's eval temperature) of its final policy, on the grid's panel with seed 0
        ecfg = eval_config(cfg, d, model=str(train / "checkpoint"))
        ecfg.env.split, ecfg.episodes, ecfg.panel, ecfg.seed = fe["split"], fe["episodes"], fe.get("panel", "first"), 0
        run_eval(ecfg, overwrite=True)
    ev = io.read_json(d / "eval.json")
    checkpoint_time()
    info.update(
        status="done",
        teacher_tokens_scored=_teacher_tokens(train),
        selection=_selection(train),
        eval={
            k: ev.get(k)
            for k in ("episodes", "success_rate", "success_ci95", "score", "invalid_action_rate", "mean_turns")
        },
    )
    io.write_json(d / "cell.json", info)
    log(f"cell {index} {cell['name']}: success {ev['success_rate']:.3f}  score {ev['score']:.1f}")
    return "done"


def _online_done(train: Path) -> bool:
    try:
        return read_manifest(train).stage("online").done
    except SerlError:
        return False
