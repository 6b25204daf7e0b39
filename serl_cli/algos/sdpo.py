"""Self-distillation (SDPO-style) term: pull the policy toward its hindsight teacher
on the action tokens of selected turns of FAILED rollouts (METHOD.md sections 6-7).

On a failure the reward gives no example of what to do; the teacher, shown hindsight
(the error, a successful sibling...), does. On a success the policy already did well.
"""

from torch import Tensor

from .core import kl_k3


def distill_kl(logp: Tensor, logp_teacher: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_T) on the sampled tokens.

    exp(d) - d - 1 with d = logp_T - logp, the form of core.kl_k3 with the teacher in
    place of the reference. Why k3: rollouts store the teacher's log-prob of the
    SAMPLED token only, not its full next-token distribution, so the exact KL (a sum
    over the vocabulary) cannot be computed; k3 needs just those two numbers, is >= 0,
    unbiased for tokens drawn from pi, and has lower variance than the naive -d.
    As a loss its expected gradient is that of KL(pi_T || pi) (see core.kl_k3); both
    are zero exactly when the policy matches the teacher on the sampled tokens.
    """
    return kl_k3(logp, logp_teacher)


def failed_rollout_mask(rewards_per_sample: Tensor, success_threshold: float = 1.0) -> Tensor:
    """True for samples whose rollout failed: task reward < success_threshold.

    Default 1.0: ALFWorld reward 1 on a win, WebShop success is score 1.0.
    rewards_per_sample: [B], the rollout's final task reward copied to each of its turns.
    """
    return rewards_per_sample < success_threshold


def distill_token_mask(selected_tokens_mask: Tensor, failed: Tensor) -> Tensor:
    """Tokens the distill term applies to: selected action tokens [B, T] of failed samples [B]."""
    return selected_tokens_mask.bool() & failed.bool().unsqueeze(-1)
