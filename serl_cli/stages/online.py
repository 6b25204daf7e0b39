"""The online loop: K times rollout -> (annotate) -> update, resumable and preemptible.

Layout of ``RUN``::

    RUN/manifest.json              stages: one entry per finished iteration
    RUN/online.yaml                the resolved configuration, each setting once (run_settings)
    RUN/iter_0000/                 rollouts.jsonl, manifest.json (+ annotations, eval.json)
    RUN/iter_0000/checkpoint/      the policy after this iteration's update (every ``save_every``
                                   iterations, the newest ``keep_last`` kept)
    RUN/metrics.jsonl              one record per iteration (deterministic on CPU)
    RUN/timings.jsonl              wall times and throughput (machine-dependent, kept apart)
    RUN/checkpoint/                the final policy

An iteration counts as finished once the manifest says so; ``--resume`` restarts after
the newest iteration with a checkpoint (model, optimizer, update counter, teacher), redoing
any finished iterations after it, so a resumed run's artifacts equal an uninterrupted run's.
Iteration k's rollouts use seed ``seed * 1000 + k``; the update is seeded by ``seed``.

**Checkpoints.** Iteration k writes ``iter_k/checkpoint`` when ``(k + 1) % save_every == 0``,
at the last iteration, and when the run is stopped; then only the newest ``keep_last`` of
them stay (0: all). ``save_every: 1`` (the default) resumes from the last finished iteration.

**Preemption** (a SLURM job near its time limit, a requeue): SIGTERM or SIGUSR1 asks the
loop to stop (a second SIGTERM ends the process at once, as it would without serl). Before an
iteration's update has started (during its rollouts or its annotation) the iteration is abandoned --
its rollouts would be collected again the same
way; once the update has started the iteration is finished (update, checkpoint, periodic
evaluation). Either way the last finished iteration then has a checkpoint, and the loop
raises :class:`Preempted`; the CLI exits with :data:`PREEMPTED_EXIT` (75, EX_TEMPFAIL), and
the same command with ``--resume`` continues where it stopped.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from serl_cli.algos.objectives import default_advantages, get_objective, turn_advantages
from serl_cli.artifacts import io
from serl_cli.artifacts.schema import read_rollouts, turn_samples
from serl_cli.errors import SerlError
from serl_cli.method.annotation import annotate_episodes
from serl_cli.method.teacher import TeacherSnapshot
from serl_cli.rollout.engines import (
    ModelPolicy,
    close_engine,
    holds_own_weights,
    make_engine,
    refresh_weights,
    sleep_engine,
)
from serl_cli.rollout.worlds import EnvConfig, build_world, world_info
from serl_cli.stages.annotate import write_annotations
from serl_cli.stages.evaluate import EvalConfig, run_eval
from serl_cli.stages.online_checkpoints import (
    _iter_dir,
    _keep_iterations_before,
    _resumable,
    checkpoint_due,
    finished_iterations,
    prune_checkpoints,
    resume_point,
)
from serl_cli.stages.online_config import OnlineConfig, check_online_config, eval_sampling
from serl_cli.stages.rollout import RolloutConfig, resolve_model, run_rollout
from serl_cli.stages.run_file import run_settings
from serl_cli.training.backends import is_main_process
from serl_cli.training.learner import Learner
from serl_cli.training.train_config import recompute_enabled

PREEMPTED_EXIT = 75  # sysexits' EX_TEMPFAIL: stopped on a signal, checkpointed; --resume continues
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


class _Abandon(Exception):
    """Raised inside the rollout phase once a stop was requested."""


class StoppableEngine:
    """The loop's engine during the rollout phase: a generation round does not start once a
    stop is requested (the iteration is abandoned; it is redone, identically, on resume)."""

    def __init__(self, engine, stop: StopSignal):
        self.engine, self.stop = engine, stop

    def generate(self, prompts, sampling, seed, **rows):
        if self.stop.requested:
            raise _Abandon()
        return self.engine.generate(prompts, sampling, seed, **rows)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def run_online(cfg: OnlineConfig, *, resume: bool = False, overwrite: bool = False, on_iteration=None) -> list[dict]:
    """Run the loop (see the module docstring); raises :class:`Preempted` when stopped by a signal."""
    with StopSignal() as stop:
        return _run_online(cfg, stop, resume=resume, overwrite=overwrite, on_iteration=on_iteration)


def _run_online(cfg: OnlineConfig, stop: StopSignal, *, resume: bool, overwrite: bool, on_iteration) -> list[dict]:
    run = Path(cfg.out)
    check_online_config(cfg)
    world = build_world(cfg.env)
    # Under torchrun / the deepspeed launcher every process runs this loop: the main one
    # (rank 0) writes the run's files, collects the rollouts and annotates them, then hands
    # them to the others; all of them take part in the update and in saving it.
    # Every process decides where to start from the files alone, before any of them changes
    # the run directory: rank 0 writes there only after the learner's process group is up and
    # a barrier has passed.
    main = is_main_process()
    train_cfg = dataclasses.replace(cfg.train, seed=cfg.seed)  # the update is seeded by the run's seed (LOOP_SETS)
    start = 0
    if resume and (run / "manifest.json").exists():
        manifest = io.load_manifest(run)
        start = resume_point(run, cfg, finished_iterations(manifest))
    elif main and run.exists() and any(run.iterdir()) and not overwrite:
        raise SerlError(
            f"run directory {run} already exists: pass --resume to continue it or --overwrite to replace it"
        )
    if start == 0:
        cfg.model = resolve_model(RolloutConfig(env=cfg.env, model=cfg.model), world)
        learner = Learner(cfg.model, train_cfg)
    else:
        last = _iter_dir(run, start - 1) / "checkpoint"
        learner = Learner(str(last), train_cfg, state_file=last / "trainer_state.pt")
    learner.barrier()
    if main and start == 0:
        if run.exists() and any(run.iterdir()) and not (resume and (run / "manifest.json").exists()):
            shutil.rmtree(run)  # --overwrite
        run.mkdir(parents=True, exist_ok=True)
        io.write_json(run / "manifest.json", io.new_manifest("online", run_settings(cfg), cfg.seed, world_info(world)))
    if resume and main:
        # a kill between appending an iteration's metrics and marking it done leaves a line
        # for an unfinished iteration, and iterations past the newest checkpoint are redone:
        # drop everything from the resume point on
        for name in ("metrics.jsonl", "timings.jsonl"):
            _keep_iterations_before(run / name, start)
    objective = get_objective(cfg.train.algo)
    # pi_old by the trainer before anything reads it (the teacher's weights and the PPO ratio)
    recompute = objective.uses_behaviour_logprobs and recompute_enabled(cfg.train, cfg.rollout.engine)
    acfg = copy.deepcopy(cfg.annotate)
    if objective.placement:
        acfg.placement = objective.placement  # rlsd is SERL's weights on every turn
    if cfg.train.algo == "rlsd":
        acfg.tokens = "reply"  # ... and on every reply token, reasoning included (METHOD.md 7)
    if cfg.train.algo == "sdpo" or cfg.train.distill_coef:
        acfg.skip_zero_advantage = False  # the distillation term needs the teacher on failed rollouts too
    teacher = None
    if objective.needs_annotations:
        teacher = TeacherSnapshot(learner)  # a frozen copy, or under LoRA a copy of the adapter only
        saved = _iter_dir(run, start - 1) / "checkpoint" / "teacher_state.pt" if start > 0 else None
        if main and saved is not None and saved.is_file():
            teacher.load_state_dict(torch.load(saved, map_location="cpu"))
    # one engine for the whole run: hf generates with learner.model itself; vLLM loads its own
    # copy from the policy's directory and gets each update pushed into it (below)
    policy_dir = cfg.model if start == 0 else str(_iter_dir(run, start - 1) / "checkpoint")
    engine = (
        make_engine(
            cfg.rollout.engine,
            learner.model,
            learner.tokenizer,
            model_dir=policy_dir,
            vllm=cfg.rollout.vllm,
            seed=cfg.seed,
            gpus=cfg.rollout.gpus,
        )
        if main
        else None
    )
    try:
        return _iterations(
            cfg, run, start, learner, objective, recompute, acfg, teacher, engine, stop, main, on_iteration
        )
    finally:
        if main:
            close_engine(engine)  # vLLM's engine process and its GPU memory go now, not at exit


def _save(learner: Learner, teacher, checkpoint: Path, prompt, main: bool) -> None:
    """An iteration's checkpoint (every process): the policy, its resume state, and the teacher
    snapshot (so a resumed run matches)."""
    learner.save(checkpoint, prompt=prompt)
    if main and teacher is not None:
        torch.save(teacher.state_dict(), checkpoint / "teacher_state.pt")


def _sync_engine(engine, learner: Learner, cfg: OnlineConfig, checkpoint: Path, main: bool) -> dict:
    """After an update, an engine with its own weights (vLLM) serves the new policy: pushed in
    memory (``vllm.weight_sync: memory``; gathered first under ZeRO-3, so every process
    enters) or reloaded from the checkpoint just saved (``disk``)."""
    if cfg.rollout.engine == "hf" or (main and not holds_own_weights(engine)):
        return {}
    if cfg.rollout.vllm.weight_sync == "disk":
        if main:
            refresh_weights(engine, checkpoint)
        return {}
    with learner.full_model() as module:
        if main:
            return engine.update_weights(learner.export_weights(module))
    return {}


def _iterations(
    cfg: OnlineConfig,
    run: Path,
    start: int,
    learner: Learner,
    objective,
    recompute: bool,
    acfg,
    teacher,
    engine,
    stop: StopSignal,
    main: bool,
    on_iteration,
) -> list[dict]:
    history = []
    disk_sync = cfg.rollout.engine != "hf" and cfg.rollout.vllm.weight_sync == "disk"
    for k in range(start, cfg.iterations):
        t0 = time.perf_counter()
        it = _iter_dir(run, k)
        rcfg = copy.deepcopy(cfg.rollout)
        rcfg.env, rcfg.model, rcfg.seed, rcfg.out = cfg.env, cfg.model, cfg.seed * 1000 + k, str(it)
        temperature = rcfg.sampling.temperature if rcfg.sampling.temperature > 0 else 1.0
        summary = episodes = annotations = meta = recomputed = None
        abandon = False
        with learner.full_model():  # whole weights while generating and scoring (ZeRO-3 gathers them)
            if objective.needs_annotations and learner.updates % max(acfg.teacher_sync_interval, 1) == 0:
                teacher.sync()  # the teacher becomes this rollout policy
            if main:
                try:
                    summary = run_rollout(
                        rcfg,
                        overwrite=True,
                        model=learner.model,
                        tokenizer=learner.tokenizer,
                        engine=StoppableEngine(engine, stop),
                    )
                except _Abandon:
                    abandon = True
                if not abandon:
                    sleep_engine(engine)  # vLLM with sleep: true frees its GPU memory for the trainer
                    episodes = read_rollouts(it)
                    if recompute:
                        recomputed = learner.recompute_logp_old(episodes, temperature)
                    if objective.needs_annotations:
                        acfg.update_step, acfg.seed = learner.updates, cfg.seed * 1000 + k
                        # the weights are signed by the update's own advantages (group_norm, penalty, reward scale)
                        adv = (
                            None
                            if default_advantages(cfg.train)
                            else turn_advantages(turn_samples(episodes), cfg.train).tolist()
                        )
                        with teacher.scoring() as teacher_model:
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
                            )
                        write_annotations(it, annotations, episodes, acfg, stats)
                        meta = {"config": io.to_plain(acfg), "stats": stats}
                abandon = abandon or stop.requested  # a stop before the update: abandon this iteration
        summary, episodes, annotations, meta, recomputed, abandon, signum = learner.broadcast(
            (summary, episodes, annotations, meta, recomputed, abandon, stop.signum)
        )
        if abandon:  # iteration k is redone on resume; k - 1 must have its checkpoint
            if k > 0 and not _resumable(run, k - 1):
                _save(learner, teacher, _iter_dir(run, k - 1) / "checkpoint", cfg.rollout.prompt, main)
            if main:
                prune_checkpoints(run, cfg.keep_last)
            raise Preempted(run, k, signum)
        metrics = learner.update(episodes, temperature, annotations, meta, engine=cfg.rollout.engine)
        metrics.update(recomputed or {})
        timing = metrics.pop("timing")
        if meta:
            timing["teacher_s"] = meta["stats"]["teacher_s"]
        metrics.update(iteration=k, env_steps=summary["turns"])
        signum = learner.broadcast(stop.signum)  # the main process's word: every process stops together
        if checkpoint_due(cfg, k) or signum is not None or disk_sync:
            _save(learner, teacher, it / "checkpoint", rcfg.prompt, main)
        timing.update(_sync_engine(engine, learner, cfg, it / "checkpoint", main))
        if cfg.eval.episodes and (k + 1) % cfg.eval.every == 0:
            with learner.full_model():
                if main:
                    metrics.update(_evaluate(cfg, rcfg, engine, it))
        if not main:  # the rest is the main process's bookkeeping
            history.append(metrics)
            if signum is not None:
                raise Preempted(run, k + 1, signum)
            continue
        io.append_jsonl(run / "metrics.jsonl", metrics)
        io.append_jsonl(
            run / "timings.jsonl",
            {
                "iteration": k,
                "update": timing,
                "rollout_s": summary["wall_time_s"],
                "rollout_tokens_per_s": summary["tokens_per_s"],
                "iteration_s": round(time.perf_counter() - t0, 3),
            },
        )
        io.mark_stage(run, it.name, "done")
        prune_checkpoints(run, cfg.keep_last)
        history.append(metrics)
        if on_iteration:
            on_iteration(metrics)
        if signum is not None:
            raise Preempted(run, k + 1, signum)
    learner.save(run / "checkpoint", prompt=cfg.rollout.prompt)
    if main:
        io.mark_stage(run, "online", "done", iterations=cfg.iterations)
    return history


def _evaluate(cfg: OnlineConfig, rcfg: RolloutConfig, engine, it: Path) -> dict:
    """The periodic evaluation after iteration ``it``: ``eval.episodes`` tasks of the evaluation
    split's fixed panel, sampled at ``eval.temperature`` (0: greedy) with the run's seed, by the
    engine that serves the updated policy; ``it/eval.json`` and the metrics' ``eval_*``."""
    ecfg = EvalConfig(
        env=EnvConfig(cfg.env.name, cfg.eval.split, cfg.env.max_turns, cfg.env.settings, cfg.env.step_timeout_s),
        policy="model",
        episodes=cfg.eval.episodes,
        out=str(it),
        seed=cfg.seed,
        batch_size=rcfg.batch_size,
        history_turns=rcfg.prompt.history_turns,
        temperature=cfg.eval.temperature,
        max_new_tokens=rcfg.sampling.max_new_tokens,
        coupled=rcfg.sampling.coupled,
    )
    ev = run_eval(ecfg, overwrite=True, policy=ModelPolicy(engine, eval_sampling(cfg), rcfg.prompt, seed=cfg.seed))
    return {
        "eval_success_rate": ev["success_rate"],
        "eval_score": ev["score"],
        "eval_invalid_action_rate": ev["invalid_action_rate"],
        "eval_mean_turns": ev["mean_turns"],
    }
