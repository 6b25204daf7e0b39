"""Stopping the online loop on a signal (SLURM's preemption): the request, the exception the
loop raises, and the engine that stops generating once a stop is requested (the rules:
:mod:`serl_cli.online.loop`'s docstring, **Preemption**).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from serl_cli.errors import PREEMPTED_EXIT

if TYPE_CHECKING:  # the engine's types, without loading it where the loop only stops
    from serl_cli.rollout.engines import Generation, SamplingConfig

    class StopRequest(Protocol):
        """What asks a rollout to stop: a :class:`StopSignal`, or the producer's ``ParentGone``."""

        @property
        def requested(self) -> bool: ...


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def die_with_parent(parent: int) -> None:
    """Ask the kernel to send this process SIGTERM when its parent dies (Linux), and end it now
    where the parent ``parent`` is already gone (it died before the request took hold). Meant
    for a child between fork and exec (``preexec_fn``; the request survives exec), so that it
    holds from the child's first instruction: a rollout producer, an ablation's cells. Elsewhere
    than Linux nothing is asked (the producer also checks its parent between turns)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


class Preempted(Exception):
    """The loop stopped on SIGTERM/SIGUSR1 with a checkpoint of its last finished iteration."""

    exit_code = PREEMPTED_EXIT

    def __init__(self, run: Path, finished: int, signum: int):
        self.run, self.finished, self.signum = run, finished, signum
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped on {name} after {finished} finished iteration(s), checkpointed: "
            f"continue with --resume (exit code {PREEMPTED_EXIT})"
        )


_early: list[int] = []  # a stop signal taken before the loop's StopSignal was installed (catch_early)


@contextlib.contextmanager
def catch_early() -> Iterator[None]:
    """While it lasts a SIGTERM/SIGUSR1 is a stop request, even before the loop has started: the
    command that runs the loop enters it first, so that a job's SIGTERM while it reads its
    settings or loads the model still ends in a checkpoint and exit 75, not the default death
    (143) that a SLURM script would not requeue. The loop's :class:`StopSignal` takes it over;
    the handlers before it are put back at its end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def record(signum: int, frame: FrameType | None) -> None:
        if not _early:
            print(
                f"serl: {signal.Signals(signum).name} while starting: stopping once the run is set up (exit "
                f"{PREEMPTED_EXIT})",
                file=sys.stderr,
                flush=True,
            )
        _early.append(signum)

    old = {sig: signal.signal(sig, record) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        _early.clear()
        for sig, handler in old.items():
            signal.signal(sig, handler)


class StopSignal:
    """SIGTERM / SIGUSR1 -> a request to stop at the next safe point (the handlers are
    installed in the main thread only, and restored on exit). A signal :func:`catch_early`
    took before is this one's from the start."""

    def __init__(self) -> None:
        self.signum: int | None = _early[0] if _early else None
        self._old: dict = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        _early.clear()
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # a second SIGTERM: stop now, as without serl (a SIGUSR1 before it -- the batch shell passing on
        # the job's SIGTERM, SLURM's time-limit warning -- asked for the same stop: this one is the first)
        if self.signum == signal.SIGTERM and signum == signal.SIGTERM:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.signum is None:
            print(
                f"serl: {signal.Signals(signum).name}: stopping at the next safe point (checkpoint, then exit "
                f"{PREEMPTED_EXIT}; a second SIGTERM stops at once)",
                file=sys.stderr,
                flush=True,
            )
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    @property
    def requested(self) -> bool:
        return self.signum is not None


class Abandon(Exception):
    """Raised inside the rollout phase once a stop was requested."""


class StoppableEngine:
    """The loop's engine during the rollout phase: a generation round does not start once a
    stop is requested (the iteration is abandoned; it is redone, identically, on resume)."""

    # engine: an Engine, or None on a process that generates nothing (a vLLM rank that runs no engine),
    # which is never asked to generate: Any
    def __init__(self, engine: Any, stop: StopRequest):
        self.engine, self.stop = engine, stop

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seed: int, row_seeds: list[int] | None = None
    ) -> list[Generation]:
        if self.stop.requested:
            raise Abandon()
        return self.engine.generate(prompts, sampling, seed, row_seeds=row_seeds)

    def submit(self, key: int, prompt: list[int], sampling: SamplingConfig, seed: int) -> None:
        """dispatch episode: no turn starts once a stop is requested (the runner cancels those under way)."""
        if self.stop.requested:
            raise Abandon()
        self.engine.submit(key, prompt, sampling, seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
