"""SERL hindsight weights (METHOD.md sections 5-6).

The sign of every update comes from the task reward (the GRPO advantage); the hindsight
teacher only sets its magnitude, per action token of the turns in the critical set S:

    w_k  = clip(exp(sign(A_i) * (log pi_T(a_k) - log pi_old(a_k))), 1 - c, 1 + c)
    w'_k = (1 - lambda) + lambda * w_k,   outside S and off action tokens w'_k = 1.

On a success (A > 0), tokens the teacher likes more than the student get more credit;
on a failure (A < 0), tokens the teacher likes less get more blame. All weights are
constants: computed from stored log-probs, never differentiated.
"""

import torch
from torch import Tensor


def hindsight_weights(logp_teacher: Tensor, logp_old: Tensor, advantages_sign: Tensor, clip: float = 0.2) -> Tensor:
    """w = clip(exp(sign(A) * (logp_T - logp_old)), 1 - clip, 1 + clip), per token [B, T].

    advantages_sign: [B] or [B, T]; only its sign is used, so the advantage itself can
    be passed. sign(A) = 0 (a group with no reward signal) gives exactly 1.
    """
    sign = torch.sign(advantages_sign.detach())
    if sign.dim() == 1:
        sign = sign.unsqueeze(-1)
    sign = sign.expand_as(logp_old)
    log_ratio = (logp_teacher - logp_old).detach()
    w = torch.clamp(torch.exp(sign * log_ratio), 1 - clip, 1 + clip)
    # where(), not just exp(0 * x): 0 * inf would be nan for a -inf teacher log-prob.
    return torch.where(sign == 0, torch.ones_like(w), w)


def mixing_lambda(update_step: int, lambda0: float = 0.5, decay_steps: int = 50) -> float:
    """lambda0 decayed linearly to 0 over decay_steps updates; decay_steps=0: constant.

    update_step counts optimizer updates from 0; lambda is 0 from decay_steps on, so
    late training is plain GRPO (the teacher only shapes early credit assignment).
    """
    if decay_steps <= 0:
        return float(lambda0)
    return float(lambda0) * max(0.0, 1.0 - update_step / decay_steps)


def blend_weights(w: Tensor, lam: float) -> Tensor:
    """(1 - lam) + lam * w: lam = 0 gives exactly 1 (GRPO), lam = 1 the raw weights."""
    return (1.0 - lam) + lam * w


def apply_placement(weights: Tensor, selected_tokens_mask: Tensor) -> Tensor:
    """Keep weights on selected tokens (action tokens of turns in S), 1 everywhere else."""
    return torch.where(selected_tokens_mask.bool(), weights, torch.ones_like(weights))
