"""What each ``--algo`` optimizes: the math the registry (``algos.registry``) names, joining the
pure functions in ``algos/`` to the learner (``training.learner``).

An objective first *prepares* a batch (advantages per turn, per-token weights, teacher
log-probs: everything fixed before the first gradient step) and then gives the loss of a
micro-batch from the current policy's token log-probs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from serl_cli.algos import core, gigpo, sdpo
from serl_cli.algos.batch import MicroBatch, PerTurn
from serl_cli.algos.registry import GIGPO_ANCHORS, GIGPO_MODES, GROUP_NORMS, Objective, check_annotations, objective
from serl_cli.artifacts.records import Annotation, Episode
from serl_cli.artifacts.schema import TurnSample
from serl_cli.errors import SerlError


@dataclass
class UpdateInputs:
    """What an update learns from besides its turns."""

    episodes: list[Episode]
    annotations: list[Annotation] | None = None  # one record per turn (serl annotate), for serl/rlsd/sdpo
    annotate_config: dict | None = None  # the annotation's resolved settings
    annotate_stats: dict | None = None  # the annotation pass's statistics (lambda, teacher work)


# prepare(turns, inputs, train config) -> PerTurn
Prepare = Callable[[list[TurnSample], UpdateInputs, object], PerTurn]
# loss(micro-batch, policy log-probs [B, K], train config, num_tokens=, distill_tokens=, logp_ref=) -> (loss, stats)
Loss = Callable[..., tuple[torch.Tensor, dict]]


@dataclass(frozen=True)
class ResolvedObjective(Objective):
    """A registry entry whose math, named there, is this module's functions."""

    prepare: Prepare
    loss: Loss


def get_objective(name: str) -> ResolvedObjective:
    """The registry's entry for ``--algo name``, its math resolved to this module's functions."""
    entry = objective(name)
    prepare, loss = (MATH[f] if isinstance(f, str) else f for f in (entry.prepare, entry.loss))
    settings = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
    return ResolvedObjective(**{**settings, "prepare": prepare, "loss": loss})


def _score(s: TurnSample, success_reward: float) -> float:
    """The task reward a turn's episode is scored with: the environment's, or (the authors'
    recipe, ``train.success_reward`` > 0) ``success_reward`` on a success and 0 otherwise
    (agent_system/environments/env_package/webshop/envs.py:47-53: 10 for a win)."""
    return (success_reward if s.success else 0.0) if success_reward else s.episode_reward


def episode_advantages(
    samples: list[TurnSample],
    eps: float,
    *,
    std_norm: bool = True,
    invalid_penalty: float = 0.0,
    success_reward: float = 0.0,
) -> torch.Tensor:
    """GRPO: each turn carries its episode's group-normalized score (METHOD.md 6).

    The score is the task reward (see ``_score``) minus ``invalid_penalty`` per invalid turn
    of the episode. Episodes an environment fault ended (``faulted``: a crash or a timeout,
    never the policy's doing) are left out of their group's statistics and get 0.
    """
    episodes: dict[int, list] = {}
    for s in samples:
        if s.faulted:
            continue
        entry = episodes.setdefault(s.episode, [_score(s, success_reward), s.group_key])
        if invalid_penalty and s.invalid:
            entry[0] -= invalid_penalty
    ep_ids = sorted(episodes)
    group_index: dict[tuple, int] = {}
    groups = torch.tensor([group_index.setdefault(episodes[e][1], len(group_index)) for e in ep_ids])
    rewards = torch.tensor([episodes[e][0] for e in ep_ids], dtype=torch.float64)
    adv = core.group_advantages(rewards, groups, eps=eps, std_norm=std_norm)
    by_episode = dict(zip(ep_ids, adv.tolist(), strict=True))
    return torch.tensor([by_episode.get(s.episode, 0.0) for s in samples], dtype=torch.float32)


def cross_step_advantages(
    samples: list[TurnSample],
    eps: float,
    *,
    std_norm: bool = True,
    invalid_penalty: float = 0.0,
    success_reward: float = 0.0,
) -> torch.Tensor:
    """The authors' GRPO normalization (``compute_mean_std_cross_steps=True``,
    verl/trainer/ppo/core_algos.py:114-175, called at ray_trainer.py:289-295): every turn is
    a sample scored with its episode's reward minus ``invalid_penalty`` if *this* turn was
    invalid (ray_trainer.py:198-222), and mean and std are pooled over all turns of the
    group, so a long episode weighs more in them. Faulted episodes are left out (0)."""
    keep = [i for i, s in enumerate(samples) if not s.faulted]
    group_index: dict[tuple, int] = {}
    groups = torch.tensor(
        [group_index.setdefault(samples[i].group_key, len(group_index)) for i in keep], dtype=torch.long
    )
    scores = torch.tensor(
        [_score(samples[i], success_reward) - (invalid_penalty if samples[i].invalid else 0.0) for i in keep],
        dtype=torch.float64,
    )
    out = torch.zeros(len(samples), dtype=torch.float32)
    if keep:
        out[keep] = core.group_advantages(scores, groups, eps=eps, std_norm=std_norm).to(torch.float32)
    return out


def turn_advantages(samples: list[TurnSample], cfg, *, std_norm: bool = True) -> torch.Tensor:
    """The GRPO advantage of every turn under ``cfg``'s settings (``train.group_norm``,
    ``train.invalid_action_penalty``, ``train.success_reward``); the defaults give exactly
    :func:`episode_advantages`."""
    kw = {"std_norm": std_norm, "invalid_penalty": cfg.invalid_action_penalty, "success_reward": cfg.success_reward}
    if cfg.group_norm not in GROUP_NORMS:
        raise SerlError(f"unknown train.group_norm {cfg.group_norm!r}: choose one of {', '.join(GROUP_NORMS)}")
    if cfg.group_norm == "cross_steps":
        return cross_step_advantages(samples, cfg.adv_eps, **kw)
    return episode_advantages(samples, cfg.adv_eps, **kw)


def default_advantages(cfg) -> bool:
    """Whether ``cfg`` scores turns exactly as serl always did (the annotate stage's advantage)."""
    return cfg.group_norm == "episode" and not cfg.invalid_action_penalty and not cfg.success_reward


def annotation_advantages(samples: list[TurnSample], cfg) -> list[float] | None:
    """The advantages an annotation signs its weights by for an update under ``cfg`` (the
    online loop's and ``serl annotate``'s alike): None -- the annotation's own plain episode
    advantage -- where ``cfg`` scores turns that way, else :func:`turn_advantages`."""
    return None if default_advantages(cfg) else turn_advantages(samples, cfg).tolist()


def policy_gradient_loss(
    mb: MicroBatch,
    logp: torch.Tensor,
    cfg,
    *,
    num_tokens: float,
    distill_tokens: float = 0.0,
    logp_ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """PPO-clip on the (optionally reweighted) advantage, + KL to the reference, + distillation,
    (- the entropy bonus, with dual-clip, when those settings are on).

    ``num_tokens`` and ``distill_tokens`` are the optimizer step's (mini-batch's) counts of
    reply and distillation tokens, not the micro-batch's, so micro-batches add up to the
    mini-batch mean, and both terms keep their scale whatever ``train.mini_batches`` is.
    """
    # Learner.update refuses turns without behaviour log-probs, and every prepare sets advantages
    assert mb.logp_old is not None and mb.advantages is not None
    distill = bool(cfg.distill_coef and mb.distill is not None and mb.logp_teacher is not None)
    distill_mask = sdpo.distill_token_mask(mb.reply_mask, mb.distill) if distill and mb.distill is not None else None
    return core.policy_loss(
        logp,
        mb.logp_old,
        mb.advantages,
        mb.reply_mask,
        weights=mb.weights,
        clip_eps=cfg.clip_eps,
        logp_ref=logp_ref,
        kl_coef=cfg.kl_coef,
        num_tokens=num_tokens,
        logp_teacher=mb.logp_teacher if distill else None,
        distill_coef=cfg.distill_coef if distill else 0.0,
        distill_mask=distill_mask,
        distill_num_tokens=distill_tokens,
        dual_clip=cfg.dual_clip,
        entropy=mb.entropy,
        entropy_coef=cfg.entropy_coef,
        is_weights=mb.is_weights,
    )


# -- sft: behaviour cloning on the reply tokens of reference trajectories ----------------
def sft_prepare(samples, inputs, cfg) -> PerTurn:
    return PerTurn(advantages=torch.zeros(len(samples)))


def sft_loss(mb, logp, cfg, *, num_tokens, distill_tokens=0.0, logp_ref=None):
    nll = -core.masked_sum(logp, mb.reply_mask) / num_tokens
    return nll, {"loss": nll.item(), "nll": nll.item()}


# -- grpo: group-normalized episode advantage, all weights 1 -------------------------------
def grpo_prepare(samples, inputs, cfg) -> PerTurn:
    adv = turn_advantages(samples, cfg)
    return PerTurn(advantages=adv, stats={"mean_abs_advantage": adv.abs().mean().item()})


# -- serl / rlsd / sdpo: the annotate stage's teacher scores and weights ---------------------
def _annotated(samples, inputs: UpdateInputs, cfg, *, weights: bool, distill: bool) -> PerTurn:
    """The annotation's weights (serl, rlsd: on the tokens the annotation weighted) and/or teacher
    log-probs (distillation) of every turn, checked against what ``--algo`` needs of them."""
    ann = inputs.annotations
    if ann is None:
        raise SerlError(f"--algo {cfg.algo} needs annotations: run `serl annotate RUN --algo {cfg.algo}` first")
    if len(ann) != len(samples):
        raise SerlError(f"annotations hold {len(ann)} turns but the rollouts {len(samples)}: annotate this run again")
    check_annotations(cfg, inputs.annotate_config or {})
    adv = turn_advantages(samples, cfg)
    prep = PerTurn(advantages=torch.zeros_like(adv) if distill and not weights else adv)
    if weights:
        prep.token_weights = [
            a.weights if a.weights is not None else [1.0] * len(s.action_ids) for a, s in zip(ann, samples, strict=True)
        ]
    if distill or cfg.distill_coef:
        prep.teacher_logprobs = [
            a.teacher_logprobs or [0.0] * len(s.action_ids) for a, s in zip(ann, samples, strict=True)
        ]
        prep.distill = [bool(a.distill) and a.teacher_logprobs is not None for a in ann]
        prep.stats["distill_tokens"] = sum(len(s.action_ids) for s, d in zip(samples, prep.distill, strict=True) if d)
    prep.stats.update(_annotation_stats(ann, adv, inputs.annotate_config or {}, inputs.annotate_stats or {}))
    return prep


def _annotation_stats(ann: list[Annotation], adv, acfg: dict, astats: dict) -> dict:
    """Per-update metrics of METHOD.md 6: lambda, selected fraction, weight spread, teacher gap."""
    selected = [a for a in ann if a.selected]
    w = [x for a in ann if a.weights for x, m in zip(a.weights, a.action_mask, strict=True) if m]
    gaps = [abs(a.log_ratio_mean) for a in ann if a.log_ratio_mean is not None]
    # the share of the update's advantage mass the weights move: sum |A (w - 1)| / sum |A| over every
    # action token (an unweighted turn counts with w = 1); 0: the update is GRPO's
    moved = total = 0.0
    for a, turn_adv in zip(ann, adv.tolist(), strict=True):
        weights = a.weights or [1.0] * len(a.action_mask)
        for x, m in zip(weights, a.action_mask, strict=True):
            if m:
                moved, total = moved + abs(turn_adv) * abs(x - 1.0), total + abs(turn_adv)
    # the teacher signal (method.teacher_signal), where the annotation measured one: `serl plot`'s panel
    signal = astats.get("teacher_signal") or {}
    teacher = {
        f"teacher_{key}": signal[key]
        for key in ("right_direction", "expert_prob_gain")
        if isinstance(signal.get(key), (int, float))
    }
    lam, c = astats.get("lambda", 0.0), acfg.get("weight_clip", 0.2)
    # a blended weight sits at (1 - lam) + lam * (1 +- c) exactly when the clip bound was hit
    at_clip = [x for x in w if lam > 0 and abs(x - 1.0) >= lam * c * (1 - 1e-6)]
    return {
        "lambda": lam,
        "mean_abs_advantage": adv.abs().mean().item(),
        "selected_fraction": len(selected) / max(len(ann), 1),
        "weight_mean": sum(w) / len(w) if w else 1.0,
        "weight_min": min(w) if w else 1.0,
        "weight_max": max(w) if w else 1.0,
        "weight_clip_fraction": len(at_clip) / len(w) if w else 0.0,
        "advantage_mass_moved": moved / total if total else 0.0,
        "mean_abs_log_ratio": sum(gaps) / len(gaps) if gaps else 0.0,
        "teacher_turns_scored": sum(a.teacher_logprobs is not None for a in ann),
        "teacher_action_tokens": sum(len(a.teacher_logprobs) for a in ann if a.teacher_logprobs is not None),
        **teacher,
    }


def weighted_prepare(samples, inputs: UpdateInputs, cfg) -> PerTurn:
    """serl and rlsd: the GRPO advantage times the annotation's weights."""
    return _annotated(samples, inputs, cfg, weights=True, distill=False)


def sdpo_prepare(samples, inputs: UpdateInputs, cfg) -> PerTurn:
    if not cfg.distill_coef:
        raise SerlError("--algo sdpo is the distillation term alone: set train.distill_coef > 0")
    return _annotated(samples, inputs, cfg, weights=False, distill=True)


# -- gigpo: episode advantage + omega x step advantage within anchor states ----------------
def gigpo_anchor_key(sample: TurnSample, anchor: str):
    """What makes two turns of a group one anchor state (``train.gigpo_anchor``): state = the
    environment's state_key (ALFWorld: a hash of the world's facts; WebShop, Sokoban: of the
    observation) | observation = the raw observation text, the authors' key (the 'anchor'
    observation, env_manager.py:60,76; grouped by identical text, core_gigpo.py:277-296), which
    pools every ALFWorld "Nothing happens." of a group into one state."""
    return sample.state_key if anchor == "state" else sample.observation


def gigpo_prepare(samples, inputs, cfg) -> PerTurn:
    if cfg.gigpo_mode not in GIGPO_MODES:
        raise SerlError(f"unknown train.gigpo_mode {cfg.gigpo_mode!r}: choose one of {', '.join(GIGPO_MODES)}")
    if cfg.gigpo_anchor not in GIGPO_ANCHORS:
        raise SerlError(f"unknown train.gigpo_anchor {cfg.gigpo_anchor!r}: choose one of {', '.join(GIGPO_ANCHORS)}")
    anchor = cfg.gigpo_anchor
    std_norm = cfg.gigpo_mode == "mean_std_norm"  # verl-agent's "mean_norm" subtracts the mean only, at both levels
    penalty, success_reward = cfg.invalid_action_penalty, cfg.success_reward
    episode_adv = turn_advantages(samples, cfg, std_norm=std_norm)
    by_episode: dict[int, list[TurnSample]] = {}
    for s in samples:
        if not s.faulted:
            by_episode.setdefault(s.episode, []).append(s)
    ret_of = {}
    for turns in by_episode.values():
        rewards = [t.turn_reward for t in turns]
        if success_reward:  # the authors' reward: success_reward on the winning turn, 0 elsewhere
            rewards = [0.0] * (len(turns) - 1) + [success_reward if turns[-1].success else 0.0]
        for s, r in zip(turns, gigpo.discounted_returns(rewards, cfg.gamma), strict=True):
            # the penalty comes off the invalid turn's return, after discounting (ray_trainer.py:217-218)
            ret_of[id(s)] = r - penalty if penalty and s.invalid else r
    kept = [i for i, s in enumerate(samples) if not s.faulted]
    anchor_index: dict[tuple, int] = {}
    anchors = torch.tensor(
        [
            anchor_index.setdefault((samples[i].group_key, gigpo_anchor_key(samples[i], anchor)), len(anchor_index))
            for i in kept
        ],
        dtype=torch.long,
    )
    returns = torch.tensor([ret_of[id(samples[i])] for i in kept], dtype=torch.float64)
    step = torch.zeros(len(samples), dtype=torch.float32)
    if kept:
        step[kept] = gigpo.step_advantages(returns, anchors, eps=cfg.adv_eps, std_norm=std_norm).to(torch.float32)
    adv = gigpo.gigpo_advantages(episode_adv, step, omega=cfg.omega)
    return PerTurn(
        advantages=adv,
        stats={
            "mean_abs_advantage": adv.abs().mean().item(),
            "mean_abs_step_advantage": step.abs().mean().item(),
            "anchor_states": len(anchor_index),
        },
    )


# the functions the registry names (algos.registry: by name, so a config is checked without torch)
MATH: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        policy_gradient_loss,
        sft_prepare,
        sft_loss,
        grpo_prepare,
        gigpo_prepare,
        weighted_prepare,
        sdpo_prepare,
    )
}
