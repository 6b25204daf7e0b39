"""What each ``--algo`` optimizes: a registry joining the pure math in ``algos/`` to the trainer.

An objective first *prepares* a batch (advantages per turn, per-token weights, teacher
log-probs: everything fixed before the first gradient step) and then gives the loss of a
micro-batch from the current policy's token log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from serl_cli.algos import core
from serl_cli.errors import SerlError
from serl_cli.schema import TurnSample
from serl_cli.trainer import MicroBatch, pad_right_aligned


@dataclass
class Prepared:
    """Per-sample quantities fixed for the whole update."""

    advantages: torch.Tensor  # [N] one per turn (episode advantage broadcast to its turns)
    token_weights: list[list[float]] | None = None  # per action token, SERL-style weights
    teacher_logprobs: list[list[float]] | None = None
    distill: list[bool] | None = None  # turns whose tokens carry the distillation term
    stats: dict = field(default_factory=dict)


@dataclass
class Objective:
    name: str
    prepare: Callable[[list[TurnSample], dict, object], Prepared]
    loss: Callable[[MicroBatch, torch.Tensor, list[TurnSample], Prepared, float, object, torch.Tensor | None],
                   tuple[torch.Tensor, dict]]
    uses_behaviour_logprobs: bool = True  # False: stored turns need no log-probs (SFT on expert data)
    needs_annotations: bool = False


OBJECTIVES: dict[str, Objective] = {}


def register(obj: Objective) -> Objective:
    OBJECTIVES[obj.name] = obj
    return obj


def get_objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise SerlError(f"unknown algorithm {name!r}: choose one of {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[name]


def episode_advantages(samples: list[TurnSample], eps: float) -> torch.Tensor:
    """GRPO: each turn carries its episode's group-normalized reward (METHOD.md 6)."""
    episodes: dict[int, tuple[float, tuple]] = {}
    for s in samples:
        episodes.setdefault(s.episode, (s.episode_reward, s.group_key))
    ep_ids = sorted(episodes)
    group_index: dict[tuple, int] = {}
    groups = torch.tensor([group_index.setdefault(episodes[e][1], len(group_index)) for e in ep_ids])
    rewards = torch.tensor([episodes[e][0] for e in ep_ids], dtype=torch.float64)
    by_episode = dict(zip(ep_ids, core.group_advantages(rewards, groups, eps=eps).tolist()))
    return torch.tensor([by_episode[s.episode] for s in samples], dtype=torch.float32)


def policy_gradient_loss(mb: MicroBatch, logp: torch.Tensor, samples: list[TurnSample], prep: Prepared,
                         num_tokens: float, cfg, logp_ref: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """PPO-clip on the (optionally reweighted) advantage, + KL to the reference, + distillation."""
    logp_old = pad_right_aligned([s.behaviour_logprobs for s in samples], mb)
    weights = pad_right_aligned(prep.token_weights, mb) if prep.token_weights is not None else None
    if weights is not None:
        weights = torch.where(mb.action_mask.bool(), weights, torch.ones_like(weights))
    teacher = pad_right_aligned(prep.teacher_logprobs, mb) if prep.teacher_logprobs is not None else None
    distill_mask = None
    if prep.distill is not None:
        rows = torch.tensor([prep.distill[i] for i in mb.index], dtype=torch.bool).unsqueeze(-1)
        distill_mask = mb.action_mask.bool() & rows
    return core.policy_loss(
        logp, logp_old, prep.advantages[mb.index], mb.action_mask,
        weights=weights, clip_eps=cfg.clip_eps, logp_ref=logp_ref, kl_coef=cfg.kl_coef,
        logp_teacher=teacher, distill_coef=getattr(cfg, "distill_coef", 0.0) if teacher is not None else 0.0,
        distill_mask=distill_mask, num_tokens=num_tokens)


# -- sft: behaviour cloning on the action tokens of reference trajectories ----------------
def _sft_prepare(samples, episodes, cfg) -> Prepared:
    return Prepared(advantages=torch.zeros(len(samples)))


def _sft_loss(mb, logp, samples, prep, num_tokens, cfg, logp_ref):
    nll = -core.masked_sum(logp, mb.action_mask) / num_tokens
    return nll, {"loss": nll.item(), "nll": nll.item()}


register(Objective("sft", _sft_prepare, _sft_loss, uses_behaviour_logprobs=False))


# -- grpo: group-normalized episode advantage, all weights 1 -------------------------------
def _grpo_prepare(samples, episodes, cfg) -> Prepared:
    adv = episode_advantages(samples, cfg.adv_eps)
    return Prepared(advantages=adv, stats={"mean_abs_advantage": adv.abs().mean().item()})


register(Objective("grpo", _grpo_prepare, policy_gradient_loss))
