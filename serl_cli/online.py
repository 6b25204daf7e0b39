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

from serl_cli import io
from serl_cli.annotate import AnnotateConfig, annotate_episodes, write_annotations
from serl_cli.engines import ModelPolicy, SamplingConfig, make_engine
from serl_cli.errors import SerlError
from serl_cli.evaluate import EvalConfig, run_eval
from serl_cli.rollout import RolloutConfig, resolve_model, run_rollout
from serl_cli.schema import read_rollouts
from serl_cli.settings import EnvConfig, build_world
from serl_cli.objectives import get_objective
from serl_cli.train import Learner, TrainConfig


@dataclass
class OnlineEvalConfig:
    episodes: int = 0  # test-panel episodes evaluated after every `every` iterations; 0 = none
    every: int = 1
    split: str = "test"


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
    world = build_world(cfg.env)
    start = 0
    if resume and (run / "manifest.json").exists():
        manifest = io.load_manifest(run)
        start = finished_iterations(manifest)
    elif run.exists() and any(run.iterdir()):
        if not overwrite:
            raise SerlError(f"run directory {run} already exists: pass --resume to continue it or --overwrite to replace it")
        shutil.rmtree(run)
    if start == 0:
        run.mkdir(parents=True, exist_ok=True)
        cfg.model = resolve_model(RolloutConfig(env=cfg.env, model=cfg.model), world)
        io.write_json(run / "manifest.json", io.new_manifest("online", io.to_plain(cfg), cfg.seed))
        learner = Learner(cfg.model, cfg.train)
    else:
        # a kill between appending an iteration's metrics and marking it done leaves a line
        # for an unfinished iteration: drop everything past the last finished one
        for name in ("metrics.jsonl", "timings.jsonl"):
            _keep_iterations_before(run / name, start)
        last = _iter_dir(run, start - 1) / "checkpoint"
        if not (last / "config.json").is_file():
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
        teacher = copy.deepcopy(learner.model).eval().requires_grad_(False)
        saved = _iter_dir(run, start - 1) / "checkpoint" / "teacher_state.pt" if start > 0 else None
        if saved is not None and saved.is_file():
            teacher.load_state_dict(torch.load(saved))
    history = []
    for k in range(start, cfg.iterations):
        t0 = time.perf_counter()
        it = _iter_dir(run, k)
        rcfg = copy.deepcopy(cfg.rollout)
        rcfg.env, rcfg.model, rcfg.seed, rcfg.out = cfg.env, cfg.model, cfg.seed * 1000 + k, str(it)
        summary = run_rollout(rcfg, overwrite=True, model=learner.model, tokenizer=learner.tokenizer)
        episodes = read_rollouts(it)
        temperature = rcfg.sampling.temperature if rcfg.sampling.temperature > 0 else 1.0
        annotations = meta = None
        if objective.needs_annotations:
            if learner.updates % max(acfg.teacher_sync_interval, 1) == 0:
                teacher.load_state_dict(learner.model.state_dict())  # sync: the teacher becomes this rollout policy
            acfg.update_step, acfg.seed = learner.updates, cfg.seed * 1000 + k
            annotations, stats = annotate_episodes(episodes, acfg, teacher, learner.tokenizer,
                                                   env_cfg=io.to_plain(cfg.env), temperature=temperature)
            write_annotations(it, annotations, episodes, acfg, stats)
            meta = {"config": io.to_plain(acfg), "stats": stats}
        metrics = learner.update(episodes, temperature, annotations, meta)
        timing = metrics.pop("timing")
        if meta:
            timing["teacher_s"] = meta["stats"]["teacher_s"]
        metrics.update(iteration=k, env_steps=summary["turns"])
        if cfg.eval.episodes and (k + 1) % cfg.eval.every == 0:
            ecfg = EvalConfig(env=EnvConfig(cfg.env.name, cfg.eval.split, cfg.env.max_turns, cfg.env.settings),
                              policy="model", episodes=cfg.eval.episodes, out=str(it), seed=cfg.seed,
                              batch_size=rcfg.batch_size, history_turns=rcfg.prompt.history_turns)
            greedy = ModelPolicy(make_engine(rcfg.engine, learner.model, learner.tokenizer),
                                 SamplingConfig(0.0, 1.0, rcfg.sampling.max_new_tokens), rcfg.prompt, seed=cfg.seed)
            ev = run_eval(ecfg, overwrite=True, policy=greedy)
            metrics.update(eval_success_rate=ev["success_rate"], eval_score=ev["score"])
        learner.save(it / "checkpoint", prompt=rcfg.prompt)
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
    io.mark_stage(run, "online", "done", iterations=cfg.iterations)
    return history
