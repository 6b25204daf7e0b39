"""The learner: a policy being trained, and one update of it on a batch of episodes.

The learner holds the policy inside a training backend (``training.backends``: torch, or
DeepSpeed ZeRO 1/2/3), optionally as LoRA adapters (``training.lora``), and (with
``kl_coef > 0``) the frozen reference; the online loop (``stages.online``) keeps one
learner across iterations. Each update: the objective prepares the batch (advantages,
weights), then ``epochs`` passes over it in ``mini_batches`` optimizer steps, each step
micro-batched; the backend runs each step.
"""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serl_cli.algos.batch import make_micro_batches
from serl_cli.algos.objectives import UpdateInputs, get_objective
from serl_cli.artifacts.schema import turn_samples
from serl_cli.errors import SerlError
from serl_cli.models.loading import ADAPTER_SUBDIR, adapter_dir, base_model_name, load_adapters, require_peft
from serl_cli.rollout.prompts import PROMPT_FILE, PromptConfig, prompt_file_text
from serl_cli.training import lora as lora_mod
from serl_cli.training.backends import BACKENDS as BACKEND_REGISTRY
from serl_cli.training.backends import make_backend
from serl_cli.training.checkpoint import commit_dir, frozen_copy, write_model_files
from serl_cli.training.deepspeed import DeepSpeedConfig
from serl_cli.training.lora import LoraConfig
from serl_cli.training.step import OptimConfig, action_logprobs

BACKENDS = tuple(BACKEND_REGISTRY)



@dataclass
class TrainConfig:
    algo: str = "grpo"
    model: str | None = None  # the policy to update; default: the model that produced the rollouts
    backend: str = "torch"  # torch | deepspeed (serl_cli.training.backends)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # with backend deepspeed
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank > 0: train LoRA adapters only
    optim: OptimConfig = field(default_factory=OptimConfig)
    epochs: int = 1  # passes over the batch per update
    mini_batches: int = 1  # optimizer steps per pass
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # k3 KL to the frozen starting policy
    distill_coef: float = 0.0  # KL(pi || teacher) on selected turns of failed rollouts (off in serl, on in sdpo)
    omega: float = 1.0  # gigpo: weight of the step advantage
    gamma: float = 0.95  # gigpo: discount of the per-turn return
    adv_eps: float = 1e-6
    sft_successful_only: bool = False  # sft: clone successful episodes only (filtered behaviour cloning)
    seed: int = 0
    threads: int | None = None
    checkpoint: str | None = None  # default RUN/checkpoint



def check_train_config(cfg: TrainConfig) -> None:
    """Everything about ``cfg`` that can be wrong, checked before any model loads or any
    file is written: the algorithm, the backend and its config, LoRA, the extras they need."""
    get_objective(cfg.algo)
    lora_mod.validate(cfg.lora)
    if cfg.backend not in BACKENDS:
        raise SerlError(f"unknown backend {cfg.backend!r}: choose one of {', '.join(BACKENDS)}")
    if cfg.backend == "deepspeed":
        from serl_cli.training.deepspeed import check_config

        check_config(cfg)
    if lora_mod.enabled(cfg.lora):
        require_peft()



def training_episodes(episodes: list[dict], cfg: TrainConfig, run: Path) -> list[dict]:
    """The episodes an update learns from. Filtered behaviour cloning keeps only the successful
    ones: an expert that gave up halfway (ALFWorld's hand-coded expert can) demonstrates nothing."""
    if not (cfg.algo == "sft" and cfg.sft_successful_only):
        return episodes
    kept = [e for e in episodes if e.get("success")]
    if not kept:
        raise SerlError(f"{run} holds no successful episode to clone (train.sft_successful_only is on)")
    return kept



def load_policy(model_name: str, cfg: TrainConfig, dtype: torch.dtype, resume_dir: Path | None = None):
    """(model, tokenizer) to train. With LoRA, a fresh run adds new adapters to the model (a
    checkpoint's own adapter, if it has one, is merged into it first), so the model as
    loaded is the starting policy and the KL reference is that model with adapters off; a
    resumed run puts its saved adapter back on the same base and keeps training it."""
    from serl_cli.models.loading import load_model

    if not lora_mod.enabled(cfg.lora):
        return load_model(model_name, dtype)
    adapter = adapter_dir(resume_dir) if resume_dir is not None else None
    if adapter is not None:
        from transformers import AutoTokenizer

        base, _ = load_model(base_model_name(adapter), dtype)
        return load_adapters(base, adapter, trainable=True), AutoTokenizer.from_pretrained(str(resume_dir))
    model, tokenizer = load_model(model_name, dtype)
    path = Path(model_name).expanduser()
    base_name = str(path.resolve()) if path.exists() else model_name  # resumable from any working directory
    return lora_mod.add_adapters(model, cfg.lora, base_name), tokenizer



class Learner:
    """A policy being trained: the backend (model, optimizer), tokenizer, reference, update counter."""

    def __init__(self, model_name: str, cfg: TrainConfig, state_file: Path | None = None):
        from serl_cli.models.loading import set_torch_threads

        check_train_config(cfg)  # fail on bad settings before loading anything
        self.backend = make_backend(cfg)
        set_torch_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.uses_lora = lora_mod.enabled(cfg.lora)
        resume_dir = state_file.parent if state_file is not None and state_file.is_file() else None
        model, self.tokenizer = load_policy(model_name, cfg, self.backend.load_dtype, resume_dir)
        model.config.use_cache = False
        # the KL reference is the starting policy: under LoRA the adapters switched off, else a frozen copy
        self.reference = frozen_copy(model) if cfg.kl_coef > 0 and not self.uses_lora else None
        self.backend.wrap(model)
        if self.reference is not None:
            self.reference.to(self.backend.device)
        self.updates = 0
        if resume_dir is not None:
            state = torch.load(state_file, weights_only=False)
            self.backend.load_state(state, resume_dir)
            self.updates = state["updates"]
            if self.reference is not None and "reference" in state:
                self.reference.load_state_dict(state["reference"])

    # -- what the rest of serl sees -------------------------------------------------------------
    @property
    def model(self):
        """The policy network (a Hugging Face model, or its peft wrapper). Under ZeRO-3 its
        weights are partitioned: use :meth:`full_model` to run it outside training."""
        return self.backend.module

    @property
    def optimizer(self):
        return self.backend.optimizer

    @property
    def is_main(self) -> bool:
        return self.backend.is_main

    def full_model(self):
        """Context manager: the policy with whole weights, for generation, scoring and saving
        (a collective under ZeRO-3: every process enters)."""
        return self.backend.full_model()

    def broadcast(self, obj):
        """``obj`` as the main process has it, on every process."""
        return self.backend.broadcast(obj)

    def barrier(self) -> None:
        self.backend.barrier()

    # -- the update ------------------------------------------------------------------------------
    def _reference_logprobs(self, mb, temperature: float):
        if self.cfg.kl_coef <= 0:
            return None
        with torch.no_grad():
            if self.reference is not None:
                return action_logprobs(self.reference, mb, temperature)
            with lora_mod.reference_view(self.backend.module) as base:
                return action_logprobs(base, mb, temperature)

    def update(self, episodes: list[dict], temperature: float, annotations: list[dict] | None = None,
               annotate_meta: dict | None = None) -> dict:
        """Train on a batch of episodes; returns the update's metrics."""
        cfg = self.cfg
        objective = get_objective(cfg.algo)
        samples = turn_samples(episodes)
        if not objective.uses_behaviour_logprobs:  # imitation: a noisy expert's exploration moves are no targets
            samples = [s for s in samples if not s.off_expert]
        if objective.uses_behaviour_logprobs and any(not s.behaviour_logprobs for s in samples):
            raise SerlError(f"--algo {cfg.algo} needs behaviour log-probs: these rollouts have none "
                            f"(expert data is for --algo sft)")
        meta = annotate_meta or {}
        inputs = UpdateInputs(episodes, annotations, meta.get("config"), meta.get("stats"))
        prepared = objective.prepare(samples, inputs, cfg)
        distill_tokens = prepared.stats.get("distill_tokens", 0)
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
                mbs = make_micro_batches(samples, chunk, cfg.optim.micro_batch_tokens, pad, prepared)
                # every turn of the step counts in the normalizer, skipped or not (METHOD.md: / N_tokens)
                chunk_tokens = num_tokens / cfg.mini_batches

                def loss_fn(mb, logp, n_tokens):
                    return objective.loss(mb, logp, cfg, num_tokens=n_tokens, distill_tokens=distill_tokens,
                                          logp_ref=self._reference_logprobs(mb, temperature))

                step_stats.append(self.backend.step(mbs, loss_fn, chunk_tokens, temperature))
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

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self, path: str | Path, prompt: PromptConfig | None = None) -> Path:
        """The policy as a Hugging Face directory (gathered from the ZeRO-3 partitions; with
        LoRA merged or adapter-only, ``train.lora.save``), the resume state, and the prompt
        settings it was trained on (so `serl eval` prompts it the same way). Every process
        calls it; the main one writes the model files into a staging sibling that replaces
        ``path`` only when complete."""
        path = Path(path)
        staging = path.with_name(f".{path.name}.partial")  # one name every process of a job agrees on
        if self.is_main:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        self.barrier()
        self.backend.save_engine_state(staging)
        state = {"updates": self.updates, **self.backend.resume_state()}
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        files = {PROMPT_FILE: prompt_file_text(prompt)} if prompt is not None else {}
        with self.full_model() as module:
            if self.is_main:
                self._write_model(module, staging, state, files)
        self.barrier()
        if self.is_main:
            commit_dir(staging, path)
        self.barrier()
        return path

    def _write_model(self, module, directory: Path, state: dict, files: dict) -> None:
        if not self.uses_lora:
            write_model_files(module, self.tokenizer, directory, extra_state=state, extra_files=files)
        elif self.cfg.lora.save == "merged":
            write_model_files(module.get_base_model(), self.tokenizer, directory,
                              state_dict=lora_mod.merged_state_dict(module), extra_state=state, extra_files=files)
            module.save_pretrained(directory / ADAPTER_SUBDIR)
        else:  # adapter only: peft's layout, plus the tokenizer and serl's files
            module.save_pretrained(directory)
            self.tokenizer.save_pretrained(directory)
            torch.save(state, directory / "trainer_state.pt")
            for name, text in files.items():
                (directory / name).write_text(text, encoding="utf-8")


def _mean_stats(steps: list[dict]) -> dict:
    if not steps:  # no turn had a gradient (every group's rewards were equal): nothing was applied
        return {"loss": 0.0, "skipped_steps": 0, "optimizer_steps": 0}
    # a skipped step (non-finite loss or gradient) applied nothing: the means are over the applied ones
    applied = [s for s in steps if not s.get("skipped")]
    keys = sorted({k for s in applied for k in s})
    out = {k: sum(s.get(k, 0.0) for s in applied) / len(applied) for k in keys if k != "skipped"}
    if not applied:
        out["loss"] = float("nan")  # every step was skipped: there is no applied loss to report
    out["skipped_steps"] = len(steps) - len(applied)
    out["optimizer_steps"] = len(steps)
    return out


def _episode_stats(episodes: list[dict]) -> dict:
    n = len(episodes)
    return {"mean_reward": sum(e["reward"] for e in episodes) / n, "success_rate": sum(e["success"] for e in episodes) / n,
            "episodes": n}
