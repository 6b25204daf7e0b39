"""The online loop: K times rollout -> (annotate) -> update, resumable.

Layout of ``RUN``::

    RUN/manifest.json              stages: one entry per finished iteration
    RUN/online.yaml                the resolved configuration
    RUN/iter_0000/                 rollouts.jsonl, manifest.json (+ annotations, eval.json)
    RUN/iter_0000/checkpoint/      the policy after this iteration's update (only the last is kept)
    RUN/metrics.jsonl              one record per iteration (deterministic on CPU)
    RUN/timings.jsonl              wall times and throughput (machine-dependent, kept apart)
    RUN/checkpoint/                the final policy

An iteration counts as finished once the manifest says so; ``--resume`` restarts after
the last finished one from its checkpoint (model, optimizer and update counter), so a
resumed run's artifacts equal an uninterrupted run's. Iteration k's rollouts use seed
``seed * 1000 + k``.
"""

from __future__ import annotations

import copy
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serl_cli.algos.objectives import get_objective
from serl_cli.artifacts import io
from serl_cli.artifacts.schema import read_rollouts
from serl_cli.errors import SerlError
from serl_cli.method.annotation import AnnotateConfig, annotate_episodes
from serl_cli.method.teacher import TeacherSnapshot
from serl_cli.models.loading import ADAPTER_CONFIG
from serl_cli.rollout.engines import ModelPolicy, SamplingConfig, check_engine, make_engine, refresh_weights
from serl_cli.rollout.engines.vllm import check_sampling
from serl_cli.rollout.worlds import EnvConfig, build_world
from serl_cli.stages.annotate import write_annotations
from serl_cli.stages.evaluate import EvalConfig, run_eval
from serl_cli.stages.rollout import RolloutConfig, resolve_model, run_rollout
from serl_cli.training.backends import is_main_process
from serl_cli.training.learner import Learner, TrainConfig, check_train_config


@dataclass
class OnlineEvalConfig:
    episodes: int = 0  # test-panel episodes evaluated after every `every` iterations; 0 = none
    every: int = 1
    split: str | None = None  # None: the environment's evaluation split (WebShop test, ALFWorld valid_unseen)


@dataclass
class OnlineConfig:
    env: EnvConfig = field(default_factory=lambda: EnvConfig(split="train"))
    model: str | None = None  # the starting policy; None = the embedded default tiny model
    iterations: int = 1
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    annotate: AnnotateConfig = field(default_factory=AnnotateConfig)  # serl, rlsd, sdpo: between rollout and update
    eval: OnlineEvalConfig = field(default_factory=OnlineEvalConfig)
    seed: int = 0
    out: str = "runs/online"


def _iter_dir(run: Path, k: int) -> Path:
    return run / f"iter_{k:04d}"


def _keep_iterations_before(path: Path, start: int) -> None:
    if path.exists():
        io.write_jsonl(path, [r for r in io.iter_jsonl(path) if r.get("iteration", -1) < start])


def finished_iterations(manifest: dict) -> int:
    done = [int(name.split("_")[1]) for name, s in manifest.get("stages", {}).items()
            if name.startswith("iter_") and s.get("status") == "done"]
    return max(done) + 1 if done else 0


def run_online(cfg: OnlineConfig, *, resume: bool = False, overwrite: bool = False, on_iteration=None) -> list[dict]:
    run = Path(cfg.out)
    if cfg.iterations < 1:
        raise SerlError(f"--iterations must be at least 1, got {cfg.iterations}")
    if cfg.rollout.engine == "vllm":  # before vLLM starts (a minute)
        check_sampling(cfg.rollout.sampling)
        if cfg.train.lora.rank > 0 and cfg.train.lora.save != "merged":
            # vLLM reloads the policy from each saved checkpoint: it needs the full (merged) weights
            raise SerlError("--engine vllm needs train.lora.save=merged: it reloads the policy's full weights "
                            "from each saved checkpoint")
    check_engine(cfg.rollout.engine)  # an unknown engine or a missing extra, before any model loads
    check_train_config(cfg.train)  # the same for the backend, its DeepSpeed config, LoRA
    world = build_world(cfg.env)
    # Under torchrun / the deepspeed launcher every process runs this loop: the main one
    # (rank 0) writes the run's files, collects the rollouts and annotates them, then hands
    # them to the others; all of them take part in the update and in saving it.
    main = is_main_process()
    start = 0
    if resume and (run / "manifest.json").exists():
        manifest = io.load_manifest(run)
        start = finished_iterations(manifest)
    elif main and run.exists() and any(run.iterdir()):  # the others follow rank 0 (it may be writing there already)
        if not overwrite:
            raise SerlError(f"run directory {run} already exists: pass --resume to continue it or --overwrite to replace it")
        shutil.rmtree(run)
    if resume and main:
        # a kill between appending an iteration's metrics and marking it done leaves a line
        # for an unfinished iteration: drop everything past the last finished one
        for name in ("metrics.jsonl", "timings.jsonl"):
            _keep_iterations_before(run / name, start)
    if start == 0:
        cfg.model = resolve_model(RolloutConfig(env=cfg.env, model=cfg.model), world)
        if main:
            run.mkdir(parents=True, exist_ok=True)
            io.write_json(run / "manifest.json", io.new_manifest("online", io.to_plain(cfg), cfg.seed))
        learner = Learner(cfg.model, cfg.train)
    else:
        last = _iter_dir(run, start - 1) / "checkpoint"
        if not ((last / "config.json").is_file() or (last / ADAPTER_CONFIG).is_file()):
            raise SerlError(f"cannot resume {run}: iteration {start - 1} is marked done but {last} is missing")
        learner = Learner(str(last), cfg.train, state_file=last / "trainer_state.pt")
    objective = get_objective(cfg.train.algo)
    acfg = copy.deepcopy(cfg.annotate)
    if objective.placement:
        acfg.placement = objective.placement  # rlsd is SERL's weights on every turn
    if cfg.train.algo == "sdpo" or cfg.train.distill_coef:
        acfg.skip_zero_advantage = False  # the distillation term needs the teacher on failed rollouts too
    teacher = None
    if objective.needs_annotations:
        teacher = TeacherSnapshot(learner)  # a frozen copy, or under LoRA a copy of the adapter only
        saved = _iter_dir(run, start - 1) / "checkpoint" / "teacher_state.pt" if start > 0 else None
        if main and saved is not None and saved.is_file():
            teacher.load_state_dict(torch.load(saved))
    # one engine for the whole run: hf generates with learner.model itself; vLLM loads its own
    # copy from the policy's directory and reloads it from each saved checkpoint (below)
    policy_dir = cfg.model if start == 0 else str(_iter_dir(run, start - 1) / "checkpoint")
    engine = make_engine(cfg.rollout.engine, learner.model, learner.tokenizer, model_dir=policy_dir,
                         vllm=cfg.rollout.vllm, seed=cfg.seed) if main else None
    history = []
    for k in range(start, cfg.iterations):
        t0 = time.perf_counter()
        it = _iter_dir(run, k)
        rcfg = copy.deepcopy(cfg.rollout)
        rcfg.env, rcfg.model, rcfg.seed, rcfg.out = cfg.env, cfg.model, cfg.seed * 1000 + k, str(it)
        temperature = rcfg.sampling.temperature if rcfg.sampling.temperature > 0 else 1.0
        summary = episodes = annotations = meta = None
        with learner.full_model():  # whole weights while generating and scoring (ZeRO-3 gathers them)
            if objective.needs_annotations and learner.updates % max(acfg.teacher_sync_interval, 1) == 0:
                teacher.sync()  # the teacher becomes this rollout policy
            if main:
                summary = run_rollout(rcfg, overwrite=True, model=learner.model, tokenizer=learner.tokenizer,
                                      engine=engine)
                episodes = read_rollouts(it)
                if objective.needs_annotations:
                    acfg.update_step, acfg.seed = learner.updates, cfg.seed * 1000 + k
                    with teacher.scoring() as teacher_model:
                        annotations, stats = annotate_episodes(episodes, acfg, teacher_model, learner.tokenizer,
                                                               env_cfg=io.to_plain(cfg.env), temperature=temperature)
                    write_annotations(it, annotations, episodes, acfg, stats)
                    meta = {"config": io.to_plain(acfg), "stats": stats}
        summary, episodes, annotations, meta = learner.broadcast((summary, episodes, annotations, meta))
        metrics = learner.update(episodes, temperature, annotations, meta)
        timing = metrics.pop("timing")
        if meta:
            timing["teacher_s"] = meta["stats"]["teacher_s"]
        metrics.update(iteration=k, env_steps=summary["turns"])
        learner.save(it / "checkpoint", prompt=rcfg.prompt)
        if main:
            refresh_weights(engine, it / "checkpoint")  # vLLM: the evaluation and the next rollout use the update
        if cfg.eval.episodes and (k + 1) % cfg.eval.every == 0:
            with learner.full_model():
                if main:
                    ecfg = EvalConfig(env=EnvConfig(cfg.env.name, cfg.eval.split, cfg.env.max_turns, cfg.env.settings),
                                      policy="model", episodes=cfg.eval.episodes, out=str(it), seed=cfg.seed,
                                      batch_size=rcfg.batch_size, history_turns=rcfg.prompt.history_turns)
                    greedy = ModelPolicy(engine, SamplingConfig(0.0, 1.0, rcfg.sampling.max_new_tokens), rcfg.prompt,
                                         seed=cfg.seed)
                    ev = run_eval(ecfg, overwrite=True, policy=greedy)
                    metrics.update(eval_success_rate=ev["success_rate"], eval_score=ev["score"])
        if not main:  # the rest is the main process's bookkeeping
            history.append(metrics)
            continue
        if teacher is not None:  # the snapshot survives a restart, so a resumed run matches
            torch.save(teacher.state_dict(), it / "checkpoint" / "teacher_state.pt")
        io.append_jsonl(run / "metrics.jsonl", metrics)
        io.append_jsonl(run / "timings.jsonl", {"iteration": k, "update": timing, "rollout_s": summary["wall_time_s"],
                                                "rollout_tokens_per_s": summary["tokens_per_s"],
                                                "iteration_s": round(time.perf_counter() - t0, 3)})
        io.mark_stage(run, it.name, "done")
        if k > 0 and (_iter_dir(run, k - 1) / "checkpoint").exists():
            shutil.rmtree(_iter_dir(run, k - 1) / "checkpoint")  # keep only the newest policy
        history.append(metrics)
        if on_iteration:
            on_iteration(metrics)
    learner.save(run / "checkpoint", prompt=cfg.rollout.prompt)
    if main:
        io.mark_stage(run, "online", "done", iterations=cfg.iterations)
    return history
