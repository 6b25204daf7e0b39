"""The online loop: K times rollout -> (annotate) -> update, resumable and preemptible.

Layout of ``RUN``::

    RUN/manifest.json              stages: one entry per finished iteration
    RUN/online.yaml                the resolved configuration, each setting once (run_settings)
    RUN/iter_0000/                 rollouts.jsonl, manifest.json (+ annotations, eval.json); once a
                                   later iteration is done, ``old_rollouts`` keeps, gzips or deletes
                                   the records (the loop never reads them again)
    RUN/iter_0000/checkpoint/      the policy after this iteration's update (every ``save_every``
                                   iterations, the newest ``keep_last`` kept)
    RUN/metrics.jsonl              one record per iteration (deterministic on CPU)
    RUN/timings.jsonl              wall times and throughput, each process's phases (machine-dependent)
    RUN/checkpoint/                the final policy

An iteration counts as finished once the manifest says so; ``--resume`` restarts after
the newest iteration with a checkpoint (model, optimizer, update counter, teacher), redoing
any finished iterations after it, so a resumed run's artifacts equal an uninterrupted run's.
It resumes with the settings the run was made with: another setting is refused, bar those
:mod:`serl_cli.stages.resume_settings` lets a resume change (:mod:`serl_cli.online.resume`), which
the manifest records.
Iteration k's rollouts use seed ``seed * 1000 + k``; the update is seeded by ``seed``.

**Every process works.** Under torchrun / the deepspeed launcher (W processes; W = 1 is the
same code) an iteration runs on all of them (:mod:`serl_cli.online.ranks`):

1. *Rollout.* The iteration's task groups are drawn as in ``serl rollout`` (the same on
   every process). With the hf engine group g is process ``g % W``'s: each generates its own
   groups on its own device with its own model (under ZeRO-3 gathered whole while it
   generates). With vLLM, rank 0's engine serves every group (vLLM batches them over its own
   GPUs) and the other processes wait for it; or, with ``rollout.vllm.data_parallel``, every
   ``tensor_parallel_size`` processes run an engine on their own GPUs and group g is engine
   ``g % R``'s (R engines), so every GPU generates (:class:`serl_cli.online.ranks.Generators`).
   The episodes are gathered and put in the order one process writes them, so every process
   holds the same batch; rank 0 writes ``iter_k``. A row's draws must not depend on the
   engine or batch it ran in: with several engines ``rollout.sampling.coupled`` is required
   (it keys each row's draws by seed, row and turn), and then 1 and W processes give the same
   rollouts (under vLLM up to its kernels' batch-dependent rounding).
2. *π_old recompute and teacher scoring* go through one function
   (:func:`serl_cli.training.scoring.score`): every process makes the micro-batches one process
   would, scores those dealt to it (largest first, so that each has as many and about as many
   tokens as the others, whatever its groups' episode lengths) and the results are gathered,
   bit for bit one process's. Under ZeRO-3 nothing is gathered whole for it: the forwards
   gather layer by layer, every process running as many (stand-in passes for fewer). The
   annotation's cheap, deterministic parts (blocks, placement over the whole batch, weights)
   run on the whole batch on every process, so its result equals one process's; rank 0
   writes it.
3. *The teacher* (:class:`serl_cli.method.teacher.TeacherSnapshot`) is never a second model:
   under ZeRO-3 each process keeps a copy of its own partitions, swapped in while it scores;
   otherwise a copy held in CPU memory between scorings (under LoRA the adapter's only).
4. *The periodic evaluation* is divided over the same engines (panel task i is engine
   ``i % R``'s), gathered, and rank 0 writes ``eval.json``.
5. *The update* is data parallel over micro-batches (``training.deepspeed``).
6. *Memory.* Nothing is gathered whole while vLLM generates or evaluates; the in-memory
   weight sync streams the weights (under ZeRO-3 one gathered at a time; under LoRA merged
   one layer at a time; every engine takes the same stream); colocated (``rollout.vllm.sleep``),
   vLLM starts before the trainer's state is on the GPU, and every process empties its
   allocator's cache before an engine wakes;
   ``weight_sync: disk`` writes only the weights vLLM reads when no checkpoint is due.
7. Each process logs one stderr line per phase with its counts and seconds when W > 1
   (``serl: rank 1/2: rollout 2 group(s), 4 episode(s), 9 turn(s), 3.1 s``), and every
   process's phases and peak memory go to ``timings.jsonl`` (``ranks``); the annotate stage's
   split, the teacher's forward passes against the rest, in ``update.annotate``.
8. *The teacher goes* once lambda is 0 for good (``method.annotation.teacher_wanted``; lambda
   never rises again): before that iteration the snapshot is dropped, later checkpoints hold
   no teacher state and the annotation runs without it, every weight 1 as it was with the
   teacher unused, so the update is unchanged. A run resumed at or past that point builds none.

**Checkpoints.** Iteration k writes ``iter_k/checkpoint`` when ``(k + 1) % save_every == 0``,
at the last iteration, and when the run is stopped; then only the newest ``keep_last`` of
them stay (0: all). ``save_every: 1`` (the default) resumes from the last finished iteration.
The first one's size is printed, and each one's is in ``timings.jsonl``.

**Preemption** (a SLURM job near its time limit, a requeue; :mod:`serl_cli.online.stop`):
SIGTERM or SIGUSR1 asks the loop to stop (a second SIGTERM ends the process at once). Before
an iteration's update has started the iteration is abandoned -- its rollouts would be
collected again the same way; once it has started the iteration is finished (update,
checkpoint, periodic evaluation). Either way the last finished iteration then has a
checkpoint, and the loop raises :class:`Preempted`; the CLI exits with 75 (EX_TEMPFAIL), and
the same command with ``--resume`` continues. A stop any process got stops them all.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import cast

from serl_cli.algos.objectives import annotation_advantages, get_objective
from serl_cli.artifacts import io
from serl_cli.artifacts.records import Episode, Metrics
from serl_cli.artifacts.schema import METRICS_FILE, append_metrics, read_manifest, turn_samples
from serl_cli.errors import SerlError
from serl_cli.method.annotation import annotate_episodes, teacher_wanted
from serl_cli.method.teacher import TeacherSnapshot
from serl_cli.models.loading import set_torch_threads
from serl_cli.online.checkpoints import (
    check_resume_checkpoint,
    checkpoint_due,
    finished_iterations,
    iter_dir,
    keep_iterations_before,
    prune_checkpoints,
    record_checkpoint,
    resumable,
    resume_point,
    retire_old_rollouts,
)
from serl_cli.online.config import OnlineConfig, check_online_config
from serl_cli.online.derive import annotate_config, eval_config, rollout_config, train_config
from serl_cli.online.producer import (
    ProducerSetup,
    check_versions,
    make_producer,
    prune_versions,
    publish_version,
    rollout_version,
    teacher_version,
    version_weights,
)
from serl_cli.online.ranks import CountingScorer, Generators, PhaseLog, as_stored, check_shares, in_spec_order
from serl_cli.online.resume import check_online_resume, record_resume
from serl_cli.online.run_file import run_settings
from serl_cli.online.stop import Abandon, Preempted, StoppableEngine, StopSignal
from serl_cli.online.sync import PolicyOut
from serl_cli.rollout.engines import ModelPolicy, close_engine, make_engine, sleep_engine
from serl_cli.rollout.engines.vllm import replica_gpus
from serl_cli.rollout.runner import run_episodes
from serl_cli.rollout.worlds import build_world, built_split, world_info
from serl_cli.stages.annotate import write_annotations
from serl_cli.stages.evaluate import model_eval_policy, panel_specs, write_eval
from serl_cli.stages.rollout import RolloutConfig, collect, resolve_model, rollout_specs, validate, write_rollout
from serl_cli.training.backends import is_main_process
from serl_cli.training.launch import processes
from serl_cli.training.learner import Learner
from serl_cli.training.train_config import recompute_enabled


def run_online(cfg: OnlineConfig, *, resume: bool = False, overwrite: bool = False, on_iteration=None) -> list[Metrics]:
    """Run the loop (see the module docstring); raises :class:`Preempted` when stopped by a signal."""
    with StopSignal() as stop:
        return _run_online(cfg, stop, resume=resume, overwrite=overwrite, on_iteration=on_iteration)


def _run_online(cfg: OnlineConfig, stop: StopSignal, *, resume: bool, overwrite: bool, on_iteration) -> list[Metrics]:
    run = Path(cfg.out)
    check_online_config(cfg)
    validate(cfg.rollout)
    sampled = cfg.rollout.sampling.temperature > 0 or (cfg.eval.episodes > 0 and cfg.eval.temperature > 0)
    procs, local = processes(os.environ)
    vcfg = cfg.rollout.vllm
    generators = Generators.of(cfg.rollout.engine, procs, vcfg.data_parallel, vcfg.tensor_parallel_size, local)
    check_shares(cfg.rollout.engine, sampled, cfg.rollout.sampling.coupled, procs, generators.replicas)
    world = build_world(cfg.env)
    check_sizes(cfg, world)  # before anything is written
    # Every process decides where to start from the files alone, before rank 0 changes the run
    # directory (only once the learner's process group is up and a barrier has passed).
    main = is_main_process()
    train_cfg = train_config(cfg)  # the update is seeded by the run's seed (online.derive)
    start, changed = 0, None
    cfg.model = resolve_model(rollout_config(cfg), world)  # as the manifest records it
    if resume and (run / "manifest.json").exists():
        manifest = read_manifest(run)
        finished = finished_iterations(manifest)
        stored = manifest.stage("online").get("config")
        changed = check_online_resume(run, stored, run_settings(cfg), finished)  # before anything is written
        start = resume_point(run, cfg, finished)
        check_resume_checkpoint(run, manifest, start)  # the files it is about to trust are the ones written
    elif main and run.exists() and any(run.iterdir()) and not overwrite:
        raise SerlError(
            f"run directory {run} already exists: pass --resume to continue it or --overwrite to replace it"
        )
    last = iter_dir(run, start - 1) / "checkpoint" if start > 0 else None
    policy_dir = cfg.model if last is None else str(last)
    # vLLM (rank 0's serving every process, or one per tensor_parallel_size processes) loads its own
    # copy of the policy; it starts before the trainer's state is on the GPU, so a colocated engine
    # finds the memory it asks for
    vllm = cfg.rollout.engine == "vllm"
    engine = producer = None
    rank = int(os.environ.get("RANK", "0"))
    if vllm and generators.replica(rank) is not None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        gpus = replica_gpus(vcfg, local_rank, cfg.train.gpus) if vcfg.data_parallel else cfg.rollout.gpus
        engine = make_engine("vllm", None, None, model_dir=policy_dir, vllm=vcfg, seed=cfg.seed, gpus=gpus)
    try:
        learner = Learner(policy_dir, train_cfg, state_file=None if last is None else last / "trainer_state.pt")
        if cfg.max_staleness > 0 and learner.backend.sharded:  # before the run directory is touched
            # the stale teacher and the producer read whole weights from the version files
            raise SerlError("max_staleness > 0 with ZeRO-3: on one trainer process use ZeRO-1/2 or the torch backend")
        if not vllm:  # hf generates with each process's own learner.model
            engine = make_engine(cfg.rollout.engine, learner.model, learner.tokenizer)
        learner.barrier()
        if main and start == 0:
            if run.exists() and any(run.iterdir()) and not (resume and (run / "manifest.json").exists()):
                shutil.rmtree(run)  # --overwrite
            run.mkdir(parents=True, exist_ok=True)
            io.write_json(
                run / "manifest.json", io.new_manifest("online", run_settings(cfg), cfg.seed, world_info(world))
            )
        if changed is not None and main:
            record_resume(run, run_settings(cfg), start, changed)
        if resume and main:
            # a kill between appending an iteration's metrics and marking it done leaves a line
            # for an unfinished iteration, and iterations past the newest checkpoint are redone:
            # drop everything from the resume point on
            for name in (METRICS_FILE, "timings.jsonl"):
                keep_iterations_before(run / name, start)
        objective = get_objective(cfg.train.algo)
        acfg = annotate_config(cfg)  # with what the algorithm needs of it (rlsd: every turn and reply token...)
        teacher = None
        # no teacher where lambda is already 0 for good (Loop.drop_teacher): a run resumed past that point
        if objective.needs_annotations and teacher_wanted(annotate_config(cfg, start, learner.updates)):
            teacher = TeacherSnapshot(learner)  # a copy of what the update changes (sharded under ZeRO-3)
            if last is not None:
                teacher.load(last)
        if cfg.max_staleness > 0:
            producer = start_producer(cfg, run, learner, start, stop)
        loop = Loop(cfg, run, learner, objective, acfg, teacher, engine, stop, world, producer, generators)
        return loop.iterations(start, on_iteration)
    finally:
        if producer is not None:
            producer.close()  # an asynchronous run's producer never outlives its loop
        if vllm:
            close_engine(engine)  # vLLM's engine process and its GPU memory go now, not at exit


def check_sizes(cfg: OnlineConfig, world) -> None:
    """The task counts the environment must hold: each iteration's draw of ``rollout.tasks`` and
    the evaluation panel, refused in one line before the run directory is touched."""
    rollout_specs(rollout_config(cfg), world)
    if cfg.eval.episodes:  # the same environment, its evaluation split (null: the environment's own)
        ecfg = eval_config(cfg, Path(cfg.out))
        ecfg.env.split = ecfg.env.split or world.eval_split
        panel_specs(ecfg, world)


def start_producer(cfg: OnlineConfig, run: Path, learner: Learner, start: int, stop: StopSignal):
    """The rollout producer of ``max_staleness > 0`` (:mod:`serl_cli.online.producer`):
    version 0 published on a fresh run, the versions a resume reads checked, then started."""
    if start == 0:
        publish_version(run, 0, learner.stream_weights())
    else:
        check_versions(run, start, cfg.max_staleness, versions_interval(cfg))
    setup = ProducerSetup(
        run=str(run),
        model=str(cfg.model),
        dtype=learner.backend.load_dtype,
        device=str(learner.backend.device),
        env=cfg.env,
        threads=cfg.producer.threads or cfg.train.threads,
    )
    return make_producer(cfg.producer.mode, setup, stop)


class Loop:
    """The iterations of one run, on one process (every process runs the same)."""

    def __init__(
        self,
        cfg: OnlineConfig,
        run: Path,
        learner: Learner,
        objective,
        acfg,
        teacher,
        engine,
        stop,
        world,
        producer,
        generators: Generators,
    ):
        self.cfg, self.run, self.learner, self.objective = cfg, run, learner, objective
        self.producer = producer
        self.teacher_version: int | None = None
        self.acfg, self.teacher, self.engine, self.stop, self.world = acfg, teacher, engine, stop, world
        self.annotating = objective.needs_annotations
        self.rank, self.size, self.main = learner.backend.rank, learner.backend.world, learner.is_main
        # pi_old by the trainer before anything reads it (the teacher's weights and the PPO ratio)
        self.recompute = objective.uses_behaviour_logprobs and recompute_enabled(cfg.train, cfg.rollout.engine)
        self.vllm = cfg.rollout.engine == "vllm"
        self.generators = generators  # who generates which groups (online.ranks)
        self.out = PolicyOut(learner, teacher, engine, cfg.rollout.vllm if self.vllm else None)

    def iterations(self, start: int, on_iteration) -> list[Metrics]:
        cfg, run, learner, main = self.cfg, self.run, self.learner, self.main
        self.out.sized = start > 0  # the checkpoint's size is said when a run starts, not again on resume
        history: list[Metrics] = []
        if self.producer is not None:  # the first k + 1 iterations' versions are published already
            for j in range(start, min(start + cfg.max_staleness + 1, cfg.iterations)):
                self.request(j)
        for k in range(start, cfg.iterations):
            t0 = time.perf_counter()
            it = iter_dir(run, k)
            rcfg = rollout_config(cfg, k, it)
            temperature = rcfg.sampling.temperature if rcfg.sampling.temperature > 0 else 1.0
            log = PhaseLog(self.rank, self.size, learner.backend.device)
            if self.teacher is not None and not teacher_wanted(annotate_config(cfg, k, learner.updates)):
                self.drop_teacher()
            staleness, waits = 0, {}
            if self.producer is None:
                if self.teacher is not None and learner.updates % max(self.acfg.teacher_sync_interval, 1) == 0:
                    self.teacher.sync()  # the teacher becomes this rollout policy
                episodes, rollout_wall, abandon = self.rollout(rcfg, log)
            else:
                staleness = k - rollout_version(k, cfg.max_staleness)
                self.stale_teacher(k)
                episodes, rollout_wall, abandon, waits = self.produced(k, rcfg, log)
            recomputed, annotations, meta = {}, None, None
            if not abandon:
                sleep_engine(self.engine)  # vLLM with sleep: true frees its GPU memory for the trainer
                # synchronous: pi_old recomputed first, and the teacher ratio reads it; stale rollouts are
                # annotated against their own version's log-probs, and the update recomputes pi_prox
                # where a gradient needs it (Learner.update)
                if self.producer is None and self.recompute:
                    recomputed = self.recompute_logp_old(episodes, temperature, log)
                if self.annotating:
                    annotations, meta = self.annotate(episodes, rcfg, it, k, temperature, log)
            signum = self.agreed_signal()  # a stop any process was asked for, before the update: abandon
            if abandon or signum is not None:  # iteration k is redone on resume; k - 1 must have its checkpoint
                if k > 0 and not resumable(run, k - 1):
                    self.out.save(iter_dir(run, k - 1) / "checkpoint", cfg.rollout.prompt)
                    if main:
                        record_checkpoint(run, k - 1)
                if main:
                    prune_checkpoints(run, cfg.keep_last)
                assert signum is not None  # rollouts are abandoned only on a stop request: a process got a signal
                raise Preempted(run, k, signum)
            metrics = learner.update(
                episodes, temperature, annotations, meta, engine=cfg.rollout.engine, staleness=staleness
            )
            metrics.update(recomputed)
            timing = metrics.pop("timing")
            log.phase("update", timing["update_s"])
            if self.producer is not None:  # the new version out, and the rollouts that wait for it asked for
                publish_version(run, k + 1, learner.stream_weights())
                if k + 1 + cfg.max_staleness < cfg.iterations:
                    self.request(k + 1 + cfg.max_staleness)
                metrics.update(stale_stats(episodes, k))
                timing.update(waits)
            if meta:
                timing["teacher_s"] = meta["stats"]["teacher_s"]
                timing["annotate"] = meta["timing"]
            metrics.update(iteration=k, env_steps=sum(e.num_turns for e in episodes))
            signum = self.agreed_signal()  # every process stops together
            saved = checkpoint_due(cfg, k) or signum is not None
            if saved:
                timing["checkpoint_bytes"] = self.out.save(it / "checkpoint", rcfg.prompt)
            timing.update(self.out.sync_engine(it, saved, log))
            if cfg.eval.episodes and ((k + 1) % cfg.eval.every == 0 or k == cfg.iterations - 1):  # and at the end
                metrics.update(self.evaluate(rcfg, it, log))
            ranks = learner.all_gather(log.finish())
            row = cast(Metrics, metrics)  # the update's figures, the loop's and the evaluation's
            history.append(row)
            if main:  # the run's bookkeeping
                append_metrics(run / METRICS_FILE, row)
                io.append_jsonl(
                    run / "timings.jsonl",
                    {
                        "iteration": k,
                        "update": timing,
                        "rollout_s": round(rollout_wall, 3),
                        "rollout_tokens_per_s": sum(len(t.action_ids) for e in episodes for t in e.turns)
                        / max(rollout_wall, 1e-9),
                        "iteration_s": round(time.perf_counter() - t0, 3),
                        "ranks": ranks,
                    },
                )
                io.mark_stage(run, it.name, "done")
                if saved:
                    record_checkpoint(run, k)
                retire_old_rollouts(run, k, cfg.old_rollouts)
                prune_checkpoints(run, cfg.keep_last)
                if self.producer is not None:
                    prune_versions(run, oldest_resume(run), cfg.max_staleness, versions_interval(cfg))
                if on_iteration:
                    on_iteration(row)
            if signum is not None:
                raise Preempted(run, k + 1, signum)
        learner.save(run / "checkpoint", prompt=cfg.rollout.prompt)
        if main:
            io.mark_stage(run, "online", "done", iterations=cfg.iterations)
        return history

    # -- the phases ------------------------------------------------------------------------------
    def generating(self):
        """The policy whole while this process's hf engine generates with it (under ZeRO-3 a
        collective: every process enters); nothing for vLLM, which holds its own copy."""
        return nullcontext() if self.vllm else self.learner.full_model()

    def own_share(self, specs: list, by_group: bool = True) -> list:
        """This process's share of ``specs``: its engine's task groups (or panel tasks); none
        where it runs no engine (vLLM: rank 0's serves them all, or data parallel one per
        tensor-parallel group of processes)."""
        return self.generators.share(specs, self.rank, by_group)

    def rollout(self, rcfg: RolloutConfig, log: PhaseLog) -> tuple[list[Episode], float, bool]:
        """Every process's episodes, gathered in one process's order (rank 0 writes them);
        whether a process abandoned its rollouts on a stop request."""
        t0 = time.perf_counter()
        specs = rollout_specs(rcfg, self.world)
        mine = self.own_share(specs)
        set_torch_threads(rcfg.threads)
        records, abandoned = [], False
        with self.generating():
            self.learner.model.eval()
            policy = ModelPolicy(StoppableEngine(self.engine, self.stop), rcfg.sampling, rcfg.prompt, seed=rcfg.seed)
            try:
                records = collect(rcfg, self.world, mine, policy) if mine else []
            except Abandon:
                abandoned = True
        groups = sorted({s.group_id for s in mine})
        log.phase(
            "rollout",
            time.perf_counter() - t0,
            f"{len(groups)} group(s) {groups}, {len(mine)} episode(s), {sum(r.num_turns for r in records)} turn(s)"
            + (self.served_by(specs) if self.generators.replica(self.rank) is None else ""),
            groups=len(groups),
            episodes=len(mine),
        )
        parts = self.learner.all_gather((records, abandoned))
        if any(a for _, a in parts):
            return [], 0.0, True
        episodes = as_stored(in_spec_order(specs, [p for p, _ in parts]))
        wall = time.perf_counter() - t0
        if self.main:
            write_rollout(rcfg, episodes, wall)
        return episodes, wall, False

    def served_by(self, specs: list) -> str:
        """Which engines generate while this process, which runs none, waits."""
        if self.generators.replicas == 1:
            return " (rank 0's vLLM engine serves every group)"
        servers = sorted({self.generators.server(s.group_id) for s in specs})
        return f" (the vLLM engines of ranks {', '.join(map(str, servers))} serve the groups)"

    def request(self, j: int) -> None:
        """Ask the producer for iteration ``j``'s rollouts, with the version the schedule names."""
        rcfg = rollout_config(self.cfg, j, iter_dir(self.run, j))
        self.producer.submit(j, rollout_version(j, self.cfg.max_staleness), rcfg)

    def produced(self, k: int, rcfg: RolloutConfig, log: PhaseLog):
        """Iteration ``k``'s rollouts from the producer (``max_staleness > 0``), written as
        :meth:`rollout` writes its own; and how long each side waited for the other."""
        t0 = time.perf_counter()
        made, waited = self.producer.take(k)
        if made is None or made.abandoned:
            return [], 0.0, True, {}
        episodes = made.episodes  # stored form already (VersionedPolicy.produce)
        log.phase("rollout", made.generate_s, f"version {made.version}, {len(episodes)} episode(s)")
        if self.main:
            write_rollout(rcfg, episodes, made.generate_s)
        waits = {
            "rollout_wait_s": round(waited, 3),  # the trainer, for the producer
            "producer_idle_s": round(made.idle_s, 3),  # the producer, for this request's version
            "producer_generate_s": round(made.generate_s, 3),
            "take_s": round(time.perf_counter() - t0, 3),
        }
        return episodes, made.generate_s, False, waits

    def stale_teacher(self, k: int) -> None:
        """The teacher of iteration ``k``'s stale rollouts: the version the synchronous loop would
        have made the teacher for the version that rolled out (``teacher_version``), read from the
        published versions, so the teacher ratio compares one version on both sides."""
        if self.teacher is None:
            return
        version = teacher_version(rollout_version(k, self.cfg.max_staleness), self.acfg.teacher_sync_interval)
        if version != self.teacher_version:
            self.teacher.load_state_dict(version_weights(self.run, version))
            self.teacher_version = version

    def recompute_logp_old(self, episodes: list[Episode], temperature: float, log: PhaseLog) -> dict:
        t0 = time.perf_counter()
        recomputed = self.learner.recompute_logp_old(episodes, temperature)
        own = sum(len(e.turns) for e in episodes if e.group_id % self.size == self.rank)
        total = sum(len(e.turns) for e in episodes)
        log.phase("recompute", time.perf_counter() - t0, f"{own} turn(s) of {total}", turns=own)
        return recomputed

    def annotate(self, episodes, rcfg: RolloutConfig, it: Path, k: int, temperature: float, log: PhaseLog):
        """The annotation of the whole batch on every process, the teacher's forwards divided."""
        cfg, learner = self.cfg, self.learner
        acfg = annotate_config(cfg, k, learner.updates)
        # the weights are signed by the update's own advantages (group_norm, penalty, reward scale)
        adv = annotation_advantages(turn_samples(episodes), train_config(cfg))
        scorer = CountingScorer(learner.scorer, self.rank, self.size)
        t0 = time.perf_counter()
        with self.teacher.scoring() if self.teacher is not None else nullcontext() as teacher_model:
            annotations, stats = annotate_episodes(
                episodes,
                acfg,
                teacher_model,
                learner.tokenizer,
                env_cfg=io.to_plain(cfg.env),
                temperature=temperature,
                advantages=adv,
                chat_template_kwargs=rcfg.prompt.chat_template_kwargs,
                bare_replies=rcfg.prompt.bare_replies,
                scorer=scorer,
            )
        seconds = time.perf_counter() - t0
        log.phase("teacher", scorer.seconds, f"{scorer.own} item(s) of {scorer.total}", items=scorer.own)
        if self.main:
            write_annotations(it, annotations, episodes, acfg, stats)
        # this process's annotate stage: the teacher's forward passes (the teacher signal's
        # included) and the rest -- blocks, prompts, masks, placement, weights, the weight swap
        timing = {
            "annotate_s": round(seconds, 4),
            "teacher_forward_s": round(scorer.seconds, 4),
            "rest_s": round(seconds - scorer.seconds, 4),
            "teacher_items": scorer.total,
        }
        return annotations, {"config": io.to_plain(acfg), "stats": stats, "timing": timing}

    def drop_teacher(self) -> None:
        """Lambda is 0 from this update on and nothing else reads the teacher (``teacher_wanted``):
        its snapshot goes (memory), later checkpoints hold none, and the annotation runs without
        it (every weight 1, as it was with the teacher unused); the update is unchanged."""
        self.teacher = self.out.teacher = None

    def agreed_signal(self) -> int | None:
        """The stop signal the first process that got one got (None: no process got one)."""
        return next((s for s in self.learner.all_gather(self.stop.signum) if s is not None), None)

    def evaluate(self, rcfg: RolloutConfig, it: Path, log: PhaseLog) -> dict:
        """The periodic evaluation after iteration ``it``: ``eval.episodes`` tasks of the
        evaluation split's fixed panel, sampled at ``eval.temperature`` (0: greedy) with the
        run's seed, by the engine that serves the updated policy, divided over the processes;
        ``it/eval.json`` and the metrics' ``eval_*`` (the main process's)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        ecfg = eval_config(cfg, it)  # as `serl eval --config` runs it on the run file (online.derive)
        world = build_world(ecfg.env)
        specs = panel_specs(ecfg, world)
        index = self.own_share(list(range(len(specs))), by_group=False)
        records = []
        with self.generating():
            self.learner.model.eval()
            policy = model_eval_policy(ecfg, self.engine)
            if index:
                records = run_episodes(
                    world,
                    built_split(ecfg.env),
                    [specs[i] for i in index],
                    policy,
                    max_turns=ecfg.env.max_turns,
                    batch_size=ecfg.batch_size,
                    step_timeout_s=ecfg.env.step_timeout_s,
                )
        log.phase("eval", time.perf_counter() - t0, f"{len(index)} episode(s) of {len(specs)}", episodes=len(index))
        found = dict(kv for part in self.learner.all_gather(list(zip(index, records, strict=True))) for kv in part)
        if not self.main:
            return {}
        ev = write_eval(ecfg, world, [found[i] for i in range(len(specs))], time.perf_counter() - t0)
        return {
            "eval_success_rate": ev["success_rate"],
            "eval_score": ev["score"],
            "eval_invalid_action_rate": ev["invalid_action_rate"],
            "eval_mean_turns": ev["mean_turns"],
        }


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
