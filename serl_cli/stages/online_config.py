"""The online loop's settings (``serl train --iterations``, an ablation grid's ``base``) and their checks.

Apart from the loop (:mod:`serl_cli.stages.online`) so the settings can be read, resolved and
checked -- ``serl config``, ``serl ablate``'s grids, a run file -- without the loop's machinery
(signals, engines, the learner's update).
"""

from __future__ import annotations

from dataclasses import dataclass

from serl_cli.config import setting
from serl_cli.errors import SerlError
from serl_cli.method.annotate_config import AnnotateConfig
from serl_cli.method.annotate_config import validate as check_annotate_config
from serl_cli.rollout.engines import check_engine
from serl_cli.rollout.engines.vllm import check_config as check_vllm_config
from serl_cli.rollout.engines.vllm import check_gpus, check_sampling
from serl_cli.rollout.prompts import check_style
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.rollout import RolloutConfig
from serl_cli.stages.rollout import validate as check_rollout_config
from serl_cli.training.train_config import TrainConfig, check_train_config


@dataclass
class OnlineEvalConfig:
    episodes: int = setting(0, "test-panel episodes evaluated after every `every` iterations; 0: none")
    every: int = setting(1, "evaluate after every this many iterations")
    split: str | None = setting(
        None, "the split to evaluate; null: the environment's evaluation split (WebShop test, ALFWorld valid_unseen)"
    )
    temperature: float = setting(
        0.0,
        "0: greedy; > 0 samples at this temperature with the run's seed (paper: 0.4, do_sample, top_p 1: "
        "recipe/serl/run_webshop.sh:106-107). ablate's final evaluation uses it too",
    )


@dataclass
class OnlineConfig:
    env: EnvConfig = setting(factory=lambda: EnvConfig(split="train"), doc="the environment and its training split")
    model: str | None = setting(None, "the starting policy; null: the embedded default tiny model")
    iterations: int = setting(1, "K: the loop's rollout -> (annotate) -> update iterations")
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
        1, "iteration k writes iter_k/checkpoint when (k + 1) % save_every == 0 (and at the end, and on a stop)"
    )
    keep_last: int = setting(1, "iteration checkpoints kept, newest first; 0: all of them")
    seed: int = setting(0, "the run's seed: iteration k's rollouts use seed * 1000 + k, the update seed")
    out: str = setting("runs/online", "the run directory")


def check_online_config(cfg: OnlineConfig) -> None:
    """Everything about the loop's own settings that can be wrong, before any model loads."""
    if cfg.iterations < 1:
        raise SerlError(f"--iterations must be at least 1, got {cfg.iterations}")
    if cfg.save_every < 1:
        raise SerlError(f"save_every must be at least 1, got {cfg.save_every}")
    if cfg.keep_last < 0:
        raise SerlError(f"keep_last must be 0 (keep all) or positive, got {cfg.keep_last}")
    if cfg.eval.every < 1:
        raise SerlError(f"eval.every must be at least 1, got {cfg.eval.every}")
    if cfg.eval.episodes < 0:
        raise SerlError(f"eval.episodes must be 0 (none) or more, got {cfg.eval.episodes}")
    if cfg.eval.temperature < 0:
        raise SerlError(f"eval.temperature must be 0 (greedy) or positive, got {cfg.eval.temperature}")
    if cfg.rollout.engine == "vllm":  # before vLLM starts (a minute)
        check_sampling(cfg.rollout.sampling)
        check_vllm_config(cfg.rollout.vllm)
        check_gpus(cfg.rollout.vllm, cfg.rollout.gpus)
        if cfg.train.lora.rank > 0 and cfg.train.lora.save != "merged" and cfg.rollout.vllm.weight_sync == "disk":
            # vLLM reloads the policy from each saved checkpoint: it needs the full (merged) weights
            raise SerlError(
                "--engine vllm with vllm.weight_sync=disk needs train.lora.save=merged: it reloads the "
                "policy's full weights from each saved checkpoint"
            )
    check_style(cfg.rollout.prompt)
    check_engine(cfg.rollout.engine)  # an unknown engine or a missing extra, before any model loads
    check_train_config(cfg.train)  # the same for the backend, its DeepSpeed config, LoRA, device, dtype
    check_rollout_config(cfg.rollout)  # the rollouts' and the annotation's numbers, before the model loads
    check_annotate_config(cfg.annotate)
