"""The online arms of ``serl demo`` side by side: one spawned process each, their progress lines
passed back to the parent's log, and no arm left training once the parent is gone."""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from concurrent.futures import ProcessPoolExecutor

from serl_cli.online.config import OnlineConfig


def progress_line(algo: str, h: dict) -> str:
    return f"      {algo} iteration {h['iteration']}: reward {h['mean_reward']:.3f}, success {h['success_rate']:.3f}"


def run_side_by_side(arms: list[OnlineConfig], log, *, after_arm=None, extra=()) -> dict:
    """Every arm in its own process at once, their progress lines passed back to ``log``: on
    a 2-core machine GRPO and SERL together take the wall time of one.

    More jobs share the same processes, each taking the first one free, so that no core waits
    while another works: ``extra`` jobs queue behind the arms, and ``after_arm(i)`` gives the jobs
    that run once arm ``i`` is done (its evaluation). A job is ``(key, fn, args)``: ``fn(*args,
    log=...)`` runs in a worker, top-level and picklable. The arms take unequal times (SERL's
    teacher costs more than GRPO's update), so the evaluations run while the slower arm trains.
    Returns every job's result by key."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state forked mid-use
    results: dict = {}
    with ctx.Manager() as manager:
        lines = manager.Queue()
        with ProcessPoolExecutor(len(arms), mp_context=ctx) as pool:
            parent = os.getpid()
            pending = {pool.submit(_run_arm, arm, lines, parent): ("arm", i) for i, arm in enumerate(arms)}
            for key, fn, args in extra:
                pending[pool.submit(_run_job, fn, args, lines, parent)] = ("job", key)
            while pending or not lines.empty():
                try:
                    log(lines.get(timeout=0.5))
                except queue.Empty:
                    pass
                for future in [f for f in pending if f.done()]:
                    kind, key = pending.pop(future)
                    value = future.result()  # a job's error, raised here
                    if kind == "job":
                        results[key] = value
                    elif after_arm is not None:
                        for k, fn, args in after_arm(key):
                            pending[pool.submit(_run_job, fn, args, lines, parent)] = ("job", k)
    return results


def exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """End this process once ``parent`` (the pid of the process that started it) is gone: a
    ``serl demo`` stopped by a signal that reaches it alone (``kill PID``, a scheduler's SIGTERM)
    must not leave its arms training on, orphaned. A daemon thread watches this process's parent."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="serl-exit-with-parent").start()


def _run_arm(arm: OnlineConfig, lines, parent: int) -> None:
    from serl_cli.online.loop import run_online

    exit_with_parent(parent)
    run_online(arm, overwrite=True, on_iteration=lambda h: lines.put(progress_line(arm.train.algo, h)))


def _run_job(fn, args, lines, parent: int):
    exit_with_parent(parent)
    return fn(*args, log=lines.put)
