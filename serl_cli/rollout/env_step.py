"""How serl calls an environment: under a time limit, and a failure said in one line (the runner's, in this
process or in a worker of ``rollout.env_workers``)."""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from typing import Any

from envs.base import EnvError


class StepTimeout(Exception):
    """An environment call ran past ``step_timeout_s``."""


@contextmanager
def time_limit(seconds: float | None):
    """Raise :class:`StepTimeout` in the block after ``seconds``. SIGALRM interrupts a hung
    Python loop or a blocking call; it exists only on the main thread, so elsewhere (a
    library embedding serl in a worker thread) the block runs without a limit. A timer already
    set outside (a test runner's own limit) is put back afterwards with the time it has left."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise StepTimeout(f"no answer within {seconds:g} s (env.step_timeout_s)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    outer_left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left > 0:  # the outer timer fires at once if its time ran out meanwhile
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - started), 1e-3))


def describe_failure(e: BaseException) -> str:
    """One line saying how an environment call failed: it timed out, or what it raised."""
    text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"environment {'timed out' if isinstance(e, StepTimeout) else 'raised ' + type(e).__name__}" + (
        f": {text}" if text else ""
    )


def start_episode(
    world: Any, split: str, max_turns: int | None, task_id: int, timeout: float | None
) -> tuple[Any, Any]:
    """A new episode of ``task_id`` and its first step; (None, why) where the environment failed to
    start it. A bad task id (``EnvError``) is the user's input: it propagates, and the run stops."""
    try:
        with time_limit(timeout):
            ep = world.new_episode(split, max_turns)
            return ep, ep.reset(task_id)
    except EnvError:
        raise
    except Exception as e:  # any failure of the environment ends this episode only
        return None, describe_failure(e)


def step_episode(ep: Any, action: str, timeout: float | None) -> Any:
    """The episode's next step, or why the environment failed (a string)."""
    try:
        with time_limit(timeout):
            return ep.step(action)
    except Exception as e:
        return describe_failure(e)
