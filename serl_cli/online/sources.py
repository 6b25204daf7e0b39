"""Where an iteration's rollouts come from: a :class:`RolloutSource`, so that the loop reads the same
whether they are made here, now, or by a producer ahead of the update.

* :class:`Synchronous` (``max_staleness: 0``): iteration k rolls out with the policy of update k - 1,
  on every process's engine (:class:`Generation`), and the teacher is that policy's snapshot every
  ``teacher_sync_interval`` updates.
* :class:`Lagged` (``max_staleness: k > 0``): a producer (:mod:`serl_cli.online.producer`) rolls out
  iteration j with policy version ``j - k`` while the trainer updates; after each update the new
  version is published and the next request made; the teacher is read from the version files
  (the one the synchronous loop would have made for the version that rolled out).

A source hands over a :class:`RolloutBatch`, or None when a stop request abandoned the iteration.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from serl_cli.algos.objectives import get_objective
from serl_cli.artifacts.records import Episode
from serl_cli.models.loading import set_torch_threads
from serl_cli.online.checkpoints import iter_dir
from serl_cli.online.config import OnlineConfig
from serl_cli.online.derive import rollout_config
from serl_cli.online.producer import (
    BackgroundProducer,
    InlineProducer,
    ProducerSetup,
    check_versions,
    make_producer,
    prune_versions,
    publish_version,
    rollout_version,
    teacher_version,
    version_weights,
)
from serl_cli.online.ranks import Generators, PhaseLog, as_stored, in_spec_order
from serl_cli.online.stop import Abandon, StoppableEngine, StopSignal
from serl_cli.rollout.engines import ModelPolicy
from serl_cli.stages.rollout import RolloutConfig, collect, rollout_specs, write_rollout
from serl_cli.training.learner import Learner

if TYPE_CHECKING:
    from envs.base import World
    from serl_cli.method.teacher import TeacherSnapshot
    from serl_cli.rollout.engines import Engine


@dataclass
class RolloutBatch:
    """One iteration's rollouts as every process holds them (stored form, one process's order)."""

    episodes: list[Episode]
    wall_s: float  # generating them (for a producer: its own time on them)
    staleness: int = 0  # updates between the policy that rolled out and the one updated now
    waits: dict = field(default_factory=dict)  # a producer's hand-over: who waited for whom, how long


class RolloutSource(Protocol):
    """What the loop asks of the rollouts' source, in the order it asks."""

    on_policy: bool  # the rollouts' policy is the one updated now (pi_old recomputed before annotating)

    def prime(self, start: int) -> None:
        """Before iteration ``start``: ask for what must be under way already."""

    def teacher_for(self, k: int, teacher: TeacherSnapshot | None) -> None:
        """Make ``teacher`` (None: none) the snapshot iteration ``k``'s rollouts are annotated with."""

    def take(self, k: int, rcfg: RolloutConfig, log: PhaseLog) -> RolloutBatch | None:
        """Iteration ``k``'s rollouts, written to its folder by the main process; None: abandoned."""

    def after_update(self, k: int, episodes: list[Episode]) -> dict:
        """After iteration ``k``'s update: what the source does with the new policy; its metrics."""

    def prune(self, run: Path) -> None:
        """Remove what no kept checkpoint can need any more (main process)."""

    def close(self) -> None:
        """End whatever the source runs; it never outlives the loop."""


class Generation:
    """This process's part in generating with the policy: its engine, its share of the task groups (or
    panel tasks), and the policy whole while the hf engine generates with it."""

    def __init__(self, learner: Learner, engine: Engine | None, generators: Generators, vllm: bool):
        self.learner, self.engine, self.generators, self.vllm = learner, engine, generators, vllm
        self.rank = learner.backend.rank

    def whole(self) -> AbstractContextManager:
        """The policy whole while this process's hf engine generates with it (under ZeRO-3 a
        collective: every process enters); nothing for vLLM, which holds its own copy."""
        return nullcontext() if self.vllm else self.learner.full_model()

    def share(self, specs: list, by_group: bool = True) -> list:
        """This process's share of ``specs``: its engine's task groups (or panel tasks); none
        where it runs no engine (vLLM: rank 0's serves them all, or data parallel one per
        tensor-parallel group of processes)."""
        return self.generators.share(specs, self.rank, by_group)

    def served_by(self, specs: list) -> str:
        """Which engines generate while this process, which runs none, waits ("" where it runs one)."""
        if self.generators.replica(self.rank) is not None:
            return ""
        if self.generators.replicas == 1:
            return " (rank 0's vLLM engine serves every group)"
        servers = sorted({self.generators.server(s.group_id) for s in specs})
        return f" (the vLLM engines of ranks {', '.join(map(str, servers))} serve the groups)"


class Synchronous:
    """``max_staleness: 0``: the rollouts of the policy as it is, made on every process's engine."""

    on_policy = True

    def __init__(self, generation: Generation, world: World, stop: StopSignal, teacher_sync_interval: int):
        self.generation, self.world, self.stop = generation, world, stop
        self.learner = generation.learner
        self.sync_interval = max(teacher_sync_interval, 1)

    def prime(self, start: int) -> None:
        pass

    def teacher_for(self, k: int, teacher: TeacherSnapshot | None) -> None:
        if teacher is not None and self.learner.updates % self.sync_interval == 0:
            teacher.sync()  # the teacher becomes this rollout policy

    def take(self, k: int, rcfg: RolloutConfig, log: PhaseLog) -> RolloutBatch | None:
        """Every process's episodes, gathered in one process's order (rank 0 writes them); None
        where a process abandoned its rollouts on a stop request."""
        t0 = time.perf_counter()
        specs = rollout_specs(rcfg, self.world)
        mine = self.generation.share(specs)
        records, abandoned = self._generate(rcfg, mine)
        groups = sorted({s.group_id for s in mine})
        log.phase(
            "rollout",
            time.perf_counter() - t0,
            f"{len(groups)} group(s) {groups}, {len(mine)} episode(s), {sum(r.num_turns for r in records)} turn(s)"
            + self.generation.served_by(specs),
            groups=len(groups),
            episodes=len(mine),
        )
        parts = self.learner.all_gather((records, abandoned))
        if any(a for _, a in parts):
            return None
        episodes = as_stored(in_spec_order(specs, [p for p, _ in parts]))
        wall = time.perf_counter() - t0
        if self.learner.is_main:
            write_rollout(rcfg, episodes, wall)
        return RolloutBatch(episodes, wall)

    def _generate(self, rcfg: RolloutConfig, mine: list) -> tuple[list[Episode], bool]:
        set_torch_threads(rcfg.threads)
        with self.generation.whole():
            self.learner.model.eval()
            engine = StoppableEngine(self.generation.engine, self.stop)
            policy = ModelPolicy(engine, rcfg.sampling, rcfg.prompt, seed=rcfg.seed)
            try:
                return (collect(rcfg, self.world, mine, policy) if mine else []), False
            except Abandon:
                return [], True

    def after_update(self, k: int, episodes: list[Episode]) -> dict:
        return {}

    def prune(self, run: Path) -> None:
        pass

    def close(self) -> None:
        pass


class Lagged:
    """``max_staleness: k > 0``: iteration j's rollouts made by a producer with policy version j - k
    (the module docstring of :mod:`serl_cli.online.producer` has the schedule).

    On several trainer processes rank 0 runs the one producer and hands each batch to every process
    (over the host group); every process takes part in publishing each version (under ZeRO-3 each
    weight is gathered, a collective), which rank 0 writes, and reads the teacher's versions back,
    each keeping its own share."""

    on_policy = False

    def __init__(
        self, cfg: OnlineConfig, run: Path, learner: Learner, producer: BackgroundProducer | InlineProducer | None
    ):
        self.cfg, self.run, self.learner, self.producer = cfg, run, learner, producer
        self.interval = versions_interval(cfg)
        self.loaded_teacher: int | None = None  # the version the teacher holds

    def request(self, j: int) -> None:
        """Ask the producer for iteration ``j``'s rollouts, with the version the schedule names."""
        if self.producer is not None:
            rcfg = rollout_config(self.cfg, j, iter_dir(self.run, j))
            self.producer.submit(j, rollout_version(j, self.cfg.max_staleness), rcfg)

    def prime(self, start: int) -> None:
        for j in range(start, min(start + self.cfg.max_staleness + 1, self.cfg.iterations)):
            self.request(j)  # their versions are published already

    def teacher_for(self, k: int, teacher: TeacherSnapshot | None) -> None:
        """The version the synchronous loop would have made the teacher for the version that rolled
        out (``teacher_version``), read from the published versions: the teacher ratio then compares
        one version on both sides."""
        if teacher is None:
            return
        version = teacher_version(rollout_version(k, self.cfg.max_staleness), self.cfg.annotate.teacher_sync_interval)
        if version != self.loaded_teacher:
            teacher.load_weights(version_weights(self.run, version))
            self.loaded_teacher = version

    def take(self, k: int, rcfg: RolloutConfig, log: PhaseLog) -> RolloutBatch | None:
        """Iteration ``k``'s rollouts from the producer (rank 0's, handed to every process), written
        as the synchronous source writes its own; and how long each side waited for the other."""
        t0 = time.perf_counter()
        made, waited = self.producer.take(k) if self.producer is not None else (None, 0.0)
        made = self.learner.all_gather(made)[0]  # rank 0's batch, on every process
        if made is None or made.abandoned:
            return None
        log.phase("rollout", made.generate_s, f"version {made.version}, {len(made.episodes)} episode(s)")
        if self.learner.is_main:
            write_rollout(rcfg, made.episodes, made.generate_s)  # stored form already (VersionedPolicy.produce)
        waits = {
            "rollout_wait_s": round(waited, 3),  # the trainer, for the producer
            "producer_idle_s": round(made.idle_s, 3),  # the producer, for this request's version
            "producer_generate_s": round(made.generate_s, 3),
            "take_s": round(time.perf_counter() - t0, 3),
        }
        return RolloutBatch(made.episodes, made.generate_s, k - rollout_version(k, self.cfg.max_staleness), waits)

    def after_update(self, k: int, episodes: list[Episode]) -> dict:
        """The new version out, and the rollouts that wait for it asked for."""
        publish(self.run, k + 1, self.learner)
        if k + 1 + self.cfg.max_staleness < self.cfg.iterations:
            self.request(k + 1 + self.cfg.max_staleness)
        return stale_stats(episodes, k)

    def prune(self, run: Path) -> None:
        if self.learner.is_main:
            prune_versions(run, oldest_resume(run), self.cfg.max_staleness, self.interval)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()  # an asynchronous run's producer never outlives its loop


def publish(run: Path, version: int, learner: Learner) -> None:
    """The policy as version ``version``: every process streams its weights (under ZeRO-3 each one
    gathered, a collective), rank 0 writes the file, and every process waits for it, since each
    reads its teacher's versions back."""
    stream = learner.stream_weights()
    if learner.is_main:
        publish_version(run, version, stream)
    else:
        for _ in stream:  # its part of each weight's gather
            pass
    learner.barrier()


def lagged_source(cfg: OnlineConfig, run: Path, learner: Learner, start: int, stop: StopSignal) -> Lagged:
    """The producer of ``max_staleness > 0`` (:mod:`serl_cli.online.producer`), started on rank 0:
    version 0 published on a fresh run, the versions a resume reads checked first."""
    if start == 0:
        publish(run, 0, learner)
    else:
        check_versions(run, start, cfg.max_staleness, versions_interval(cfg))
    if not learner.is_main:
        return Lagged(cfg, run, learner, None)
    setup = ProducerSetup(
        run=str(run),
        model=str(cfg.model),
        dtype=learner.backend.load_dtype,
        device=str(learner.backend.device),
        env=cfg.env,
        threads=cfg.producer.threads or cfg.train.threads,
        engine=cfg.rollout.engine,
        vllm=cfg.rollout.vllm,
        gpus=cfg.rollout.gpus,
        seed=cfg.seed,
    )
    return Lagged(cfg, run, learner, make_producer(cfg.producer.mode, setup, stop))


def versions_interval(cfg: OnlineConfig) -> int:
    """Every how many versions a teacher snapshot is read from the version files: the teacher's sync
    interval, or 1 for an algorithm without a teacher (GRPO), whose runs then keep only the versions
    their rollouts use (``prune_versions``)."""
    return cfg.annotate.teacher_sync_interval if get_objective(cfg.train.algo).needs_annotations else 1


def stale_stats(episodes: list[Episode], k: int) -> dict:
    """How old iteration ``k``'s rollouts were, in updates: per turn ``k - policy_version``."""
    ages = [k - t.policy_version for e in episodes for t in e.turns if t.policy_version is not None]
    if not ages:
        return {}
    return {"staleness_mean": sum(ages) / len(ages), "staleness_max": max(ages)}


def oldest_resume(run: Path) -> int:
    """The earliest iteration the run can resume at: after its oldest kept checkpoint (0: none kept)."""
    kept = [int(c.parent.name.split("_")[1]) for c in run.glob("iter_*/checkpoint") if c.is_dir()]
    return min(kept) + 1 if kept else 0
