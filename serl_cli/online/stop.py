"""Stopping the online loop on a signal (SLURM's preemption): the request, the exception the
loop raises, and the engine that stops generating once a stop is requested (the rules:
:mod:`serl_cli.online.loop`'s docstring, **Preemption**).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from serl_cli.errors import PREEMPTED_EXIT

if TYPE_CHECKING:  # the engine's types, without loading it where the loop only stops
    from serl_cli.rollout.engines import Generation, SamplingConfig

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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


class StopSignal:
    """SIGTERM / SIGUSR1 -> a request to stop at the next safe point (the handlers are
    installed in the main thread only, and restored on exit)."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGTERM:  # a second SIGTERM: stop now, as without serl
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

    def __exit__(self, *exc) -> None:
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

    def __init__(self, engine, stop: StopSignal):
        self.engine, self.stop = engine, stop

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seed: int, row_seeds: list[int] | None = None
    ) -> list[Generation]:
        if self.stop.requested:
            raise Abandon()
        return self.engine.generate(prompts, sampling, seed, row_seeds=row_seeds)

    def __getattr__(self, name):
        return getattr(self.engine, name)
