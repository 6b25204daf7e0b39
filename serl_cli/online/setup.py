"""Setting up an online run before its first iteration: checks, where it starts (a fresh run or a
resume), the engines, the learner, the run directory's first records, the teacher and the rollouts'
source. Every process decides where to start from the files alone, before rank 0 changes the run
directory (only once the learner's process group is up and a barrier has passed). The loop itself
is :mod:`serl_cli.online.loop`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from serl_cli.algos.objectives import get_objective
from serl_cli.algos.registry import Objective
from serl_cli.artifacts import io
from serl_cli.artifacts.schema import METRICS_FILE, read_manifest
from serl_cli.errors import SerlError
from serl_cli.method.annotate_config import AnnotateConfig
from serl_cli.method.annotation import teacher_wanted
from serl_cli.method.teacher import TeacherSnapshot
from serl_cli.online.checkpoints import (
    check_resume_checkpoint,
    finished_iterations,
    iter_dir,
    keep_iterations_before,
    resume_point,
)
from serl_cli.online.config import OnlineConfig, check_online_config
from serl_cli.online.derive import annotate_config, eval_config, rollout_config, train_config
from serl_cli.online.ranks import Generators, check_shares
from serl_cli.online.resume import check_online_resume, record_resume
from serl_cli.online.run_file import run_settings
from serl_cli.online.sources import Generation, RolloutSource, Synchronous, lagged_source
from serl_cli.online.stop import StopSignal
from serl_cli.rollout.engines import Engine, close_engine, engine_traits, make_engine
from serl_cli.rollout.engines.vllm_gpus import replica_gpus
from serl_cli.rollout.worlds import build_world, world_info
from serl_cli.stages.evaluate import panel_specs
from serl_cli.stages.rollout import resolve_model, rollout_specs, validate
from serl_cli.training.backends import is_main_process
from serl_cli.training.launch import processes
from serl_cli.training.learner import Learner

if TYPE_CHECKING:
    from envs.base import World


@dataclass
class Start:
    """Where a run starts: iteration ``start`` from ``policy_dir`` (the start model or the checkpoint of
    iteration ``start - 1``); ``changed``: what a resume changes (None: a fresh run)."""

    start: int
    policy_dir: str
    last: Path | None
    changed: dict | None


@dataclass
class Prepared:
    """Everything the iterations of one run need, on this process."""

    start: int
    learner: Learner
    objective: Objective
    acfg: AnnotateConfig
    teacher: TeacherSnapshot | None
    engine: Engine | None  # vLLM's own, or the hf engine over the learner's model; None: a vLLM rank that runs none
    world: World
    source: RolloutSource
    generation: Generation


@contextmanager
def prepared_run(cfg: OnlineConfig, stop: StopSignal, *, resume: bool, overwrite: bool) -> Iterator[Prepared]:
    """The run set up (the module docstring); its engines and its rollouts' source end with the block."""
    run = Path(cfg.out)
    generators, world = checked(cfg)
    main = is_main_process()
    cfg.model = resolve_model(rollout_config(cfg), world)  # as the manifest records it
    at = starting_point(cfg, run, resume=resume, overwrite=overwrite, main=main)
    # an engine that loads the policy itself (vLLM) serves the trainer's process; at max_staleness > 0 the
    # producer runs its own and the trainer evaluates on the hf engine over its weights
    vllm = engine_traits(cfg.rollout.engine).own_weights and cfg.max_staleness == 0
    engine = vllm_engine(cfg, generators, at.policy_dir) if vllm else None
    source: RolloutSource | None = None
    try:
        learner = Learner(
            at.policy_dir, train_config(cfg), state_file=None if at.last is None else at.last / "trainer_state.pt"
        )
        if not vllm:  # hf generates with each process's own learner.model
            engine = make_engine("hf", learner.model, learner.tokenizer)
        learner.barrier()
        if main:
            record_start(cfg, run, world, at, resume=resume)
        objective = get_objective(cfg.train.algo)
        teacher = make_teacher(cfg, objective, learner, at)
        generation = Generation(learner, engine, generators, vllm)
        if cfg.max_staleness > 0:
            source = lagged_source(cfg, run, learner, at.start, stop)
        else:
            source = Synchronous(generation, world, stop, cfg.annotate.teacher_sync_interval)
        # with what the algorithm needs of it (rlsd: every turn and reply token...)
        acfg = annotate_config(cfg)
        yield Prepared(at.start, learner, objective, acfg, teacher, engine, world, source, generation)
    finally:
        if source is not None:
            source.close()
        if vllm:
            close_engine(engine)  # vLLM's engine process and its GPU memory go now, not at exit


def checked(cfg: OnlineConfig) -> tuple[Generators, World]:
    """Every setting checked, and the task counts the environment must hold, before anything is
    written; who generates which groups, and the environment."""
    check_online_config(cfg)
    validate(cfg.rollout)
    sampled = cfg.rollout.sampling.temperature > 0 or (cfg.eval.episodes > 0 and cfg.eval.temperature > 0)
    procs, local = processes(os.environ)
    vcfg = cfg.rollout.vllm
    generators = Generators.of(cfg.rollout.engine, procs, vcfg.data_parallel, vcfg.tensor_parallel_size, local)
    check_shares(cfg.rollout.engine, sampled, cfg.rollout.sampling.coupled, procs, generators.replicas)
    world = build_world(cfg.env)
    check_sizes(cfg, world)
    return generators, world


def check_sizes(cfg: OnlineConfig, world: World) -> None:
    """The task counts the environment must hold: each iteration's draw of ``rollout.tasks`` and
    the evaluation panel, refused in one line before the run directory is touched."""
    rollout_specs(rollout_config(cfg), world)
    if cfg.eval.episodes:  # the same environment, its evaluation split (null: the environment's own)
        ecfg = eval_config(cfg, Path(cfg.out))
        ecfg.env.split = ecfg.env.split or world.eval_split
        panel_specs(ecfg, world)


def starting_point(cfg: OnlineConfig, run: Path, *, resume: bool, overwrite: bool, main: bool) -> Start:
    """A fresh run (the output folder empty, or ``overwrite``) or a resume after the newest finished
    iteration with a checkpoint, held to the run's settings and to its checkpoint's digests."""
    if resume and (run / "manifest.json").exists():
        manifest = read_manifest(run)
        finished = finished_iterations(manifest)
        stored = manifest.stage("online").get("config")
        changed = check_online_resume(run, stored, run_settings(cfg), finished)  # before anything is written
        start = resume_point(run, cfg, finished)
        check_resume_checkpoint(run, manifest, start)  # the files it is about to trust are the ones written
        last = iter_dir(run, start - 1) / "checkpoint" if start > 0 else None
        return Start(start, str(cfg.model) if last is None else str(last), last, changed)
    if main and run.exists() and any(run.iterdir()) and not overwrite:
        raise SerlError(
            f"run directory {run} already exists: pass --resume to continue it or --overwrite to replace it"
        )
    return Start(0, str(cfg.model), None, None)


def vllm_engine(cfg: OnlineConfig, generators: Generators, policy_dir: str) -> Engine | None:
    """This process's vLLM engine, where it runs one (rank 0's serving every process, or one per
    ``tensor_parallel_size`` processes): it loads its own copy of the policy, and starts before the
    trainer's state is on the GPU, so a colocated engine finds the memory it asks for."""
    vcfg = cfg.rollout.vllm
    if generators.replica(int(os.environ.get("RANK", "0"))) is None:
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = replica_gpus(vcfg, local_rank, cfg.train.gpus) if vcfg.data_parallel else cfg.rollout.gpus
    return make_engine("vllm", None, None, model_dir=policy_dir, vllm=vcfg, seed=cfg.seed, gpus=gpus)


def record_start(cfg: OnlineConfig, run: Path, world: World, at: Start, *, resume: bool) -> None:
    """The main process's first records: a fresh run's manifest (an ``--overwrite`` clears the folder
    first), a resume's entry; and on a resume, the journals' lines of the iterations it redoes."""
    if at.start == 0:
        if run.exists() and any(run.iterdir()) and not (resume and (run / "manifest.json").exists()):
            shutil.rmtree(run)  # --overwrite
        run.mkdir(parents=True, exist_ok=True)
        io.write_json(run / "manifest.json", io.new_manifest("online", run_settings(cfg), cfg.seed, world_info(world)))
    if at.changed is not None:
        record_resume(run, run_settings(cfg), at.start, at.changed)
    if resume:
        # a kill between appending an iteration's metrics and marking it done leaves a line for an
        # unfinished iteration, and iterations past the newest checkpoint are redone: drop everything
        # from the resume point on
        for name in (METRICS_FILE, "timings.jsonl"):
            keep_iterations_before(run / name, at.start)


def make_teacher(cfg: OnlineConfig, objective: Objective, learner: Learner, at: Start) -> TeacherSnapshot | None:
    """The teacher snapshot, a copy of what the update changes (sharded under ZeRO-3); none for an
    algorithm without one, or where lambda is already 0 for good (a run resumed past that point)."""
    if not objective.needs_annotations or not teacher_wanted(annotate_config(cfg, at.start, learner.updates)):
        return None
    teacher = TeacherSnapshot(learner)
    if at.last is not None:
        teacher.load(at.last)
    return teacher
