"""Rollouts from a stale policy, beside the trainer: the online loop's ``max_staleness: k > 0``.

**The schedule is fixed, not "whatever weights are newest".** Policy version v is the policy
after v updates (version 0: the starting policy). Iteration j rolls out with version
``max(j - k, 0)`` -- the weights of update j - 1 - k -- while the trainer updates on an earlier
batch; nothing depends on timing, so a run is deterministic for its seed and resumable, and
``producer: inline`` (the same rollouts made one after the other in the trainer's process) is the
sequential reference the background producer must equal. At k = 0 the loop is the synchronous
one of :mod:`serl_cli.online.loop` and nothing here runs.

**Versions are files.** After each update the trainer publishes the new weights to
``RUN/policy_versions/v{n:06d}.safetensors`` (written whole, then renamed); the producer loads
the version a request names between batches, never during one. The SERL teacher of iteration j
reads the same file (:func:`version_weights`): the teacher ratio log pi_T - log pi_old then
compares the version that rolled out on both sides, and staleness never enters the hindsight
signal. A resumed run needs versions ``start - k .. start``; :func:`prune_versions` keeps those
of every checkpoint the run keeps.

**The background producer** (:class:`BackgroundProducer`) is a spawned process with its own
threads (``producer.threads``) and its own copy of the policy -- on the hf engine, or with
``--engine vllm`` a vLLM engine of its own, each version pushed into it -- serving
requests in order: ``(iteration, version, rollout settings)`` in, the episodes out. It works
on iteration j + 1 (up to j + k) while the trainer updates on iteration j. It never outlives
the trainer: the kernel ends it when its parent dies (``PR_SET_PDEATHSIG`` on Linux) and it
checks its parent between turns; SIGINT is the trainer's to handle; SIGTERM ends it quietly
(the trainer, told the same, abandons or finishes its iteration as at k = 0). A producer that
fails sends its error back, and the trainer raises it within a second; one that dies without a
word is reported with its exit code.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from serl_cli.artifacts import io
from serl_cli.errors import SerlError
from serl_cli.online.stop import die_with_parent

if TYPE_CHECKING:  # the environment loads in the producer's process, when it starts
    from multiprocessing.connection import Connection

    from serl_cli.online.stop import StopRequest, StopSignal
    from serl_cli.rollout.engines.vllm import VLLMConfig
    from serl_cli.rollout.worlds import EnvConfig
    from serl_cli.stages.rollout import RolloutConfig

VERSIONS = "policy_versions"  # in the run directory
POLL_S = 0.2  # how often a waiting side looks at the other


def rollout_version(iteration: int, staleness: int) -> int:
    """The policy version iteration ``iteration`` rolls out with: the weights of update
    ``iteration - 1 - staleness`` (version 0, the starting policy, while there is none)."""
    return max(iteration - staleness, 0)


def teacher_version(version: int, sync_interval: int) -> int:
    """The SERL teacher's version for rollouts of ``version``: the snapshot of every
    ``sync_interval``-th update (``annotate.teacher_sync_interval``), as the synchronous loop
    takes it for its own rollout policy; 1: the version that rolled out."""
    return version - version % max(sync_interval, 1)


def version_file(run: Path, version: int) -> Path:
    return Path(run) / VERSIONS / f"v{version:06d}.safetensors"


def publish_version(run: Path, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> Path:
    """``weights`` (``(name, tensor)`` pairs: the learner's stream) as version ``version``, whole
    or not at all: a temporary file renamed into place."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    path = version_file(run, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in weights}
    partial = path.with_name(f".{path.name}.partial")
    try:
        save_file(tensors, str(partial))
        io.follow_umask(partial)  # safetensors makes 0600 files whatever the umask
        os.replace(partial, path)
    except (OSError, SafetensorError) as e:  # safetensors reports a full disk as its own error
        partial.unlink(missing_ok=True)
        raise io.write_failed(path, e) from None
    return path


def version_weights(run: Path, version: int) -> dict[str, torch.Tensor]:
    """Version ``version``'s weights by name; refused in one line where the run lacks it."""
    from safetensors.torch import load_file

    path = version_file(run, version)
    if not path.is_file():
        raise SerlError(
            f"{path} is missing: an asynchronous run (max_staleness > 0) needs the policy versions its rollouts "
            "use, and this run no longer has this one"
        )
    return load_file(str(path))


def oldest_needed(start: int, staleness: int, sync_interval: int) -> int:
    """The oldest version a run resumed at iteration ``start`` reads: its first rollouts' or their teacher's."""
    return teacher_version(rollout_version(start, staleness), sync_interval)


def check_versions(run: Path, start: int, staleness: int, sync_interval: int) -> None:
    """Before a resume at iteration ``start``: the versions its next rollouts and teacher use are all there."""
    first = oldest_needed(start, staleness, sync_interval)
    for v in [first, *range(rollout_version(start, staleness), start + 1)]:
        if not version_file(run, v).is_file():
            raise SerlError(
                f"cannot resume {run} at iteration {start}: policy version {v} ({version_file(run, v).name}) is "
                f"missing from {run / VERSIONS}, and max_staleness {staleness} rolls out with it"
            )


def prune_versions(run: Path, oldest_resume: int, staleness: int, sync_interval: int) -> None:
    """Remove the versions no kept checkpoint can need (:func:`oldest_needed`; ``oldest_resume``:
    the earliest iteration the run can resume at). A version between that one and the rollouts'
    is kept too: few, and the teacher's rule stays simple."""
    folder = Path(run) / VERSIONS
    if not folder.is_dir():
        return
    keep_from = oldest_needed(oldest_resume, staleness, sync_interval)
    for f in folder.glob("v*.safetensors"):
        if int(f.stem[1:]) < keep_from:
            f.unlink(missing_ok=True)


def load_into(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` into ``model``'s parameters by name, every one of them (tied weights
    appear once, as ``named_parameters`` gives them)."""
    params = dict(model.named_parameters())
    if set(params) != set(weights):
        missing = sorted(set(params) - set(weights)) or sorted(set(weights) - set(params))
        raise SerlError(f"a policy version does not fit the rollout model: {missing[0]} differs")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])


@dataclass
class ProducerSetup:
    """What a producer needs to make rollouts, picklable for a spawned process."""

    run: str  # the run directory (its policy_versions/)
    model: str  # the starting policy: the architecture and tokenizer the versions' weights go into
    dtype: torch.dtype
    device: str
    env: EnvConfig
    threads: int | None = None
    parent: int = field(default_factory=os.getpid)
    engine: str = "hf"  # hf: its own copy of the policy in torch; vllm: a vLLM engine of its own
    vllm: VLLMConfig | None = None  # engine vllm: its settings (rollout.vllm)
    gpus: list[int] | None = None  # engine vllm: the GPUs it runs on (rollout.gpus), apart from the trainer's
    seed: int = 0  # engine vllm: the engine's own seed (each request is seeded as in the synchronous loop)


@dataclass
class Produced:
    """One iteration's rollouts as a producer made them."""

    iteration: int
    version: int
    episodes: list
    generate_s: float  # the producer's time on them
    abandoned: bool = False
    idle_s: float = 0.0  # how long the producer waited for this request (its version not yet published)


class VersionedPolicy:
    """The rollout side's own copy of the policy, at whatever version it was last asked for.
    ``stop.requested``: abandon the batch (no new generation round starts)."""

    def __init__(self, setup: ProducerSetup, stop: StopRequest):
        from serl_cli.models.loading import load_model, set_torch_threads
        from serl_cli.rollout.engines import make_engine, model_engine
        from serl_cli.rollout.worlds import build_world

        set_torch_threads(setup.threads)
        self.setup, self.stop = setup, stop
        self.model = None
        if setup.engine == "vllm":  # the engine loads the starting policy itself; versions are pushed into it
            self.engine = model_engine(setup.model, engine="vllm", vllm=setup.vllm, seed=setup.seed, gpus=setup.gpus)
        else:
            self.model, tokenizer = load_model(setup.model, setup.dtype, device=setup.device)
            self.model.config.use_cache = False  # as the trainer's model, which the k = 0 loop generates with
            self.model.eval()
            self.engine = make_engine("hf", self.model, tokenizer)
        self.world = build_world(setup.env)
        self.version: int | None = None

    def load_version(self, version: int) -> None:
        """The weights of ``version`` into the engine: copied into the hf copy's parameters, or pushed into
        vLLM's workers as the synchronous loop's weight sync pushes them (its KV cache reset)."""
        weights = version_weights(Path(self.setup.run), version)
        if self.model is None:
            self.engine.update_weights(weights.items())
        else:
            load_into(self.model, weights)
        self.version = version

    def close(self) -> None:
        """vLLM's engine process goes with the producer; the hf copy needs nothing."""
        from serl_cli.rollout.engines import close_engine

        close_engine(self.engine)

    def produce(self, iteration: int, version: int, rcfg: RolloutConfig) -> Produced:
        from serl_cli.models.loading import set_torch_threads
        from serl_cli.online.ranks import as_stored
        from serl_cli.online.stop import Abandon, StoppableEngine
        from serl_cli.rollout.engines import ModelPolicy
        from serl_cli.stages.rollout import collect, rollout_specs

        t0 = time.perf_counter()
        if version != self.version:  # between batches, never during one
            self.load_version(version)
        set_torch_threads(self.setup.threads)
        policy = ModelPolicy(StoppableEngine(self.engine, self.stop), rcfg.sampling, rcfg.prompt, seed=rcfg.seed)
        try:
            episodes = collect(rcfg, self.world, rollout_specs(rcfg, self.world), policy)
        except Abandon:
            return Produced(iteration, version, [], time.perf_counter() - t0, abandoned=True)
        for episode in episodes:
            for turn in episode.turns:
                turn.policy_version = version
        # as rollouts.jsonl will hold them (the synchronous loop's step), here, off the trainer's path
        return Produced(iteration, version, as_stored(episodes), time.perf_counter() - t0)


class ParentGone:
    """The producer process's stop request: its trainer is gone (it checks between turns)."""

    def __init__(self, parent: int):
        self.parent = parent

    @property
    def requested(self) -> bool:
        return os.getppid() != self.parent


class InlineProducer:
    """``producer: inline``: the lagged schedule made one request at a time in the trainer's own
    process, with its own copy of the policy -- the background producer's reference."""

    def __init__(self, setup: ProducerSetup, stop: StopSignal):
        self.policy = VersionedPolicy(setup, stop)
        self.pending: dict[int, tuple[int, RolloutConfig]] = {}

    def submit(self, iteration: int, version: int, rcfg: RolloutConfig) -> None:
        self.pending[iteration] = (version, rcfg)

    def take(self, iteration: int) -> tuple[Produced, float]:
        version, rcfg = self.pending.pop(iteration)
        return self.policy.produce(iteration, version, rcfg), 0.0

    def close(self) -> None:
        self.pending.clear()
        self.policy.close()


class BackgroundProducer:
    """``producer: background``: a separate Python process serving requests in order (module
    docstring), started as ``python -m serl_cli.online.producer`` -- not forked, so it holds
    no copy of the trainer's threads or memory, and not through multiprocessing's spawn, which
    would import the caller's main script again -- and spoken to over a socket pair.

    **Its death is noticed within** ``POLL_S``: the end of the connection (EOF on a read, a
    broken pipe on a write) means it is gone, and whatever it sent before going (its error) is
    read first. A stop request explains a death (the job's SIGTERM reached it too): the
    iteration is abandoned as at k = 0; otherwise the run ends with one line naming the
    producer and how it ended."""

    def __init__(self, setup: ProducerSetup, stop: StopSignal):
        from multiprocessing import Pipe

        self.stop = stop
        self.conn, theirs = Pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "serl_cli.online.producer", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            # the kernel ends it with this process from its first instruction, before its imports
            # (seconds) could leave it orphaned; the child checks the parent it was forked from
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
        theirs.close()
        self.gone = False  # its end of the connection closed
        self.ready: dict[int, Produced] = {}
        self._send(setup)

    def submit(self, iteration: int, version: int, rcfg: RolloutConfig) -> None:
        self._send((iteration, version, rcfg))

    def _send(self, message: object) -> None:
        if self.gone:
            self._check_gone()
            return
        try:
            self.conn.send(message)
        except OSError:  # BrokenPipeError, ConnectionResetError: it went
            self.gone = True
            self._drain()  # what it said before it went (its error) comes first
            self._check_gone()

    def take(self, iteration: int) -> tuple[Produced | None, float]:
        """Iteration ``iteration``'s rollouts and the seconds the trainer waited for them; None
        once a stop was requested while it waited (the iteration is abandoned)."""
        t0 = time.perf_counter()
        while iteration not in self.ready:
            if self.stop.requested:
                return None, time.perf_counter() - t0
            if self.gone:
                self._check_gone()
                return None, time.perf_counter() - t0  # gone on the job's stop request
            if self.conn.poll(POLL_S):
                self._receive()
            elif self.process.poll() is not None:  # ended, and its end of the socket with it
                self._drain()
                self.gone = True
        return self.ready.pop(iteration), time.perf_counter() - t0

    def _receive(self) -> bool:
        """One message in; False at the end of the connection (at EOF ``poll`` is always true)."""
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):  # its end closed: it went (take() says how)
            self.gone = True
            return False
        if kind == "error":
            self.gone = True
            raise SerlError(f"the rollout producer failed: {payload}")
        self.ready[payload.iteration] = payload
        return True

    def _drain(self) -> None:
        """Read whatever it sent before it went (an error is raised from here)."""
        with contextlib.suppress(OSError):
            while self.conn.poll(0) and self._receive():
                pass

    def _check_gone(self) -> None:
        """It is gone: a stop request explains that (nothing raised: the loop abandons or finishes
        its iteration as on any stop); anything else ends the run in one line."""
        try:
            code = self.process.wait(5)
        except subprocess.TimeoutExpired:  # its connection closed, yet it runs on: it is of no use
            self.process.kill()
            code = self.process.wait(5)
        if self.stop.requested:
            return
        raise SerlError(
            f"the rollout producer (pid {self.process.pid}) {ended(code)} while the trainer ran: "
            "the finished iterations are checkpointed, continue with --resume"
        )

    def close(self) -> None:
        """End the producer now: its unfinished work is of no use to anyone."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.conn.close()


def ended(code: int) -> str:
    """How a process ended, from its return code (negative: the signal that ended it)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def make_producer(mode: str, setup: ProducerSetup, stop: StopSignal) -> BackgroundProducer | InlineProducer:
    return BackgroundProducer(setup, stop) if mode == "background" else InlineProducer(setup, stop)


# -- the producer process -----------------------------------------------------------------------
def serve(conn: Connection) -> None:
    """The producer process: the setup, then requests, each answered with its rollouts, until
    the trainer goes (its end of the connection closes, or it is no longer this process's parent)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    held: list[VersionedPolicy] = []

    def quit_now(*_: object) -> None:  # preemption: the trainer decides what survives; a vLLM engine's process goes too
        for policy in held:
            with contextlib.suppress(BaseException):
                policy.close()
        os._exit(0)

    signal.signal(signal.SIGTERM, quit_now)
    try:
        setup = conn.recv()
        die_with_parent(setup.parent)  # again: a spawn not made by BackgroundProducer
        gone = ParentGone(setup.parent)
        policy = VersionedPolicy(setup, gone)
        held.append(policy)
        idle = time.perf_counter()
        while not gone.requested:
            if not conn.poll(1.0):
                continue
            request = conn.recv()
            waited = time.perf_counter() - idle
            produced = policy.produce(*request)
            produced.idle_s = waited
            conn.send(("done", produced))
            idle = time.perf_counter()
        quit_now()  # the trainer is gone
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the trainer is gone: nothing to tell
        quit_now()
    except BaseException as e:  # everything else goes back to the trainer, in one line
        last = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        where = f" ({Path(last.filename).name}:{last.lineno})" if last and not isinstance(e, SerlError) else ""
        with contextlib.suppress(OSError):
            conn.send(("error", str(e) if isinstance(e, SerlError) else f"{type(e).__name__}: {e}{where}"))
        for policy in held:
            with contextlib.suppress(BaseException):
                policy.close()
        sys.exit(1)


if __name__ == "__main__":
    from multiprocessing.connection import Connection

    # through the package's module, not this __main__: what it sends back must unpickle as
    # serl_cli.online.producer's classes in the trainer
    from serl_cli.online.producer import serve as serve_requests

    serve_requests(Connection(int(sys.argv[1])))
