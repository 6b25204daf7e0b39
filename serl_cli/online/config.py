"""The online loop's settings (``serl train --iterations``, an ablation grid's ``base``) and their checks.

Apart from the loop (:mod:`serl_cli.online.loop`) so the settings can be read, resolved and
checked -- ``serl config``, ``serl ablate``'s grids, a run file -- without the loop's machinery
(signals, engines, the learner's update).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from serl_cli import config as cfgmod
from serl_cli.algos.registry import check_group_size
from serl_cli.config import at_least, setting
from serl_cli.errors import SerlError
from serl_cli.method.annotate_config import AnnotateConfig
from serl_cli.method.annotate_config import validate as check_annotate_config
from serl_cli.rollout.engines import check_engine
from serl_cli.rollout.engines.vllm import check_config as check_vllm_config
from serl_cli.rollout.engines.vllm_gpus import check_gpus
from serl_cli.rollout.engines.vllm_requests import check_sampling
from serl_cli.rollout.prompts import check_style
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.rollout import RolloutConfig
from serl_cli.stages.rollout import validate as check_rollout_config
from serl_cli.training.train_config import TrainConfig, check_train_config


@dataclass
class OnlineEvalConfig:
    episodes: int = setting(
        0,
        "test-panel episodes evaluated after every `every` iterations; 0: none",
        limit=at_least(0, "0 (none) or more", whole=True),
    )
    every: int = setting(
        1, "evaluate after every this many iterations, and after the last", limit=at_least(1, whole=True)
    )
    split: str | None = setting(
        None, "the split to evaluate; null: the environment's evaluation split (WebShop test, ALFWorld valid_unseen)"
    )
    temperature: float = setting(
        0.0,
        "0: greedy; > 0 samples at this temperature with the run's seed (paper: 0.4, do_sample, top_p 1: "
        "recipe/serl/run_webshop.sh:106-107). ablate's final evaluation uses it too",
        limit=at_least(0, "0 (greedy) or positive"),
    )


ProducerMode = Literal["background", "inline"]


@dataclass
class ProducerConfig:
    mode: ProducerMode = setting(
        "background",
        "with max_staleness > 0, where the rollouts are made: background (a separate process with its own copy "
        "of the policy on the hf engine, generating while the trainer updates) | inline (the same rollouts in the "
        "trainer's process, one after the other: the background producer's sequential reference)",
    )
    threads: int | None = setting(
        None,
        "the background producer's CPU threads; null: train.threads (or its default). With both sides busy at "
        "once, train.threads + producer.threads at most the cores: oversubscribed torch threads run slower",
        limit=at_least(1, "at least 1 (or null)", whole=True),
    )


@dataclass
class OnlineConfig:
    env: EnvConfig = setting(factory=lambda: EnvConfig(split="train"), doc="the environment and its training split")
    model: str | None = setting(None, "the starting policy; null: the embedded default tiny model")
    iterations: int = setting(
        1, "K: the loop's rollout -> (annotate) -> update iterations", limit=at_least(1, whole=True)
    )
    rollout: RolloutConfig = setting(
        factory=RolloutConfig,
        doc="each iteration's rollouts (env, model, seed, out, device, dtype, threads: the loop sets them)",
    )
    train: TrainConfig = setting(
        factory=TrainConfig, doc="each iteration's update (model, seed, checkpoint: the loop's)"
    )
    annotate: AnnotateConfig = setting(
        factory=AnnotateConfig,
        doc="serl, rlsd, sdpo: between rollout and update (seed, update_step, device, dtype, threads: the loop's)",
    )
    eval: OnlineEvalConfig = setting(factory=OnlineEvalConfig, doc="the periodic evaluation")
    save_every: int = setting(
        1,
        "iteration k writes iter_k/checkpoint when (k + 1) % save_every == 0 (and at the end, and on a stop)",
        limit=at_least(1, whole=True),
    )
    keep_last: int = setting(
        1,
        "iteration checkpoints kept, newest first; 0: all of them",
        limit=at_least(0, "0 (keep all) or positive", whole=True),
    )
    old_rollouts: Literal["keep", "gzip", "delete"] = setting(
        "keep",
        "a finished iteration's rollouts.jsonl and annotations.jsonl once a later one is done: keep them, gzip "
        "them (*.jsonl.gz, about 6 % of the bytes on Sokoban; serl show reads them), or delete them. The "
        "loop never reads them again; the newest iteration's stay as written",
    )
    max_staleness: int = setting(
        0,
        "k: iteration j rolls out with the policy after update j - 1 - k (version max(j - k, 0)), made by the "
        "producer while the trainer updates on an earlier batch; a fixed lag, so a run stays deterministic and "
        "resumable. 0: the synchronous loop (rollout, then update). train.offpolicy says how stale rollouts are "
        "corrected (auto: token TIS)",
        limit=at_least(0, "a whole number of updates, 0 (synchronous) or more", whole=True),
    )
    producer: ProducerConfig = setting(factory=ProducerConfig, doc="the rollout producer of max_staleness > 0")
    seed: int = setting(0, "the run's seed: iteration k's rollouts use seed * 1000 + k, the update seed")
    out: str = setting("runs/online", "the run directory")


def derive_total_steps(cfg: OnlineConfig) -> None:
    """A decaying lr schedule without ``train.optim.total_steps`` decays over the run, as TRL derives
    its max steps: iterations x epochs x mini_batches optimizer steps (an update with no gradient
    takes none, so the lr then ends above 0). Written into ``cfg``, so the run's settings keep the
    number: a resume that runs longer keeps the schedule the run started with. With
    ``mini_batch_turns`` the steps per update depend on the turns, and the number is left to set."""
    optim = cfg.train.optim
    if optim.schedule != "constant" and optim.total_steps == 0 and cfg.train.mini_batch_turns <= 0:
        optim.total_steps = cfg.iterations * cfg.train.epochs * cfg.train.mini_batches


def check_online_config(cfg: OnlineConfig) -> None:
    """Everything about the loop's own settings that can be wrong, before any model loads."""
    derive_total_steps(cfg)
    cfgmod.check_limits(cfg)  # every section's declared limits (setting(..., limit=...))
    if cfg.rollout.engine == "vllm":  # before vLLM starts (a minute)
        check_sampling(cfg.rollout.sampling)
        check_vllm_config(cfg.rollout.vllm)
        check_gpus(cfg.rollout.vllm, cfg.rollout.gpus)
        if cfg.rollout.vllm.data_parallel and cfg.rollout.gpus:
            raise SerlError(
                f"rollout.gpus ({cfg.rollout.gpus}) gives vLLM GPUs of its own, and rollout.vllm.data_parallel runs "
                f"an engine on the trainer processes' GPUs: choose one (unset rollout.gpus, or data_parallel=false)"
            )
        if cfg.train.lora.rank > 0 and cfg.train.lora.save != "merged" and cfg.rollout.vllm.weight_sync == "disk":
            # vLLM reloads the policy from each saved checkpoint: it needs the full (merged) weights
            raise SerlError(
                "--engine vllm with vllm.weight_sync=disk needs train.lora.save=merged: it reloads the "
                "policy's full weights from each saved checkpoint"
            )
    check_staleness(cfg)
    check_style(cfg.rollout.prompt)
    check_engine(cfg.rollout.engine)  # an unknown engine or a missing extra, before any model loads
    check_train_config(cfg.train)  # the same for the backend, its DeepSpeed config, LoRA, device, dtype
    check_rollout_config(cfg.rollout)  # the rollouts' and the annotation's numbers, before the model loads
    check_annotate_config(cfg.annotate)
    check_teacher_partitions(cfg)
    check_group_size(cfg.train.algo, cfg.rollout.group_size)  # last: a setting's own error says more


def check_teacher_partitions(cfg: OnlineConfig) -> None:
    """ZeRO++'s hierarchical partitioning (``zero_hpz_partition_size`` > 1) with a teacher is refused:
    the teacher swaps its weights into each rank's primary partitions, while DeepSpeed gathers from
    its secondary, node-local copy whenever one exists and drops that copy only at its optimizer
    step (DeepSpeed 0.19.8's ``partition_parameters``, ``_post_step``) -- so the teacher would score
    with the policy's weights, silently, and every SERL weight would be about 1."""
    from serl_cli.algos.objectives import get_objective
    from serl_cli.training.deepspeed_config import resolve_config

    if cfg.train.backend != "deepspeed" or not get_objective(cfg.train.algo).needs_annotations:
        return
    zero = resolve_config(cfg.train.deepspeed, cfg.train.optim, bf16_available=False, dtype=cfg.train.dtype)
    hpz = zero["zero_optimization"].get("zero_hpz_partition_size", 1)
    if isinstance(hpz, int) and hpz > 1:
        raise SerlError(
            f"zero_optimization.zero_hpz_partition_size is {hpz} in {cfg.train.deepspeed.config}: {cfg.train.algo}'s "
            "teacher swaps its weights into ZeRO-3's primary partitions, which DeepSpeed's hpZ copy does not see, so "
            "it would score with the policy's weights; leave it at 1 for a run with a teacher (docs/SCALING.md)"
        )


def check_staleness(cfg: OnlineConfig) -> None:
    """What an asynchronous loop (``max_staleness > 0``) cannot run, in one line each."""
    cfgmod.check_limits(cfg.producer, "producer.")
    k = cfg.max_staleness
    if not at_least(0, whole=True).ok(k):
        raise SerlError(f"max_staleness must be a whole number of updates, 0 (synchronous) or more, got {k}")
    if k == 0:
        return
    if k >= cfg.iterations:
        raise SerlError(
            f"max_staleness {k} must be less than the run's {cfg.iterations} iteration(s): at {cfg.iterations} or "
            "more every rollout would use the starting policy"
        )
    if cfg.train.lora.rank > 0:
        raise SerlError("max_staleness > 0 with LoRA: the producer loads whole policy versions; train without LoRA")
    if cfg.train.recompute_logp_old is False:
        raise SerlError(
            "max_staleness > 0 needs train.recompute_logp_old (null or true): stale rollouts are corrected by "
            "the trainer's own log-probs (pi_prox) against the producer's (pi_behav)"
        )
