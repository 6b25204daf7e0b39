"""``serl train RUN --algo ...``: one update of a policy on a run's stored rollouts.

The learner holds the policy, its optimizer and (with ``kl_coef > 0``) a frozen
reference copy; the online loop (``serl_cli.online``) keeps one learner across
iterations. Each update: the objective prepares the batch (advantages, weights), then
``epochs`` passes over it in ``mini_batches`` optimizer steps, each step micro-batched.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serl_cli import io
from serl_cli.errors import SerlError
from serl_cli.objectives import get_objective
from serl_cli.prompts import PROMPT_FILE, PromptConfig, prompt_file_text
from serl_cli.schema import read_rollouts, turn_samples
from serl_cli.trainer import OptimConfig, accumulate_step, action_logprobs, make_micro_batches, make_optimizer, save_checkpoint

BACKENDS = ("torch",)


@dataclass
class TrainConfig:
    algo: str = "grpo"
    model: str | None = None  # the policy to update; default: the model that produced the rollouts
    backend: str = "torch"
    optim: OptimConfig = field(default_factory=OptimConfig)
    epochs: int = 1  # passes over the batch per update
    mini_batches: int = 1  # optimizer steps per pass
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # k3 KL to the frozen starting policy
    distill_coef: float = 0.0  # KL(pi || teacher) on selected turns of failed rollouts (off in serl, on in sdpo)
    omega: float = 1.0  # gigpo: weight of the step advantage
    gamma: float = 0.95  # gigpo: discount of the per-turn return
    adv_eps: float = 1e-6
    seed: int = 0
    threads: int | None = None
    checkpoint: str | None = None  # default RUN/checkpoint


class Learner:
    """A policy being trained: model, tokenizer, optimizer, reference, update counter."""

    def __init__(self, model_name: str, cfg: TrainConfig, state_file: Path | None = None):
        from serl_cli.model import load_model, set_torch_threads

        if cfg.backend not in BACKENDS:
            raise SerlError(f"unknown backend {cfg.backend!r}: choose one of {', '.join(BACKENDS)}")
        get_objective(cfg.algo)  # fail on an unknown algorithm before loading anything
        set_torch_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.model, self.tokenizer = load_model(model_name)
        self.model.config.use_cache = False
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.reference = None
        if cfg.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.updates = 0
        if state_file is not None and state_file.is_file():
            state = torch.load(state_file, weights_only=False)
            self.optimizer.load_state_dict(state["optimizer"])
            self.updates = state["updates"]
            if self.reference is not None and "reference" in state:
                self.reference.load_state_dict(state["reference"])

    def update(self, episodes: list[dict], temperature: float, annotations: list[dict] | None = None,
               annotate_meta: dict | None = None) -> dict:
        """Train on a batch of episodes; returns the update's metrics."""
        cfg = self.cfg
        objective = get_objective(cfg.algo)
        samples = turn_samples(episodes)
        if objective.uses_behaviour_logprobs and any(not s.behaviour_logprobs for s in samples):
            raise SerlError(f"--algo {cfg.algo} needs behaviour log-probs: these rollouts have none "
                            f"(expert data is for --algo sft)")
        meta = annotate_meta or {}
        prepared = objective.prepare(samples, {"episodes": episodes, "annotations": annotations, "update": self.updates,
                                               "annotate_config": meta.get("config"), "annotate_stats": meta.get("stats")}, cfg)
        num_tokens = float(sum(len(s.action_ids) for s in samples))
        active = self._contributing(objective, samples, prepared)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        rng = random.Random(cfg.seed * 7919 + self.updates)
        t0 = time.perf_counter()
        self.model.train()
        step_stats = []
        for _ in range(cfg.epochs):
            order = list(active)
            rng.shuffle(order)
            chunks = [order[i::cfg.mini_batches] for i in range(cfg.mini_batches)]
            for chunk in chunks:
                if not chunk:
                    continue
                chunk.sort(key=lambda i: len(samples[i].prompt_ids) + len(samples[i].action_ids))
                mbs = make_micro_batches(samples, chunk, cfg.optim.micro_batch_tokens, pad)
                # every turn of the step counts in the normalizer, skipped or not (METHOD.md: / N_tokens)
                chunk_tokens = num_tokens / cfg.mini_batches

                def loss_fn(mb, logp, n_tokens, _samples=samples, _prep=prepared):
                    ref = None
                    if self.reference is not None:
                        with torch.no_grad():
                            ref = action_logprobs(self.reference, mb, temperature)
                    return objective.loss(mb, logp, _samples, _prep, n_tokens, cfg, ref)

                step_stats.append(accumulate_step(self.model, self.optimizer, mbs, loss_fn, chunk_tokens,
                                                  temperature, cfg.optim.grad_clip))
        self.model.eval()
        self.updates += 1
        wall = time.perf_counter() - t0
        metrics = {"update": self.updates, "algo": cfg.algo, "turns": len(samples), "action_tokens": int(num_tokens),
                   "turns_with_gradient": len(active)}
        metrics.update(_mean_stats(step_stats))
        metrics.update(prepared.stats)
        metrics.update(_episode_stats(episodes))
        metrics["timing"] = {"update_s": round(wall, 4), "action_tokens_per_s": round(num_tokens * cfg.epochs / wall, 2) if wall else 0.0}
        return metrics

    def _contributing(self, objective, samples, prepared) -> list[int]:
        """Turns whose loss can have a gradient. Without a KL term, a turn with advantage 0
        (a group whose rewards are all equal) and no distillation term adds exactly 0 to the
        loss and its gradient, so it is not run through the model at all."""
        if not objective.uses_behaviour_logprobs or self.cfg.kl_coef > 0:
            return list(range(len(samples)))
        distill = prepared.distill or [False] * len(samples)
        return [i for i in range(len(samples)) if prepared.advantages[i] != 0 or distill[i]]

    def save(self, path: str | Path, prompt: PromptConfig | None = None) -> Path:
        """The policy as a Hugging Face directory, its optimizer state, and the prompt settings
        it was trained on (so `serl eval` prompts it the same way)."""
        state = {"optimizer": self.optimizer.state_dict(), "updates": self.updates}
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        files = {PROMPT_FILE: prompt_file_text(prompt)} if prompt is not None else None
        return save_checkpoint(self.model, self.tokenizer, path, extra_state=state, extra_files=files)


def _mean_stats(steps: list[dict]) -> dict:
    if not steps:  # no turn had a gradient (every group's rewards were equal): nothing was applied
        return {"loss": 0.0, "skipped_steps": 0, "optimizer_steps": 0}
    keys = sorted({k for s in steps for k in s})
    out = {k: sum(s.get(k, 0.0) for s in steps) / len(steps) for k in keys if k != "skipped"}
    out["skipped_steps"] = int(sum(s.get("skipped", 0.0) for s in steps))
    out["optimizer_steps"] = len(steps)
    return out


def _episode_stats(episodes: list[dict]) -> dict:
    n = len(episodes)
    return {"mean_reward": sum(e["reward"] for e in episodes) / n, "success_rate": sum(e["success"] for e in episodes) / n,
            "episodes": n}


def rollout_temperature(manifest: dict) -> float:
    """Behaviour log-probs were taken at the rollout's temperature; greedy ones at 1."""
    cfg = manifest.get("stages", {}).get("rollout", {}).get("config", {})
    t = float(cfg.get("sampling", {}).get("temperature", 1.0))
    return t if t > 0 else 1.0


def train_on_run(run_dir: str, cfg: TrainConfig, *, overwrite: bool = False) -> dict:
    run = Path(run_dir)
    manifest = io.load_manifest(run)
    get_objective(cfg.algo)
    checkpoint = Path(cfg.checkpoint) if cfg.checkpoint else run / "checkpoint"
    io.prepare_output(checkpoint, overwrite=overwrite, what="a checkpoint")
    episodes = read_rollouts(run)
    rollout_cfg = manifest.get("stages", {}).get("rollout", {}).get("config", {})
    model_name = cfg.model or rollout_cfg.get("model")
    if not model_name:
        raise SerlError(f"no model to train: {run}/manifest.json names none; pass --model")
    cfg.model = model_name
    annotations, meta = None, None
    if get_objective(cfg.algo).needs_annotations:
        from serl_cli.annotate import read_annotations

        annotations = read_annotations(run)
        meta = manifest["stages"]["annotate"]
    learner = Learner(model_name, cfg)
    metrics = learner.update(episodes, 1.0 if cfg.algo == "sft" else rollout_temperature(manifest), annotations, meta)
    learner.save(checkpoint, prompt=PromptConfig(**rollout_cfg["prompt"]) if "prompt" in rollout_cfg else None)
    io.append_jsonl(run / "metrics.jsonl", metrics)
    io.mark_stage(run, f"train:{cfg.algo}", "done", config=io.to_plain(cfg), checkpoint=str(checkpoint))
    return metrics
