"""``serl train RUN --algo ...``: one update of a policy on a run's stored rollouts.

The learner holds the policy inside a training backend (``serl_cli.backends``: torch, or
DeepSpeed ZeRO 1/2/3), optionally as LoRA adapters (``serl_cli.lora``), and (with
``kl_coef > 0``) the frozen reference; the online loop (``serl_cli.online``) keeps one
learner across iterations. Each update: the objective prepares the batch (advantages,
weights), then ``epochs`` passes over it in ``mini_batches`` optimizer steps, each step
micro-batched; the backend runs each step.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serl_cli import io, runlock
from serl_cli import lora as lora_mod
from serl_cli.backends import BACKENDS as BACKEND_REGISTRY
from serl_cli.backends import make_backend
from serl_cli.deepspeed_backend import DeepSpeedConfig
from serl_cli.errors import SerlError
from serl_cli.lora import LoraConfig
from serl_cli.objectives import get_objective
from serl_cli.prompts import PROMPT_FILE, PromptConfig, prompt_file_text
from serl_cli.schema import read_rollouts, turn_samples
from serl_cli.trainer import OptimConfig, action_logprobs, commit_dir, make_micro_batches, write_model_files

BACKENDS = tuple(BACKEND_REGISTRY)


@dataclass
class TrainConfig:
    algo: str = "grpo"
    model: str | None = None  # the policy to update; default: the model that produced the rollouts
    backend: str = "torch"  # torch | deepspeed (serl_cli.backends)
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
        from serl_cli.deepspeed_backend import check_config

        check_config(cfg)
    if lora_mod.enabled(cfg.lora):
        lora_mod.require_peft()


def training_episodes(episodes: list[dict], cfg: TrainConfig, run: Path) -> list[dict]:
    """The episodes an update learns from. Filtered behaviour cloning keeps only the successful
    ones: an expert that gave up halfway (ALFWorld's hand-coded expert can) demonstrates nothing."""
    if not (cfg.algo == "sft" and cfg.sft_successful_only):
        return episodes
    kept = [e for e in episodes if e.get("success")]
    if not kept:
        raise SerlError(f"{run} holds no successful episode to clone (train.sft_successful_only is on)")
    return kept


def frozen_copy(model, device=None):
    """A frozen replica of a (plain Hugging Face) model, built from its config and weights:
    no DeepSpeed or peft state comes along."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):  # building a model draws initial weights: keep the caller's stream
        replica = AutoModelForCausalLM.from_config(model.config, dtype=model.dtype)
    replica.load_state_dict(model.state_dict())
    return replica.to(device or model.device).eval().requires_grad_(False)


def load_policy(model_name: str, cfg: TrainConfig, dtype: torch.dtype, resume_dir: Path | None = None):
    """(model, tokenizer) to train. With LoRA, a fresh run adds new adapters to the model (a
    checkpoint's own adapter, if it has one, is merged into it first), so the model as
    loaded is the starting policy and the KL reference is that model with adapters off; a
    resumed run puts its saved adapter back on the same base and keeps training it."""
    from serl_cli.model import load_model

    if not lora_mod.enabled(cfg.lora):
        return load_model(model_name, dtype)
    adapter = lora_mod.adapter_dir(resume_dir) if resume_dir is not None else None
    if adapter is not None:
        from transformers import AutoTokenizer

        base, _ = load_model(lora_mod.base_model_name(adapter), dtype)
        return lora_mod.load_adapters(base, adapter, trainable=True), AutoTokenizer.from_pretrained(str(resume_dir))
    model, tokenizer = load_model(model_name, dtype)
    path = Path(model_name).expanduser()
    base_name = str(path.resolve()) if path.exists() else model_name  # resumable from any working directory
    return lora_mod.add_adapters(model, cfg.lora, base_name), tokenizer


class Learner:
    """A policy being trained: the backend (model, optimizer), tokenizer, reference, update counter."""

    def __init__(self, model_name: str, cfg: TrainConfig, state_file: Path | None = None):
        from serl_cli.model import set_torch_threads

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
                    ref = self._reference_logprobs(mb, temperature)
                    return objective.loss(mb, logp, _samples, _prep, n_tokens, cfg, ref)

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
            module.save_pretrained(directory / lora_mod.ADAPTER_SUBDIR)
        else:  # adapter only: peft's layout, plus the tokenizer and serl's files
            module.save_pretrained(directory)
            self.tokenizer.save_pretrained(directory)
            torch.save(state, directory / "trainer_state.pt")
            for name, text in files.items():
                (directory / name).write_text(text, encoding="utf-8")


def follow_train_on_run(run_dir: str, cfg: TrainConfig, *, resume: bool = False) -> None:
    """``train_on_run`` on a process other than the main one of a launched job: the same
    update and save (their collectives need every process), none of the run's bookkeeping,
    which the main process does."""
    run = Path(run_dir)
    manifest = io.load_manifest(run)
    stage = manifest["stages"].get(f"train:{cfg.algo}", {})
    checkpoint = Path(cfg.checkpoint) if cfg.checkpoint else run / "checkpoint"
    if resume and stage.get("status") == "done" and (checkpoint / "config.json").is_file():
        return  # the main process returns the finished update's metrics without training
    rollout_cfg = manifest.get("stages", {}).get("rollout", {}).get("config", {})
    model_name = cfg.model or rollout_cfg.get("model")
    annotations, meta = None, None
    if get_objective(cfg.algo).needs_annotations:
        from serl_cli.annotate import read_annotations

        annotations = read_annotations(run)
        meta = manifest["stages"]["annotate"]
    learner = Learner(model_name, cfg)
    learner.update(training_episodes(read_rollouts(run), cfg, run), 1.0 if cfg.algo == "sft" else rollout_temperature(manifest), annotations, meta)
    learner.save(checkpoint, prompt=PromptConfig(**rollout_cfg["prompt"]) if "prompt" in rollout_cfg else None)


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


def rollout_temperature(manifest: dict) -> float:
    """Behaviour log-probs were taken at the rollout's temperature; greedy ones at 1."""
    cfg = manifest.get("stages", {}).get("rollout", {}).get("config", {})
    t = float(cfg.get("sampling", {}).get("temperature", 1.0))
    return t if t > 0 else 1.0


def train_on_run(run_dir: str, cfg: TrainConfig, *, overwrite: bool = False, resume: bool = False) -> dict:
    """One update on a run's rollouts, under the run's lock. The update is the unit of work:
    a killed one reruns from the start (the checkpoint is written atomically and the
    metrics lines of an unfinished attempt are dropped); ``resume`` returns a finished
    update's metrics without redoing it."""
    run = Path(run_dir)
    with runlock.run_lock(run):
        return _train_on_run(run, cfg, overwrite=overwrite, resume=resume)


def _comparable(cfg: TrainConfig) -> dict:
    plain = io.to_plain(cfg)
    plain.pop("threads")
    return plain


def _train_on_run(run: Path, cfg: TrainConfig, *, overwrite: bool, resume: bool) -> dict:
    manifest = io.load_manifest(run)
    get_objective(cfg.algo)
    stage_name = f"train:{cfg.algo}"
    stage = manifest["stages"].get(stage_name, {})
    checkpoint = Path(cfg.checkpoint) if cfg.checkpoint else run / "checkpoint"
    metrics_path, timings_path = run / "metrics.jsonl", run / "timings.jsonl"
    rollout_cfg = manifest.get("stages", {}).get("rollout", {}).get("config", {})
    model_name = cfg.model or rollout_cfg.get("model")
    if resume and not overwrite:
        if stage.get("status") == "done" and (checkpoint / "config.json").is_file():
            stored = {k: v for k, v in (stage.get("config") or {}).items() if k != "threads"}
            if stored != json.loads(json.dumps({**_comparable(cfg), "model": model_name})):
                raise SerlError(f"{run} finished {stage_name} with other settings: pass --overwrite to train again")
            records = list(io.iter_jsonl(metrics_path))
            return records[stage.get("metrics_line", len(records) - 1)]
    else:
        io.prepare_output(checkpoint, overwrite=overwrite, what="a checkpoint")
    episodes = training_episodes(read_rollouts(run), cfg, run)
    if not model_name:
        raise SerlError(f"no model to train: {run}/manifest.json names none; pass --model")
    cfg.model = model_name
    annotations, meta = None, None
    if get_objective(cfg.algo).needs_annotations:
        from serl_cli.annotate import read_annotations

        annotations = read_annotations(run)
        meta = manifest["stages"]["annotate"]
    if stage.get("status") == "running":  # an earlier attempt was killed: forget what it may have written
        io.truncate_jsonl(metrics_path, stage.get("metrics_line", 0))
        io.truncate_jsonl(timings_path, stage.get("timings_line", 0))
    line, timings_line = io.count_jsonl(metrics_path), io.count_jsonl(timings_path)
    io.mark_stage(run, stage_name, "running", metrics_line=line, timings_line=timings_line)
    learner = Learner(model_name, cfg)
    metrics = learner.update(episodes, 1.0 if cfg.algo == "sft" else rollout_temperature(manifest), annotations, meta)
    timing = metrics.pop("timing")  # wall-clock figures apart, so metrics.jsonl is deterministic
    from safetensors import SafetensorError

    try:
        learner.save(checkpoint, prompt=PromptConfig(**rollout_cfg["prompt"]) if "prompt" in rollout_cfg else None)
    except (OSError, SafetensorError) as e:  # disk full: the old checkpoint, if any, is still in place
        io.clear_debris(checkpoint.parent)  # and the half-written new one goes
        raise io.write_failed(checkpoint, e) from None
    io.append_jsonl(metrics_path, metrics)
    io.append_jsonl(timings_path, {"update": line, "algo": cfg.algo, **timing})
    io.mark_stage(run, stage_name, "done", config=io.to_plain(cfg), checkpoint=str(checkpoint), metrics_line=line)
    return metrics
