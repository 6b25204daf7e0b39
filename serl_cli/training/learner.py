"""The learner: a policy being trained, and one update of it on a batch of episodes.

The learner holds the policy inside a training backend (``training.backends``: torch, or
DeepSpeed ZeRO 1/2/3), optionally as LoRA adapters (``training.lora``), and (with
``kl_coef > 0``) the frozen reference; the online loop (``online.loop``) keeps one
learner across iterations. Each update: the objective prepares the batch (advantages,
weights), then ``epochs`` passes over it in ``mini_batches`` optimizer steps, each step
micro-batched; the backend runs each step.
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from serl_cli.algos.batch import MicroBatch, PerTurn, make_micro_batches, micro_batch_groups
from serl_cli.algos.objectives import (
    ResolvedObjective,
    UpdateInputs,
    default_advantages,
    get_objective,
    turn_advantages,
)
from serl_cli.algos.offpolicy import offpolicy_correction
from serl_cli.artifacts import io
from serl_cli.artifacts.records import Annotation, Episode, check_token_ids
from serl_cli.artifacts.schema import TurnSample, turn_samples
from serl_cli.errors import SerlError
from serl_cli.models.device import tag
from serl_cli.rollout.prompts import PROMPT_FILE, PromptConfig, prompt_file_text
from serl_cli.training import lora as lora_mod
from serl_cli.training.backends import make_backend
from serl_cli.training.checkpoint import commit_dir, frozen_copy, read_trainer_state, write_policy
from serl_cli.training.policy import load_policy
from serl_cli.training.scoring import ScoreItem, score
from serl_cli.training.step import action_logprobs
from serl_cli.training.train_config import TrainConfig, check_train_config, recompute_enabled
from serl_cli.training.update_report import Ticker, episode_stats, mean_step_stats


def training_episodes(episodes: list[Episode], cfg: TrainConfig, run: Path) -> list[Episode]:
    """The episodes an update learns from. Filtered behaviour cloning keeps only the successful
    ones: an expert that gave up halfway (ALFWorld's hand-coded expert can) demonstrates nothing."""
    if not (get_objective(cfg.algo).imitation and cfg.sft_successful_only):
        return episodes
    kept = [e for e in episodes if e.success]
    if not kept:
        raise SerlError(f"{run} holds no successful episode to clone (train.sft_successful_only is on)")
    return kept


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
        resume_file = state_file if state_file is not None and state_file.is_file() else None
        resume_dir = resume_file.parent if resume_file is not None else None
        model, self.tokenizer = load_policy(
            model_name, cfg, self.backend.load_dtype, resume_dir, self.backend.precision.attn_implementation
        )
        model.config.use_cache = False
        if cfg.gradient_checkpointing:  # non-reentrant: works with frozen inputs (LoRA) and under ZeRO
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.20's name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # the KL reference is the starting policy: under LoRA the adapters switched off, else a frozen copy
        self.reference = frozen_copy(model) if cfg.kl_coef > 0 and not self.uses_lora else None
        self.backend.wrap(model)
        if self.reference is not None:
            tag(self.reference.to(self.backend.device), self.backend.precision)
        self.updates = 0
        if resume_file is not None:
            state = read_trainer_state(resume_file)
            self.backend.load_state(state, resume_file.parent)
            self.updates = state["updates"]
            if self.reference is not None and "reference" in state:
                self.reference.load_state_dict(state["reference"])

    # -- what the rest of serl sees -------------------------------------------------------------
    @property
    def model(self) -> Any:  # a Hugging Face model, or its peft wrapper
        """The policy network (a Hugging Face model, or its peft wrapper). Under ZeRO-3 its
        weights are partitioned: use :meth:`full_model` to run it outside training."""
        return self.backend.module

    @property
    def optimizer(self) -> Any:  # torch's AdamW, or DeepSpeed's optimizer
        return self.backend.optimizer

    @property
    def is_main(self) -> bool:
        return self.backend.is_main

    def full_model(self) -> AbstractContextManager:
        """Context manager: the policy with whole weights, for generation, scoring and saving
        (a collective under ZeRO-3: every process enters)."""
        return self.backend.full_model()

    def trained_parameters(self) -> list[tuple]:
        """``(name, parameter)`` of every weight an update changes: all of them, or under LoRA
        the adapters'."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def stream_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's weights as ``(Hugging Face name, tensor)`` pairs, what a checkpoint of
        it holds (under LoRA merged, one layer at a time), for an engine with its own copy.
        One tensor at a time, valid until the next is asked for: under ZeRO-3 each is gathered
        alone, a collective, so every process iterates the whole stream."""
        if self.uses_lora:
            yield from lora_mod.merged_weights(self.model, self.backend.gathered)
            return
        for name, p in self.model.named_parameters():
            with self.backend.gathered([p]):
                yield name, p.data

    def largest_weight(self) -> int:
        """The element count of the policy's largest weight (under ZeRO-3 as gathered)."""
        return max(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters())

    @property
    def scorer(self) -> Callable[..., list[list[float]]]:
        """:func:`~serl_cli.training.scoring.score` over this learner's processes: each scores
        its share of the items, every one gets all the results."""
        return partial(score, ranks=self.backend)

    def all_gather(self, obj: object) -> list:
        """``obj`` of every process, in rank order."""
        return self.backend.all_gather(obj)

    def current_lr(self) -> float:
        """The learning rate the optimizer's next step takes (its schedule's, where one runs)."""
        groups = getattr(self.optimizer, "param_groups", None)
        return float(groups[0]["lr"]) if groups else float(self.cfg.optim.lr)

    def barrier(self) -> None:
        self.backend.barrier()

    # -- the update ------------------------------------------------------------------------------
    def _reference_logprobs(self, mb: MicroBatch, temperature: float) -> torch.Tensor | None:
        if self.cfg.kl_coef <= 0:
            return None
        with torch.no_grad():
            if self.reference is not None:
                return action_logprobs(self.reference, mb, temperature)
            with lora_mod.reference_view(self.backend.module) as base:
                return action_logprobs(base, mb, temperature)

    def recompute_logp_old(self, episodes: list[Episode], temperature: float, only: set[int] | None = None) -> dict:
        """Replace every turn's ``behaviour_logprobs`` (pi_old) by the trainer's own log-probs
        of the same tokens, in place, before anything reads them (the annotate stage's
        weights and the PPO ratio); the engine's stay in ``engine_logprobs``. Under several
        processes each scores the turns of its own task groups and all get every result
        (:func:`~serl_cli.training.scoring.score`; under ZeRO-3 no process gathers the whole
        model for it). Returns the engine-trainer mismatch over all reply tokens, mean and
        max |delta log p| (verl logs the same comparison in probabilities,
        ray_trainer.py:1170-1192). Turns already recomputed are left alone, so calling it
        twice costs nothing. ``only``: the indices of the episodes to recompute (None: all)."""
        turns = [
            t
            for e, ep in enumerate(episodes)
            if only is None or e in only
            for t in ep.turns
            if t.behaviour_logprobs and t.engine_logprobs is None
        ]
        if not turns:
            return {}
        items = [ScoreItem(t.prompt_ids, t.action_ids) for t in turns]
        new = self.scorer(self.model, self.tokenizer, items, temperature, self.cfg.optim.micro_batch_tokens)
        total, worst, count = 0.0, 0.0, 0
        for t, lp in zip(turns, new, strict=True):
            deltas = [abs(a - b) for a, b in zip(lp, t.behaviour_logprobs, strict=True)]
            total, count = total + sum(deltas), count + len(deltas)
            worst = max([worst, *deltas])
            t.engine_logprobs, t.behaviour_logprobs = t.behaviour_logprobs, lp
        return {
            "logp_old_recomputed_turns": len(turns),
            "logp_mismatch_mean": total / max(count, 1),
            "logp_mismatch_max": worst,
        }

    def update(
        self,
        episodes: list[Episode],
        temperature: float,
        annotations: list[Annotation] | None = None,
        annotate_meta: dict | None = None,
        engine: str | None = None,
        progress: Callable[[int, int], object] | None = None,
        rollout_half: bool | None = None,
        staleness: int = 0,
    ) -> dict:
        """Train on a batch of episodes; returns the update's metrics. ``engine``: what
        generated the rollouts (hf, vllm), and ``rollout_half`` whether in half precision (None:
        with this learner's model, in its precision), for ``train.recompute_logp_old: null``.
        ``progress(done, total)``: micro-batches run of the update's, once before the first
        and after each one (a progress bar; its last call has ``done == total``). ``staleness``: how
        many updates behind this learner the rollouts' policy is (the online loop's ``max_staleness``)."""
        cfg = self.cfg
        check_token_ids(episodes, self.model.get_input_embeddings().num_embeddings, "the update's rollouts")
        objective = get_objective(cfg.algo)
        recompute = objective.uses_behaviour_logprobs and recompute_enabled(cfg, engine, rollout_half, staleness)
        recomputed = self.recompute_logp_old(episodes, temperature) if recompute and staleness == 0 else {}
        samples, annotations = self._training_turns(objective, turn_samples(episodes), annotations)
        meta = annotate_meta or {}
        prepared = objective.prepare(
            samples, UpdateInputs(episodes, annotations, meta.get("config"), meta.get("stats")), cfg
        )
        active = self._contributing(objective, samples, prepared)
        recompute_s = None
        if recompute and staleness > 0:
            # stale rollouts: pi_prox only where it weighs a gradient -- the episodes with a turn
            # that has one (an episode-level ratio covers all its turns); the rest add exactly 0
            t_recompute = time.perf_counter()
            recomputed = self._recompute_for(samples, active, episodes, temperature)
            recompute_s = round(time.perf_counter() - t_recompute, 4)
        offpolicy: dict = {}
        if objective.uses_behaviour_logprobs:
            prepared.is_weights, offpolicy = offpolicy_correction(samples, cfg.offpolicy, staleness)
        if prepared.token_weights is not None and not default_advantages(cfg):
            _check_annotated_advantages(prepared.advantages, annotations, turn_advantages(samples, cfg), cfg)
        t0 = time.perf_counter()
        step_stats = self._optimizer_steps(objective, samples, active, prepared, temperature, progress)
        wall = time.perf_counter() - t0
        num_tokens = sum(len(s.action_ids) for s in samples)
        metrics: dict[str, Any] = {
            "update": self.updates,
            "algo": cfg.algo,
            "turns": len(samples),
            "action_tokens": num_tokens,
            "turns_with_gradient": len(active),
        }
        metrics.update(mean_step_stats(step_stats))
        metrics.setdefault("lr", self.current_lr())  # no step applied: the lr the next one would take
        metrics.update(prepared.stats)
        metrics.update(episode_stats(episodes))
        metrics.update(recomputed)
        metrics.update(offpolicy)
        metrics["timing"] = {
            "update_s": round(wall, 4),
            "action_tokens_per_s": round(num_tokens * cfg.epochs / wall, 2) if wall else 0.0,
        }
        if recompute_s is not None:  # pi_prox of stale rollouts, before the update's own clock
            metrics["timing"]["recompute_s"] = recompute_s
        return metrics

    def _training_turns(
        self, objective: ResolvedObjective, samples: list[TurnSample], annotations: list[Annotation] | None
    ) -> tuple[list[TurnSample], list[Annotation] | None]:
        """The turns an update learns from, and their annotations. An episode the environment broke
        (a crash, a timeout) says nothing about the policy: out of its group's statistics and out of
        the loss, counted in the metrics. Imitation leaves out a noisy expert's exploration moves."""
        faulted = {i for i, s in enumerate(samples) if s.faulted}
        if faulted:
            kept = [s for i, s in enumerate(samples) if i not in faulted]
            if annotations is not None and len(annotations) == len(kept) + len(faulted):
                annotations = [a for i, a in enumerate(annotations) if i not in faulted]
            samples = kept
        if not objective.uses_behaviour_logprobs:
            samples = [s for s in samples if not s.off_expert]
        if objective.uses_behaviour_logprobs and any(not s.behaviour_logprobs for s in samples):
            raise SerlError(
                f"--algo {self.cfg.algo} needs behaviour log-probs: these rollouts have none (expert data is for "
                "--algo sft)"
            )
        return samples, annotations

    def _step_turns(self, samples: list, active: list[int]) -> tuple[list[list[int]], int]:
        """Each optimizer step's turns: ``epochs`` seeded shuffles of the turns with a gradient, each in
        ``n`` mini-batches (a count, or the turns / ``mini_batch_turns``), shortest first; and ``n``."""
        cfg = self.cfg
        rng = random.Random(cfg.seed * 7919 + self.updates)
        n_mini = max(-(-len(samples) // cfg.mini_batch_turns) if cfg.mini_batch_turns else cfg.mini_batches, 1)
        steps = []
        for _ in range(cfg.epochs):
            order = list(active)
            rng.shuffle(order)
            for chunk in (order[i::n_mini] for i in range(n_mini)):
                if chunk:
                    chunk.sort(key=lambda i: len(samples[i].prompt_ids) + len(samples[i].action_ids))
                    steps.append(chunk)
        return steps, n_mini

    def _optimizer_steps(
        self,
        objective: ResolvedObjective,
        samples: list,
        active: list[int],
        prepared: PerTurn,
        temperature: float,
        progress: Callable[[int, int], object] | None,
    ) -> list[dict]:
        """Run the update's optimizer steps; each one's statistics. Every turn of a step counts in the
        normalizer, skipped or not (METHOD.md: / N_tokens): a mini-batch's share of the batch's reply
        tokens and of its distillation tokens alike, so both terms keep their scale whatever the number
        of mini-batches."""
        cfg, tokenizer = self.cfg, self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        steps, n_mini = self._step_turns(samples, active)
        chunk_tokens = float(sum(len(s.action_ids) for s in samples)) / n_mini
        chunk_distill_tokens = prepared.stats.get("distill_tokens", 0) / n_mini
        self.model.train()
        tick = Ticker(progress, sum(len(micro_batch_groups(samples, c, cfg.optim.micro_batch_tokens)) for c in steps))
        step_stats = []
        for chunk in steps:
            mbs = make_micro_batches(samples, chunk, cfg.optim.micro_batch_tokens, pad, prepared)

            def loss_fn(mb: MicroBatch, logp: torch.Tensor, n_tokens: float) -> tuple[torch.Tensor, dict]:
                tick.one()  # a micro-batch's forward pass is done; its backward follows
                return objective.loss(
                    mb,
                    logp,
                    cfg,
                    num_tokens=n_tokens,
                    distill_tokens=chunk_distill_tokens,
                    logp_ref=self._reference_logprobs(mb, temperature),
                )

            step_stats.append(self.backend.step(mbs, loss_fn, chunk_tokens, temperature, entropy=cfg.entropy_coef > 0))
            tick.step(len(mbs))
        self.model.eval()
        self.updates += 1
        return step_stats

    def _recompute_for(self, samples: list, active: list[int], episodes: list[Episode], temperature: float) -> dict:
        """pi_prox of the episodes with a turn in ``active``, into those turns and their samples."""
        wanted = {samples[i].episode for i in active}
        recomputed = self.recompute_logp_old(episodes, temperature, only=wanted)
        for s in samples:
            if s.episode in wanted:
                turn = next(t for t in episodes[s.episode].turns if t.turn == s.turn)
                s.behaviour_logprobs, s.engine_logprobs = turn.behaviour_logprobs, turn.engine_logprobs
        return recomputed

    def _contributing(self, objective: ResolvedObjective, samples: list, prepared: PerTurn) -> list[int]:
        """Turns whose loss can have a gradient. Without a KL term or an entropy bonus, a turn
        with advantage 0 (a group whose rewards are all equal) and no distillation term adds
        exactly 0 to the loss and its gradient, so it is not run through the model at all. The
        entropy bonus covers every row of the batch, as the authors' does (verl dp_actor.py:
        entropy_loss over the whole response mask), so with it every turn runs."""
        if not objective.uses_behaviour_logprobs or self.cfg.kl_coef > 0 or self.cfg.entropy_coef > 0:
            return list(range(len(samples)))
        distill = prepared.distill or [False] * len(samples)
        return [i for i in range(len(samples)) if prepared.advantages[i] != 0 or distill[i]]

    # -- checkpoints -----------------------------------------------------------------------------
    def save(
        self,
        path: str | Path,
        prompt: PromptConfig | None = None,
        extra: Callable[[Path], object] | None = None,
        weights_only: bool = False,
    ) -> Path:
        """The policy as a Hugging Face directory (gathered from the ZeRO-3 partitions; with
        LoRA merged or adapter-only, ``train.lora.save``), the resume state, and the prompt
        settings it was trained on (so `serl eval` prompts it the same way). Every process
        calls it; the main one writes the model files into a staging sibling that replaces
        ``path`` only when complete. ``extra(directory)``: what every process adds to the
        staging directory once the policy's files are in it (the teacher snapshot, a record).
        ``weights_only``: only what an engine reads
        to serve the policy (``vllm.weight_sync: disk``): the model files and tokenizer, no
        resume state. A write that fails (a full disk) is one :class:`SerlError` naming
        ``path``; the previous checkpoint there is untouched and the staging folder removed."""
        from safetensors import SafetensorError

        path = Path(path)
        staging = path.with_name(f".{path.name}.partial")  # one name every process of a job agrees on
        try:
            self._write_checkpoint(staging, prompt, extra, weights_only)
            if self.is_main:
                commit_dir(staging, path)
        except (OSError, SafetensorError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not io.torch_write_failed(e):
                raise
            if self.is_main:
                shutil.rmtree(staging, ignore_errors=True)
            raise io.write_failed(path, e) from None
        self.barrier()
        return path

    def _write_checkpoint(
        self, staging: Path, prompt: PromptConfig | None, extra: Callable[[Path], object] | None, weights_only: bool
    ) -> None:
        if self.is_main:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        self.barrier()
        state, files = None, {}
        if not weights_only:
            self.backend.save_engine_state(staging)
            state = {"updates": self.updates, **self.backend.resume_state()}
            if self.reference is not None:
                state["reference"] = self.reference.state_dict()
            files = {PROMPT_FILE: prompt_file_text(prompt)} if prompt is not None else {}
        with self.full_model() as module:
            if self.is_main:
                write_policy(module, self.tokenizer, staging, self.cfg.lora if self.uses_lora else None, state, files)
        if extra is not None:  # after the weights: a record of them can hash them
            extra(staging)
        self.barrier()


def _check_annotated_advantages(
    used: torch.Tensor, annotations: list[Annotation] | None, expected: torch.Tensor, cfg: TrainConfig
) -> None:
    """Under non-default advantage settings (group_norm, invalid_action_penalty,
    success_reward) a weighted objective (serl, rlsd) must train on the advantages those
    settings define, and its annotations' weights must be signed the same way, or a turn
    would be reweighted in the wrong direction. Refuse, rather than run what the config
    does not say."""
    settings = (
        f"train.group_norm={cfg.group_norm}, invalid_action_penalty={cfg.invalid_action_penalty}, "
        f"success_reward={cfg.success_reward}"
    )
    if not torch.allclose(used, expected, rtol=0, atol=1e-6):
        raise SerlError(f"--algo {cfg.algo} does not compute its advantages with {settings} (docs/PARITY.md)")
    if annotations is None:
        return
    for a, adv in zip(annotations, expected.tolist(), strict=True):
        if a.weights is not None and a.advantage * adv < 0:
            raise SerlError(
                f"the annotations' weights were signed by advantages computed without {settings}: "
                f"they would push some turns the wrong way (docs/PARITY.md)"
            )
