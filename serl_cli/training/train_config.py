"""``TrainConfig``, the ``train`` settings of every run, and the checks made of them before any model loads.

Apart from the :class:`~serl_cli.training.learner.Learner` that carries them out: the online
loop's configuration (``stages.online_config``) and ``serl train``'s one-line errors need the
settings and their checks, not the update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from serl_cli.algos.objectives import GIGPO_MODES, GROUP_NORMS, get_objective
from serl_cli.errors import SerlError
from serl_cli.models.loading import require_peft
from serl_cli.training import lora as lora_mod
from serl_cli.training.backends import BACKENDS as BACKEND_REGISTRY
from serl_cli.training.deepspeed_config import DeepSpeedConfig
from serl_cli.training.lora import LoraConfig
from serl_cli.training.step import OptimConfig

BACKENDS = tuple(BACKEND_REGISTRY)


@dataclass
class TrainConfig:
    algo: str = "grpo"
    model: str | None = None  # the policy to update; default: the model that produced the rollouts
    backend: str = "torch"  # torch | deepspeed (serl_cli.training.backends)
    # where and in which precision (serl_cli.models.device): auto = CUDA when present; auto = bf16 on a GPU
    # with it, fp32 elsewhere. Half precision is autocast over fp32 master weights (DeepSpeed: its bf16/fp16)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | fp32 | bf16 | fp16
    attn_implementation: str = (
        "auto"  # auto (flash_attention_2 when installed, on CUDA, in bf16/fp16; else sdpa) | sdpa | eager
    )
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~30 % more compute
    gpus: list[int] | None = None  # CUDA devices of the trainer's processes, one each (LOCAL_RANK r takes gpus[r]);
    # None: LOCAL_RANK's. With rollout.gpus: vLLM on its own GPUs
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # with backend deepspeed
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank > 0: train LoRA adapters only
    optim: OptimConfig = field(default_factory=OptimConfig)
    epochs: int = 1  # passes over the batch per update
    mini_batches: int = 1  # optimizer steps per pass
    # > 0: optimizer steps per pass = ceil(turns / mini_batch_turns) instead of mini_batches, the authors'
    # ppo_mini_batch_size in step-rows (paper: 64 WebShop, 256 ALFWorld; recipe/serl/run_webshop.sh:81)
    mini_batch_turns: int = 0
    clip_eps: float = 0.2
    # dual-clip PPO's c (> 1): the loss of a token with w*A < 0 is capped at -c*w*A. 0 = off
    # (paper: 3.0, verl's clip_ratio_c, always on there: core_algos.py:583-587)
    dual_clip: float = 0.0
    entropy_coef: float = 0.0  # entropy bonus, token-mean over reply tokens (paper: 0.001, ppo_trainer.yaml:57)
    kl_coef: float = 0.0  # k3 KL to the frozen starting policy
    distill_coef: float = 0.0  # KL(pi || teacher) on selected turns of failed rollouts (off in serl, on in sdpo)
    omega: float = 1.0  # gigpo: weight of the step advantage
    gamma: float = 0.95  # gigpo: discount of the per-turn return
    gigpo_mode: str = (
        "mean_std_norm"  # gigpo: mean_std_norm (divide by std) | mean_norm (mean only; verl-agent's default)
    )
    adv_eps: float = 1e-6
    # how a group's statistics pool: episode (one score per episode, serl's) | cross_steps (every turn a
    # sample, the authors' compute_mean_std_cross_steps=True, core_algos.py:114-175)
    group_norm: str = "episode"
    # subtracted from a turn's score when the environment flagged its action (feedback.error), before the
    # advantage (paper: 0.1, ray_trainer.py:198-222); under group_norm episode: per invalid turn of the episode
    invalid_action_penalty: float = 0.0
    # > 0: an episode's training reward is this on a success and 0 otherwise, in place of the environment's
    # reward (paper: 10.0, env_package/webshop/envs.py:47-53); 0 = the environment's reward
    success_reward: float = 0.0
    # recompute the behaviour log-probs (pi_old) with the trainer's model before the update: null = when the
    # rollouts came from an engine other than hf (vLLM's numerics differ from the trainer's), true, false
    recompute_logp_old: bool | None = None
    sft_successful_only: bool = False  # sft: clone successful episodes only (filtered behaviour cloning)
    seed: int = 0
    threads: int | None = None
    checkpoint: str | None = None  # default RUN/checkpoint
    hindsight_sft: str | None = (
        None  # sft: also teacher prompts built by these feedback sources, e.g. "ref|error" (method.hindsight_sft)
    )


def check_train_config(cfg: TrainConfig) -> None:
    """Everything about ``cfg`` that can be wrong, checked before any model loads or any
    file is written: the algorithm, the backend and its config, LoRA, the extras they need."""
    from serl_cli.models.device import check_names, resolve_device

    get_objective(cfg.algo)
    _check_loss_settings(cfg)
    check_names(cfg.device, cfg.dtype, cfg.attn_implementation)
    resolve_device(cfg.device, cfg.gpus)  # --device cuda without a GPU: one line, before anything loads
    lora_mod.validate(cfg.lora)
    if cfg.backend not in BACKENDS:
        raise SerlError(f"unknown backend {cfg.backend!r}: choose one of {', '.join(BACKENDS)}")
    if cfg.backend == "deepspeed":
        from serl_cli.training.deepspeed_config import check_config

        check_config(cfg)
    if lora_mod.enabled(cfg.lora):
        require_peft()


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_loss_settings(cfg: TrainConfig) -> None:
    """The numbers of the update: each one a value it can take (NaN and infinity never)."""
    for name in ("clip_eps", "adv_eps"):
        if not (_number(getattr(cfg, name)) and getattr(cfg, name) > 0):
            raise SerlError(f"train.{name} must be a positive number, got {getattr(cfg, name)}")
    if not (_number(cfg.dual_clip) and (cfg.dual_clip == 0 or cfg.dual_clip > 1)):
        raise SerlError(f"train.dual_clip must be 0 (off) or above 1, got {cfg.dual_clip}")
    zero_or_more = ("entropy_coef", "kl_coef", "distill_coef", "omega", "invalid_action_penalty", "success_reward")
    for name in (*zero_or_more, "mini_batch_turns"):
        if not (_number(getattr(cfg, name)) and getattr(cfg, name) >= 0):
            raise SerlError(f"train.{name} must be 0 or positive, got {getattr(cfg, name)}")
    if not (_number(cfg.gamma) and 0 <= cfg.gamma <= 1):
        raise SerlError(f"train.gamma is a discount: it must be in [0, 1], got {cfg.gamma}")
    for name in ("epochs", "mini_batches"):
        if getattr(cfg, name) < 1:
            raise SerlError(f"train.{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.threads is not None and cfg.threads < 1:
        raise SerlError(f"train.threads must be at least 1 (or unset: every core), got {cfg.threads}")
    if cfg.group_norm not in GROUP_NORMS:
        raise SerlError(f"unknown train.group_norm {cfg.group_norm!r}: choose one of {', '.join(GROUP_NORMS)}")
    if cfg.gigpo_mode not in GIGPO_MODES:
        raise SerlError(f"unknown train.gigpo_mode {cfg.gigpo_mode!r}: choose one of {', '.join(GIGPO_MODES)}")
    _check_optim(cfg.optim)


def _check_optim(optim: OptimConfig) -> None:
    """AdamW's settings, refused here in one line rather than by torch in a traceback."""
    if not (_number(optim.lr) and optim.lr >= 0):  # 0: an update that measures and changes nothing
        raise SerlError(f"train.optim.lr must be a positive number (or 0), got {optim.lr}")
    for name in ("weight_decay", "grad_clip"):  # grad_clip 0: no clipping
        if not (_number(getattr(optim, name)) and getattr(optim, name) >= 0):
            raise SerlError(f"train.optim.{name} must be 0 or positive, got {getattr(optim, name)}")
    betas = list(optim.betas) if isinstance(optim.betas, (list, tuple)) else None
    if betas is None or len(betas) != 2 or not all(_number(b) and 0 <= b < 1 for b in betas):
        raise SerlError(f"train.optim.betas must be two numbers in [0, 1), got {optim.betas}")
    if optim.micro_batch_tokens < 1:
        raise SerlError(f"train.optim.micro_batch_tokens must be at least 1, got {optim.micro_batch_tokens}")


def recompute_enabled(cfg: TrainConfig, engine: str | None) -> bool:
    """Whether pi_old is recomputed by the trainer: the setting, or (null) when the rollouts
    came from an engine other than hf, whose log-probs are not the trainer's numerics."""
    if cfg.recompute_logp_old is not None:
        return bool(cfg.recompute_logp_old)
    return engine not in (None, "hf")
