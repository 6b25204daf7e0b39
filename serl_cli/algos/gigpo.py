"""GiGPO: Group-in-Group Policy Optimization (Feng et al., arXiv 2505.10978).

A turn's advantage is the episode advantage plus omega times a step advantage:

    A(a_t^i) = A^E(tau_i) + omega * A^S(a_t^i)

A^E is the GRPO advantage of the whole episode (core.group_advantages). A^S compares
turns that start from the same anchor state (same observation, same task, same group):
each turn's discounted return R_t = sum_k gamma^k r_{t+k} is normalized within its anchor
group, so among actions taken in one state the ones that led further get more credit.
"""

from torch import Tensor

from .core import group_advantages


def discounted_returns(rewards_per_turn: list[float], gamma: float) -> list[float]:
    """R_t = r_t + gamma * R_{t+1} for each turn of ONE episode, to its end."""
    returns, running = [], 0.0
    for r in reversed(rewards_per_turn):
        running = r + gamma * running
        returns.append(running)
    return returns[::-1]


def step_advantages(returns: Tensor, anchor_ids: Tensor, eps: float = 1e-6, std_norm: bool = True) -> Tensor:
    """Returns [M] normalized among the turns sharing an anchor id (M turns, all episodes).

    Same convention as group_advantages: unbiased std, and a singleton anchor group (a
    state only one rollout visited) or an all-equal one gives 0. std_norm=False is the
    paper's "mean_norm" mode (F_norm = 1).
    """
    return group_advantages(returns, anchor_ids, eps, std_norm)


def gigpo_advantages(episode_adv_per_turn: Tensor, step_adv: Tensor, omega: float = 1.0) -> Tensor:
    """A^E + omega * A^S, both [M] per turn (the episode advantage repeated on its turns)."""
    return episode_adv_per_turn + omega * step_adv
