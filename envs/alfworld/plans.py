"""Expert plans: the planner's command list from each game's start, computed once, cached.

alfworld's planner expert (fast-downward on the game's PDDL) wins every game, but takes a
median of ~5 s and up to minutes per game, so it never runs during rollouts. Its plans
live in JSONL files, one record per game::

    {"game": "json_2.1.1/valid_seen/.../game.tw-pddl", "split": "valid_seen",
     "task_type": "pick_and_place_simple", "plan": ["go to ...", ...],
     "planner_seconds": 4.2, "sha256": "..."}

keyed by the game's path under the data root (``sha256`` of ``game.tw-pddl``, where
present, guards against a changed game). Read from, in order: ``expert_plans.jsonl``
beside the games (shipped with the shared data), the prepared cache
``$SERL_CACHE_DIR/alfworld/expert_plans.jsonl`` that ``serl data prepare`` writes, and any
file the environment's ``plans`` setting names. A failed record (``error`` instead of
``plan``) remembers a timeout, so a rerun with the same or a shorter timeout skips that
game; other failures are retried.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

from envs.alfworld.games import Game, file_sha256

PLANS_FILE = "expert_plans.jsonl"


def cache_dir() -> Path:
    return Path(os.environ.get("SERL_CACHE_DIR") or Path.home() / ".cache" / "serl") / "alfworld"


def default_plan_files(root: Path, extra: Iterable[str | Path] = ()) -> list[Path]:
    return [root / PLANS_FILE, cache_dir() / PLANS_FILE, *map(Path, extra)]


def read_records(path: Path) -> list[dict]:
    """A plan file's records; a torn last line (a writer killed mid-line) is ignored."""
    if not path.is_file():
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("game"), str):
                records.append(rec)
    return records


def load_plans(files: Iterable[Path]) -> dict[str, dict]:
    """game path -> its plan record, over all files (a later file's plan wins)."""
    plans = {}
    for path in files:
        for rec in read_records(Path(path)):
            if isinstance(rec.get("plan"), list):
                plans[rec["game"]] = rec
    return plans


def plan_for(game: Game, plans: dict[str, dict], sha256: Callable[[Path], str] = file_sha256) -> list[str] | None:
    rec = plans.get(game.rel)
    if rec is None:
        return None
    if rec.get("sha256") and rec["sha256"] != sha256(game.path):
        return None  # the game changed since it was planned
    return list(rec["plan"])


# -- computing plans (serl data prepare) ---------------------------------------------------


def compute_plan(game_file: str) -> dict:
    """Run the planner from the game's start and check the plan by replay (child process)."""
    from envs.alfworld import engine

    started = time.perf_counter()
    env = engine.start(game_file, plan=True)
    plan = list(env.reset()["policy_commands"])
    seconds = time.perf_counter() - started
    if not plan:
        return {"error": "the planner found no plan", "planner_seconds": round(seconds, 2)}
    if not engine.replay(game_file, plan):
        return {"error": "the planner's plan does not win on replay", "planner_seconds": round(seconds, 2)}
    return {"plan": plan, "planner_seconds": round(seconds, 2)}


def _child(game_file: str, conn) -> None:
    try:
        conn.send(compute_plan(game_file))
    except Exception as e:  # report, don't hang the parent
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


@dataclass
class PrepareResult:
    planned: int = 0  # new plans written
    failed: int = 0  # timeouts and planner errors written this run
    skipped: int = 0  # already had a plan, or failed before at a timeout at least as long


def prepare_plans(
    games: list[Game],
    out: Path,
    *,
    known: dict[str, dict],
    append: Callable[[Path, dict], None],
    workers: int = 1,
    timeout_s: float = 600.0,
    on_result: Callable[[Game, dict], None] | None = None,
) -> PrepareResult:
    """Plan every game that has no plan yet, ``workers`` games at a time, each in its own
    process killed after ``timeout_s``; each result is appended to ``out`` as it arrives
    (``append``: serl passes its atomic JSONL append), so an interrupted run resumes
    where it stopped."""

    result = PrepareResult()
    failed_before = {r["game"]: r.get("timeout_s", 0) for r in read_records(out) if "error" in r}
    todo = []
    for g in games:
        if g.rel in known or failed_before.get(g.rel, -1) >= timeout_s:
            result.skipped += 1
        else:
            todo.append(g)
    ctx = mp.get_context("fork")
    running: dict = {}  # connection -> (game, process, started)
    todo.reverse()
    while todo or running:
        while todo and len(running) < max(1, workers):
            g = todo.pop()
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(str(g.path), send), daemon=True)
            proc.start()
            send.close()
            running[recv] = (g, proc, time.monotonic())
        deadline = min(t0 + timeout_s for _, _, t0 in running.values())
        ready = wait(list(running), timeout=max(0.0, deadline - time.monotonic()))
        now = time.monotonic()
        for conn in list(running):
            g, proc, t0 = running[conn]
            if conn in ready:
                try:
                    res = conn.recv()
                except EOFError:
                    res = {"error": f"the planner process died (exit code {proc.exitcode})"}
            elif now - t0 >= timeout_s:
                res = {"error": f"timeout after {timeout_s:g} s", "timeout_s": timeout_s}
            else:
                continue
            proc.kill()
            proc.join()
            conn.close()
            del running[conn]
            rec = {"game": g.rel, "split": g.split, "task_type": g.task_type, **res, "sha256": file_sha256(g.path)}
            if "error" in res:  # only a timeout carries timeout_s: a crash or a planner error is retried
                result.failed += 1
            else:
                result.planned += 1
            append(out, rec)
            if on_result:
                on_result(g, rec)
    return result
