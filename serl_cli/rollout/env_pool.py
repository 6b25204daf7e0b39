"""Environment steps in worker processes (``rollout.env_workers``).

Each round of :func:`serl_cli.rollout.runner.run_episodes` steps every live environment after the
policy has answered them all; in one process those steps run one after another. With ``N`` workers
each live episode lives in one worker process (episode ``i`` of a call in worker ``i mod N``), every
worker steps its share at once, and the round waits for the slowest worker instead of the sum. Under
``rollout.dispatch: episode`` each episode's step is posted to its worker alone (:meth:`EnvPool.post_step`)
and its answer collected as it comes (:meth:`EnvPool.posted_answers`), while the engine decodes the others.

What stays the same: the episodes. A worker builds the world from the same :class:`EnvConfig`
(``build_world``), resets the same task and is given the same actions, so its steps are the ones the
main process would have taken (``tests/test_env_pool.py``: identical records with 1 and 2 workers).
An environment's failure ends its own episode as in one process (the step limit is applied inside
the worker, on its main thread); a bad task id (``EnvError``) still stops the run with its line. A
worker that dies ends the call with one line naming it.

The workers are started with ``spawn`` (no copy of the parent's torch threads or CUDA state), once
per process and environment, and kept for the next call (an online run's next iteration); they end
with the process that started them: when it exits, or when it dies (the pipe closes under them).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import signal
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from envs.base import EnvError
from serl_cli.errors import SerlError
from serl_cli.rollout.env_step import start_episode, step_episode
from serl_cli.rollout.worlds import EnvConfig, build_world

Key = tuple[int, int]  # (the call, the episode's place in it): unique in a pool's life


def _serve(conn: Connection, env: EnvConfig, step_timeout_s: float | None, make_world: Callable | None) -> None:
    """A worker: build the world, then answer requests until the pipe closes."""
    world = make_world() if make_world is not None else build_world(env)
    live: dict[Key, Any] = {}
    while True:
        try:
            op, payload = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        out: list[tuple[str, Any]] = []
        if op == "start":
            for key, split, max_turns, task_id in payload:
                try:
                    ep, first = start_episode(world, split, max_turns, task_id, step_timeout_s)
                except EnvError as e:
                    out.append(("env_error", str(e)))
                    continue
                if ep is None:  # the environment's failure: this episode ends, the others go on
                    out.append(("failed", first))
                    continue
                live[key] = ep
                methods = [m for m in dir(ep) if not m.startswith("_") and callable(getattr(ep, m, None))]
                out.append(("ok", (ep.instruction, first, methods)))
        elif op == "step":
            for key, action in payload:
                answer = step_episode(live[key], action, step_timeout_s)
                out.append(("failed", answer) if isinstance(answer, str) else ("ok", answer))
        elif op == "call":
            key, name, args = payload
            try:
                out.append(("ok", getattr(live[key], name)(*args)))
            except Exception as e:  # the caller's error, raised where the call was made; the worker goes on
                out.append(("raised", f"{type(e).__name__}: {e}"))
        elif op == "drop":
            for key in payload:
                live.pop(key, None)
                out.append(("ok", None))
        conn.send(out)


class RemoteEpisode:
    """A live episode of a worker, as a policy sees it (``contexts[i]["episode"]``): its instruction
    and task, and its public methods, each a call into the worker (the noisy expert's
    ``optimal_actions`` and ``solvable_actions``)."""

    def __init__(self, pool: EnvPool, key: Key, task_id: int, instruction: str, methods: list[str]):
        self._pool, self.key, self._methods = pool, key, set(methods)
        self.task_id, self.instruction = task_id, instruction

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in self._methods:
            raise AttributeError(name)
        return lambda *args: self._pool.call(self.key, name, args)


class EnvPool:
    """``workers`` processes, each holding its share of the live episodes of one environment."""

    def __init__(
        self, env: EnvConfig, workers: int, step_timeout_s: float | None = None, make_world: Callable | None = None
    ):
        """``make_world``: how a worker builds its world, a function importable by name (spawn pickles it);
        None: ``build_world(env)``, which finds every registered environment and plugin."""
        ctx = mp.get_context("spawn")
        self.env, self.workers = env, workers
        self._conns: list[Connection] = []
        self._procs = []
        for w in range(workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve, args=(child, env, step_timeout_s, make_world), name=f"serl-env-{w}", daemon=True
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._calls = 0
        # steps posted one by one (dispatch episode): each worker's keys in the order it answers them,
        # and answers read early (before another request to the same worker) that await collection
        self._posted: list[deque[Key]] = [deque() for _ in range(workers)]
        self._early: list[tuple[Key, Any]] = []

    def new_call(self) -> int:
        """A fresh key space for one ``run_episodes`` call (its episodes' places start at 0 again)."""
        self._calls += 1
        return self._calls

    def worker_of(self, key: Key) -> int:
        return key[1] % self.workers

    def _exchange(self, op: str, jobs: list[tuple[Key, Any]]) -> list[tuple[str, Any]]:
        """Send each worker its jobs at once, then gather the answers in ``jobs``' order."""
        shares: dict[int, list[int]] = {}
        for j, (key, _) in enumerate(jobs):
            shares.setdefault(self.worker_of(key), []).append(j)
        for w, js in shares.items():
            self._settle(w)
            self._send(w, (op, [jobs[j][1] for j in js]))
        out: list[tuple[str, Any]] = [("", None)] * len(jobs)
        for w, js in shares.items():
            for j, answer in zip(js, self._recv(w), strict=True):
                out[j] = answer
        return out

    def start(self, jobs: list[tuple[Key, str, int | None, int]]) -> list[tuple[str, Any]]:
        """Reset each (key, split, max_turns, task id): ("ok", (instruction, first step, methods)),
        ("failed", why) or ("env_error", message)."""
        return self._exchange("start", [(j[0], j) for j in jobs])

    def step(self, jobs: list[tuple[Key, str]]) -> list[tuple[str, Any]]:
        """Step each (key, action): ("ok", next step) or ("failed", why)."""
        return self._exchange("step", [(key, (key, action)) for key, action in jobs])

    def post_step(self, key: Key, action: str) -> None:
        """Hand one episode's action to its worker and return at once (:meth:`posted_answers` collects)."""
        w = self.worker_of(key)
        self._send(w, ("step", [(key, action)]))
        self._posted[w].append(key)

    def posted_answers(self, timeout: float | None = None) -> list[tuple[Key, Any]]:
        """The posted steps answered so far, as (key, next step or why it failed); waits up to ``timeout``
        seconds (None: until one is) when none is in yet and some are posted."""
        out, self._early = self._early, []
        busy = [w for w in range(self.workers) if self._posted[w]]
        if out or not busy:
            return out
        for conn in wait([self._conns[w] for w in busy], timeout):
            w = self._conns.index(conn)  # type: ignore[arg-type]
            out.append(self._take_posted(w))
        return out

    def _take_posted(self, w: int) -> tuple[Key, Any]:
        ((_, answer),) = self._recv(w)
        return self._posted[w].popleft(), answer

    def _settle(self, w: int) -> None:
        """Read worker ``w``'s answers to posted steps before another request to it (it answers in order)."""
        while self._posted[w]:
            self._early.append(self._take_posted(w))

    def call(self, key: Key, name: str, args: tuple) -> Any:
        w = self.worker_of(key)
        self._settle(w)
        self._send(w, ("call", (key, name, args)))
        ((status, value),) = self._recv(w)
        if status == "raised":
            raise RuntimeError(f"episode {key} in environment worker {w}: {name}() raised {value}")
        return value

    def drop(self, keys: list[Key]) -> None:
        """Forget finished episodes (their worker frees them)."""
        self._exchange("drop", [(key, key) for key in keys])

    def _send(self, w: int, message: tuple) -> None:
        try:
            self._conns[w].send(message)
        except (BrokenPipeError, OSError):
            raise self._died(w) from None

    def _recv(self, w: int) -> list:
        try:
            return self._conns[w].recv()
        except (EOFError, OSError):
            raise self._died(w) from None

    def _died(self, w: int) -> SerlError:
        proc = self._procs[w]
        proc.join(timeout=5)
        code = proc.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited ({code})"
        return SerlError(
            f"environment worker {w} of {self.workers} ({self.env.name}, pid {proc.pid}) {how}: "
            "its episodes cannot go on; rerun (--resume where the stage has it), or set rollout.env_workers=1"
        )

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


_POOLS: dict[tuple, EnvPool] = {}


def pool_for(env: EnvConfig, workers: int, step_timeout_s: float | None = None) -> EnvPool:
    """This process's pool for ``env`` with ``workers`` processes, started on first use and kept."""
    key = (env.name, tuple(sorted((k, repr(v)) for k, v in env.settings.items())), workers, step_timeout_s)
    if key not in _POOLS:
        _POOLS[key] = EnvPool(env, workers, step_timeout_s)
    return _POOLS[key]


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
