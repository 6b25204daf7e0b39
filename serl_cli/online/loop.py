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

import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import cast

from serl_cli.algos.objectives import annotation_advantages
from serl_cli.artifacts import io
from serl_cli.artifacts.records import Annotation, Episode, Metrics
from serl_cli.artifacts.schema import METRICS_FILE, append_metrics, turn_samples
from serl_cli.method.annotation import annotate_episodes, teacher_wanted
from serl_cli.online.checkpoints import (
    checkpoint_due,
    iter_dir,
    prune_checkpoints,
    record_checkpoint,
    resumable,
    retire_old_rollouts,
)
from serl_cli.online.config import OnlineConfig
from serl_cli.online.derive import annotate_config, eval_config, rollout_config, train_config
from serl_cli.online.ranks import CountingScorer, PhaseLog
from serl_cli.online.setup import Prepared, prepared_run
from serl_cli.online.sources import RolloutBatch
from serl_cli.online.stop import Preempted, StopSignal
from serl_cli.online.sync import PolicyOut
from serl_cli.rollout.engines import engine_traits, sleep_engine
from serl_cli.rollout.runner import run_episodes
from serl_cli.rollout.worlds import build_world, built_split
from serl_cli.stages.annotate import write_annotations
from serl_cli.stages.evaluate import model_eval_policy, panel_specs, write_eval
from serl_cli.stages.rollout import RolloutConfig, env_pool
from serl_cli.training.train_config import recompute_enabled


def run_online(
    cfg: OnlineConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    # called with each iteration's Metrics row; Callable[...]: callers' callbacks take it as a plain dict
    on_iteration: Callable[..., object] | None = None,
) -> list[Metrics]:
    """Run the loop (see the module docstring); raises :class:`Preempted` when stopped by a signal."""
    with StopSignal() as stop, prepared_run(cfg, stop, resume=resume, overwrite=overwrite) as prepared:
        return Loop(cfg, prepared, stop).iterations(on_iteration)


class Loop:
    """The iterations of one run, on one process (every process runs the same)."""

    def __init__(self, cfg: OnlineConfig, prepared: Prepared, stop: StopSignal):
        self.cfg, self.run, self.stop = cfg, Path(cfg.out), stop
        self.start, self.learner, self.objective = prepared.start, prepared.learner, prepared.objective
        self.acfg, self.teacher, self.engine = prepared.acfg, prepared.teacher, prepared.engine
        self.world, self.source, self.generation = prepared.world, prepared.source, prepared.generation
        self.annotating = self.objective.needs_annotations
        self.rank, self.size, self.main = self.learner.backend.rank, self.learner.backend.world, self.learner.is_main
        # pi_old by the trainer before anything reads it (the teacher's weights and the PPO ratio)
        self.recompute = self.objective.uses_behaviour_logprobs and recompute_enabled(cfg.train, cfg.rollout.engine)
        # the trainer's own vLLM engine, synced after each update (at max_staleness > 0 the producer holds it)
        vllm = cfg.rollout.vllm if engine_traits(cfg.rollout.engine).own_weights and cfg.max_staleness == 0 else None
        self.out = PolicyOut(self.learner, self.teacher, self.engine, vllm)

    def iterations(self, on_iteration: Callable[..., object] | None) -> list[Metrics]:
        self.out.sized = self.start > 0  # the checkpoint's size is said when a run starts, not again on resume
        self.source.prime(self.start)
        history = [self.iteration(k, on_iteration) for k in range(self.start, self.cfg.iterations)]
        self.out.save_final(self.run / "checkpoint", self.cfg.rollout.prompt)
        if self.main:
            io.mark_stage(self.run, "online", "done", iterations=self.cfg.iterations)
        return history

    def iteration(self, k: int, on_iteration: Callable[..., object] | None) -> Metrics:
        """Iteration ``k``: rollouts, pi_old and the annotation, the update, the checkpoint and the
        weights out, the periodic evaluation, the books."""
        cfg, t0 = self.cfg, time.perf_counter()
        it, rcfg = iter_dir(self.run, k), rollout_config(cfg, k, iter_dir(self.run, k))
        temperature = rcfg.sampling.temperature if rcfg.sampling.temperature > 0 else 1.0
        log = PhaseLog(self.rank, self.size, self.learner.backend.device)
        if self.teacher is not None and not teacher_wanted(annotate_config(cfg, k, self.learner.updates)):
            self.drop_teacher()
        self.source.teacher_for(k, self.teacher)
        batch = self.source.take(k, rcfg, log)
        recomputed, annotated = self.score(batch, rcfg, it, k, temperature, log)
        self.stop_if_asked(k, batch)
        assert batch is not None  # a batch is abandoned only on a stop request, which stop_if_asked raised
        annotations, annotate_meta = annotated
        done = self.learner.update(
            batch.episodes,
            temperature,
            annotations,
            annotate_meta,
            engine=cfg.rollout.engine,
            staleness=batch.staleness,
        )
        timing = done.pop("timing")
        log.phase("update", timing["update_s"])
        metrics = {**done, **recomputed, **self.source.after_update(k, batch.episodes)}
        timing.update(batch.waits)
        if annotate_meta:
            timing["teacher_s"], timing["annotate"] = annotate_meta["stats"]["teacher_s"], annotate_meta["timing"]
        metrics.update(iteration=k, env_steps=sum(e.num_turns for e in batch.episodes))
        signum = self.agreed_signal()  # every process stops together
        saved = checkpoint_due(cfg, k) or signum is not None
        if saved:
            timing["checkpoint_bytes"] = self.out.save(it / "checkpoint", rcfg.prompt)
        timing.update(self.out.sync_engine(it, saved, log))
        if cfg.eval.episodes and ((k + 1) % cfg.eval.every == 0 or k == cfg.iterations - 1):  # and at the end
            metrics.update(self.evaluate(rcfg, it, log))
        row = cast(Metrics, metrics)  # the update's figures, the loop's and the evaluation's
        ranks = self.learner.all_gather(log.finish())
        if self.main:
            self.keep_books(k, row, timing, batch, ranks, time.perf_counter() - t0, saved)
            if on_iteration:
                on_iteration(row)
        if signum is not None:
            raise Preempted(self.run, k + 1, signum)
        return row

    # -- the phases ------------------------------------------------------------------------------
    def score(
        self, batch: RolloutBatch | None, rcfg: RolloutConfig, it: Path, k: int, temperature: float, log: PhaseLog
    ) -> tuple[dict, tuple]:
        """pi_old and the annotation of a batch that was not abandoned. Rollouts of the policy updated
        now: pi_old recomputed first, and the teacher ratio reads it; stale rollouts are annotated
        against their own version's log-probs, and the update recomputes pi_prox where a gradient
        needs it (Learner.update)."""
        recomputed: dict = {}
        annotated: tuple = (None, None)
        if batch is None:
            return recomputed, annotated
        sleep_engine(self.engine)  # vLLM with sleep: true frees its GPU memory for the trainer
        if self.source.on_policy and self.recompute:
            recomputed = self.recompute_logp_old(batch.episodes, temperature, log)
        if self.annotating:
            annotated = self.annotate(batch.episodes, rcfg, it, k, temperature, log)
        return recomputed, annotated

    def stop_if_asked(self, k: int, batch: RolloutBatch | None) -> None:
        """A stop any process was asked for, before the update: the iteration is abandoned (redone on
        resume), so iteration k - 1 must have its checkpoint, and the loop raises :class:`Preempted`."""
        signum = self.agreed_signal()
        if batch is not None and signum is None:
            return
        if k > 0 and not resumable(self.run, k - 1):
            self.out.save(iter_dir(self.run, k - 1) / "checkpoint", self.cfg.rollout.prompt)
            if self.main:
                record_checkpoint(self.run, k - 1)
        if self.main:
            prune_checkpoints(self.run, self.cfg.keep_last)
        assert signum is not None  # rollouts are abandoned only on a stop request: a process got a signal
        raise Preempted(self.run, k, signum)

    def keep_books(
        self, k: int, row: Metrics, timing: dict, batch: RolloutBatch, ranks: list, wall: float, saved: bool
    ) -> None:
        """The main process's records of iteration ``k``, then what it no longer needs goes."""
        run, tokens = self.run, sum(len(t.action_ids) for e in batch.episodes for t in e.turns)
        append_metrics(run / METRICS_FILE, row)
        io.append_jsonl(
            run / "timings.jsonl",
            {
                "iteration": k,
                "update": timing,
                "rollout_s": round(batch.wall_s, 3),
                "rollout_tokens_per_s": tokens / max(batch.wall_s, 1e-9),
                "iteration_s": round(wall, 3),
                "ranks": ranks,
            },
        )
        io.mark_stage(run, iter_dir(run, k).name, "done")
        if saved:
            record_checkpoint(run, k)
        retire_old_rollouts(run, k, self.cfg.old_rollouts)
        prune_checkpoints(run, self.cfg.keep_last)
        self.source.prune(run)

    def recompute_logp_old(self, episodes: list[Episode], temperature: float, log: PhaseLog) -> dict:
        t0 = time.perf_counter()
        recomputed = self.learner.recompute_logp_old(episodes, temperature)
        own = sum(len(e.turns) for e in episodes if e.group_id % self.size == self.rank)
        total = sum(len(e.turns) for e in episodes)
        log.phase("recompute", time.perf_counter() - t0, f"{own} turn(s) of {total}", turns=own)
        return recomputed

    def annotate(
        self, episodes: list[Episode], rcfg: RolloutConfig, it: Path, k: int, temperature: float, log: PhaseLog
    ) -> tuple[list[Annotation], dict]:
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
        index = self.generation.share(list(range(len(specs))), by_group=False)
        records = []
        with self.generation.whole():
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
                    pool=env_pool(ecfg),
                    dispatch=ecfg.dispatch,
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
