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


def run_side_by_side(arms: list[OnlineConfig], log) -> None:
    """Every arm in its own process at once, their progress lines passed back to ``log``: on
    a 2-core machine GRPO and SERL together take the wall time of one."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state forked mid-use
    with ctx.Manager() as manager:
        lines = manager.Queue()
        with ProcessPoolExecutor(len(arms), mp_context=ctx) as pool:
            futures = [pool.submit(_run_arm, arm, lines, os.getpid()) for arm in arms]
            while not all(f.done() for f in futures) or not lines.empty():
                try:
                    log(lines.get(timeout=0.5))
                except queue.Empty:
                    pass
            for f in futures:
                f.result()  # an arm's error, raised here


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
