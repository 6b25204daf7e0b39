"""``TrainConfig``, the ``train`` settings of every run (with its ``optim`` and ``lora`` sections),
and the checks made of them before any model loads.

Apart from the :class:`~serl_cli.training.learner.Learner` that carries them out, and free of
torch: the online loop's configuration (``online.config``) and ``serl train``'s one-line
errors need the settings and their checks, not the update.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal, get_args

from serl_cli import config as cfgmod
from serl_cli.algos.offpolicy import resolve_correction
from serl_cli.algos.registry import OBJECTIVES, GigpoAnchor, GigpoMode, GroupNorm, objective
from serl_cli.config import Limit, above, at_least, setting, within
from serl_cli.errors import SerlError
from serl_cli.models.choices import Attention, Device, Dtype, check_names
from serl_cli.training.deepspeed_config import DeepSpeedConfig

Backend = Literal["torch", "deepspeed"]  # training.backends.BACKENDS


@dataclass(frozen=True)
class BackendTraits:
    """What a training backend is, as the memory plan and the checks need to know it without loading it
    (the code is ``training.backends``): a name is looked up once, here, never compared elsewhere."""

    data_parallel: bool  # several processes train one update (launched by torchrun / the deepspeed launcher)
    zero: bool  # ZeRO stages apply: 1-2 partition the optimizer (flat copies), 3 the weights too
    own_checkpoint: bool  # keeps its own resume files (optimizer partitions) beside the Hugging Face weights
    half_module: bool  # under bf16/fp16 the module's weights are held in 16 bits (torch: fp32 under autocast)
    offloads: bool  # can hold optimizer states (stage 3: parameters) in CPU memory


BACKEND_TRAITS = {
    "torch": BackendTraits(data_parallel=False, zero=False, own_checkpoint=False, half_module=False, offloads=False),
    "deepspeed": BackendTraits(data_parallel=True, zero=True, own_checkpoint=True, half_module=True, offloads=True),
}


def backend_traits(name: str) -> BackendTraits:
    if name not in BACKEND_TRAITS:
        raise SerlError(f"unknown backend {name!r}: choose one of {', '.join(BACKEND_TRAITS)}")
    return BACKEND_TRAITS[name]


BACKENDS = get_args(Backend)
LoraSave = Literal["merged", "adapter"]
SAVE_MODES = get_args(LoraSave)
Schedule = Literal["constant", "linear", "cosine"]  # training.step.lr_factor
Correction = Literal["auto", "none", "tis", "mis"]  # algos.core.offpolicy_weights, after resolve_correction
CorrectionLevel = Literal["token", "turn", "episode"]


@dataclass
class OptimConfig:
    lr: float = setting(
        1e-6,
        "the learning rate: the paper's setting for 7B models; tiny-model configs raise it",
        limit=at_least(0, "a positive number (or 0)"),
    )
    weight_decay: float = setting(0.0, "AdamW's decoupled weight decay", limit=at_least(0, "0 or positive"))
    betas: tuple = setting((0.9, 0.999), "AdamW's betas")
    grad_clip: float = setting(1.0, "the gradient's norm is clipped to this", limit=at_least(0, "0 or positive"))
    micro_batch_tokens: int = setting(
        16384, "padded tokens per forward pass: bounds memory", limit=at_least(1, whole=True)
    )
    schedule: Schedule = setting(
        "constant",
        "the lr after warmup, by applied optimizer step (transformers' get_*_schedule_with_warmup): constant | "
        "linear (down to 0 at total_steps) | cosine (half a cosine down to 0 at total_steps)",
    )
    warmup_steps: int = setting(
        0,
        "optimizer steps over which the lr rises linearly from 0 to lr (0: none; step s runs at lr * s / warmup)",
        limit=at_least(0, "a whole number of optimizer steps (0 or more)", whole=True),
    )
    total_steps: int = setting(
        0,
        "linear, cosine: the optimizer step where the lr reaches 0 and stays; 0 in the online loop: iterations x "
        "epochs x mini_batches, written into the run's settings (set it with mini_batch_turns); 0 with constant",
        limit=at_least(0, "a whole number of optimizer steps (0 or more)", whole=True),
    )


@dataclass
class LoraConfig:
    rank: int = setting(
        0,
        "0: full fine-tuning; > 0: train LoRA adapters of this rank only",
        limit=at_least(0, "0 (off) or positive", whole=True),
    )
    alpha: float = setting(16.0, "LoRA scale numerator: the update is scaled by alpha / rank")
    targets: str = setting(
        "all-linear", "target modules, comma-separated (q_proj,v_proj,...), or all-linear (not lm_head)"
    )
    dropout: float = setting(0.0, "dropout on the adapters' input", limit=within(0, 1, open_high=True))
    save: LoraSave = setting("merged", "checkpoints: merged (a plain HF model) | adapter (the adapter alone)")


@dataclass
class OffPolicyConfig:
    correction: Correction = setting(
        "auto",
        "weight each token's policy-gradient term by pi_prox / pi_behav (the trainer's recomputed pi_old over the "
        "rollout engine's log-prob), detached: none | tis (truncated: min(ratio, tis_cap)) | mis (masked: the ratio "
        "inside [mis_low, mis_high], else 0; masked tokens stay in the token count) | auto (none while rollouts are "
        "on-policy, max_staleness 0; token tis once stale, max_staleness > 0). tis, mis need the "
        "recompute: train.recompute_logp_old null turns it on, false is refused",
    )
    level: CorrectionLevel = setting(
        "token",
        "what one ratio covers: token | turn (the product of the turn's token ratios, exp of their summed "
        "log-ratio) | episode (the product over all its turns' tokens)",
    )
    tis_cap: float = setting(
        2.0,
        "tis: the weight's upper bound (verl's token TIS: 2.0; SkyRL's sequence level: 5.0)",
        limit=at_least(1, "a number of at least 1"),
    )
    mis_low: float = setting(0.5, "mis: ratios below this are masked out (icepop: 0.5)")
    mis_high: float = setting(2.0, "mis: ratios above this are masked out (icepop: 2.0)")


@dataclass
class TrainConfig:
    algo: str = setting("grpo", f"the algorithm (algos.registry): {' | '.join(sorted(OBJECTIVES))}")
    model: str | None = setting(None, "the policy to update; null: the model that produced the rollouts")
    backend: Backend = setting("torch", "training backend: torch | deepspeed (training.backends)")
    device: Device = setting(
        "auto",
        "where the update runs (models.device): auto (CUDA when present) | cpu | cuda. The online loop's "
        "rollouts, teacher and periodic evaluation run on the trainer's model: here too",
    )
    dtype: Dtype = setting(
        "auto",
        "compute precision: auto (bf16 on a GPU with it, else fp32) | fp32 | bf16 | fp16. Half precision is "
        "autocast over fp32 master weights (DeepSpeed: its bf16/fp16)",
    )
    attn_implementation: Attention = setting(
        "auto", "auto (flash_attention_2 when installed, on CUDA, in bf16/fp16; else sdpa) | sdpa | eager"
    )
    gradient_checkpointing: bool = setting(False, "recompute activations in backward: less memory, ~30 % more compute")
    gpus: list[int] | None = setting(
        None,
        "CUDA devices of the trainer's processes, one each (LOCAL_RANK r takes gpus[r]); null: LOCAL_RANK's. "
        "With rollout.gpus: vLLM on its own GPUs",
    )
    deepspeed: DeepSpeedConfig = setting(factory=DeepSpeedConfig, doc="with backend deepspeed")
    dist_timeout_s: int = setting(
        7200,
        "seconds a collective waits for the other processes before the job fails (NCCL's default is 10 "
        "minutes; a rank's share of an iteration's rollouts, or rank 0 writing a 7B checkpoint, can take longer)",
        limit=above(0, "positive (seconds)"),
    )
    lora: LoraConfig = setting(factory=LoraConfig, doc="rank > 0: train LoRA adapters only")
    optim: OptimConfig = setting(factory=OptimConfig, doc="the optimizer (AdamW)")
    epochs: int = setting(1, "passes over the batch per update", limit=at_least(1, whole=True))
    mini_batches: int = setting(1, "optimizer steps per pass", limit=at_least(1, whole=True))
    mini_batch_turns: int = setting(
        0,
        "> 0: optimizer steps per pass = ceil(turns / mini_batch_turns) instead of mini_batches, the authors' "
        "ppo_mini_batch_size in step-rows (paper: 64 WebShop, 256 ALFWorld; recipe/serl/run_webshop.sh:81)",
        limit=at_least(0, "0 or positive", whole=True),
    )
    clip_eps: float = setting(0.2, "PPO's clip range", limit=above(0, "a positive number"))
    dual_clip: float = setting(
        0.0,
        "dual-clip PPO's c (> 1): the loss of a token with w*A < 0 is capped at -c*w*A. 0 = off (paper: 3.0, "
        "verl's clip_ratio_c, always on there: core_algos.py:583-587)",
        limit=Limit(lambda x: at_least(0).ok(x) and (x == 0 or x > 1), "0 (off) or above 1"),
    )
    entropy_coef: float = setting(
        0.0,
        "entropy bonus, token-mean over reply tokens (paper: 0.001, ppo_trainer.yaml:57)",
        limit=at_least(0, "0 or positive"),
    )
    kl_coef: float = setting(0.0, "k3 KL to the frozen starting policy", limit=at_least(0, "0 or positive"))
    distill_coef: float = setting(
        0.0,
        "KL(pi || teacher) on selected turns of failed rollouts (off in serl; sdpo: 1 unless set)",
        limit=at_least(0, "0 or positive"),
    )
    omega: float = setting(1.0, "gigpo: weight of the step advantage", limit=at_least(0, "0 or positive"))
    gamma: float = setting(0.95, "gigpo: discount of the per-turn return", limit=within(0, 1, "a discount in [0, 1]"))
    gigpo_mode: GigpoMode = setting(
        "mean_std_norm", "gigpo: mean_std_norm (divide by std) | mean_norm (mean only; verl-agent's default)"
    )
    gigpo_anchor: GigpoAnchor = setting(
        "state",
        "gigpo: what makes turns one anchor state: state (the environment's state_key; ALFWorld: its facts) | "
        'observation (the raw observation text, the authors\' key: every "Nothing happens." pooled)',
    )
    adv_eps: float = setting(1e-6, "added to a group's std before dividing by it", limit=above(0, "a positive number"))
    group_norm: GroupNorm = setting(
        "episode",
        "how a group's statistics pool: episode (one score per episode, serl's) | cross_steps (every turn a "
        "sample, the authors' compute_mean_std_cross_steps=True, core_algos.py:114-175)",
    )
    invalid_action_penalty: float = setting(
        0.0,
        "subtracted from a turn's score when the environment flagged its action (feedback.error), before the "
        "advantage (paper: 0.1, ray_trainer.py:198-222); under group_norm episode: per invalid turn of the episode",
        limit=at_least(0, "0 or positive"),
    )
    success_reward: float = setting(
        0.0,
        "> 0: an episode's training reward is this on a success and 0 otherwise, in place of the environment's "
        "reward (paper: 10.0, env_package/webshop/envs.py:47-53); 0 = the environment's reward",
        limit=at_least(0, "0 or positive"),
    )
    recompute_logp_old: bool | None = setting(
        None,
        "recompute the behaviour log-probs (pi_old) with the trainer's model before the update: null = when the "
        "rollouts came from an engine other than hf (vLLM's numerics differ from the trainer's) or from hf in "
        "half precision (a KV-cached bf16 decode rounds otherwise than the trainer's forward), true, false",
    )
    offpolicy: OffPolicyConfig = setting(
        factory=OffPolicyConfig,
        doc="off-policy correction of the rollout engine's log-probs against the trainer's (docs/ALGORITHMS.md)",
    )
    sft_successful_only: bool = setting(False, "sft: clone successful episodes only (filtered behaviour cloning)")
    seed: int = setting(0, "the update's seed (the online loop: the run's seed)")
    threads: int | None = setting(
        None,
        "torch threads; null: all cores (the online loop: every stage's)",
        limit=at_least(1, "at least 1 (or unset: every core)", whole=True),
    )
    checkpoint: str | None = setting(None, "where the updated policy goes; null: RUN/checkpoint")
    hindsight_sft: str | None = setting(
        None, 'sft: also teacher prompts built by these feedback sources, e.g. "ref|error" (method.sft.hindsight)'
    )


def check_train_config(cfg: TrainConfig) -> None:
    """Everything about ``cfg`` that can be wrong, checked before any model loads or any
    file is written (and without importing torch): the algorithm, the words of its settings,
    the backend and its config, LoRA, the extras they need."""
    objective(cfg.algo)
    check_names(cfg.device, cfg.dtype, cfg.attn_implementation)
    cfgmod.check_choices(cfg, "train")
    _check_loss_settings(cfg)
    check_lora(cfg.lora)
    if cfg.device == "cuda" or cfg.gpus:  # --device cuda without a GPU, a missing GPU: one line, before anything loads
        from serl_cli.models.device import resolve_device

        resolve_device(cfg.device, cfg.gpus)
    if cfg.backend == "deepspeed":
        from serl_cli.training.deepspeed_config import check_config

        check_config(cfg)


def check_lora(cfg: LoraConfig) -> None:
    cfgmod.check_limits(cfg, "train.lora.")
    if cfg.rank > 0 and not cfg.targets.strip():
        raise SerlError("train.lora.targets is empty: name the modules to adapt, or all-linear")
    if cfg.rank > 0 and importlib.util.find_spec("peft") is None:
        raise SerlError("LoRA (--lora-rank > 0) needs peft: pip install 'serl[lora]'")


def _check_loss_settings(cfg: TrainConfig) -> None:
    """The numbers of the update: each one a value it can take (NaN and infinity never), as their
    settings declare (``limit``), and the bounds that tie two settings together."""
    cfgmod.check_limits(cfg, "train.")
    _check_schedule(cfg.optim)
    _check_offpolicy(cfg)


def _check_offpolicy(cfg: TrainConfig) -> None:
    """The correction's bounds, and what it needs: the trainer's pi_prox (the recompute) and
    behaviour log-probs at all (not sft). ``auto`` is checked where it resolves to a correction."""
    op = cfg.offpolicy
    if not (at_least(0).ok(op.mis_low) and at_least(0).ok(op.mis_high) and 0 <= op.mis_low <= 1 <= op.mis_high):
        raise SerlError(
            f"train.offpolicy.mis_low and mis_high must bracket 1 (0 <= low <= 1 <= high), got "
            f"[{op.mis_low}, {op.mis_high}]"
        )
    if op.correction not in ("tis", "mis"):
        return
    if cfg.recompute_logp_old is False:
        raise SerlError(
            f"train.offpolicy.correction {op.correction} weighs by the trainer's recomputed pi_old: "
            "set train.recompute_logp_old to null or true"
        )
    if not objective(cfg.algo).uses_behaviour_logprobs:
        raise SerlError(
            f"train.offpolicy.correction {op.correction} needs behaviour log-probs: --algo {cfg.algo} has none"
        )


def _check_schedule(optim: OptimConfig) -> None:
    betas = list(optim.betas) if isinstance(optim.betas, (list, tuple)) else None
    if betas is None or len(betas) != 2 or not all(within(0, 1, open_high=True).ok(b) for b in betas):
        raise SerlError(f"train.optim.betas must be two numbers in [0, 1), got {optim.betas}")
    if optim.schedule == "constant":
        return
    if optim.total_steps <= optim.warmup_steps:
        raise SerlError(
            f"train.optim.schedule {optim.schedule} decays until train.optim.total_steps, which must be above "
            f"train.optim.warmup_steps ({optim.warmup_steps}), got {optim.total_steps}: set it to the run's "
            "optimizer steps (the online loop derives iterations x epochs x mini_batches where mini_batch_turns is 0)"
        )


def scheduled(optim: OptimConfig) -> bool:
    """Whether the lr changes over the run: without, no scheduler exists at all (a default run
    is exactly what it was before schedules existed, its trainer_state.pt included)."""
    return optim.schedule != "constant" or optim.warmup_steps > 0


def recompute_enabled(
    cfg: TrainConfig, engine: str | None, rollout_half: bool | None = None, staleness: int = 0
) -> bool:
    """Whether pi_old is recomputed by the trainer: the setting, or (null) whenever the rollouts'
    log-probs are not the trainer's numerics -- from an engine other than hf, or from hf in half
    precision (a KV-cached bf16 decode and the trainer's full forward round differently).
    ``rollout_half``: whether the rollouts ran in half precision; None: they ran with the
    trainer's own model in its precision (the online loop's hf engine). ``engine`` None: the
    log-probs' source is unknown, and they stand. An off-policy correction (tis, mis) turns
    the null setting on: its weight is the trainer's log-prob over the engine's; so do stale
    rollouts (``staleness`` > 0, an asynchronous loop's): PPO's ratio is then taken against the
    trainer's current policy (pi_prox), not the stale one that sampled."""
    if cfg.recompute_logp_old is not None:
        return bool(cfg.recompute_logp_old)
    if staleness > 0 or resolve_correction(cfg.offpolicy, staleness)[0] != "none":  # pi_prox is the recompute
        return True
    if engine is None:
        return False
    if engine != "hf":
        return True
    return trains_in_half(cfg) if rollout_half is None else rollout_half


def trains_in_half(cfg: TrainConfig) -> bool:
    """Whether the trainer computes in bf16/fp16 (``train.dtype``, and under DeepSpeed its config's
    ``bf16``/``fp16`` sections), resolved on this machine."""
    import torch

    from serl_cli.models.device import resolve

    precision = resolve(cfg.device, cfg.dtype, cfg.attn_implementation, cfg.gpus)
    if cfg.backend != "deepspeed":
        return precision.half
    from serl_cli.training.deepspeed_config import resolve_config, uses_bf16, uses_fp16

    ds = resolve_config(cfg.deepspeed, cfg.optim, bf16_available=precision.dtype == torch.bfloat16, dtype=cfg.dtype)
    return uses_bf16(ds) or uses_fp16(ds)
