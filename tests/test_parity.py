"""Parity with the authors' code (github.com/OliverLeeXZ/SERL, commit 5a2a85b): each of their
formulas is re-derived here from its written description (docs/PARITY.md, the file:line
cited beside it), in plain Python floats and loops, and compared with serl's tensors on
random inputs. Nothing here is copied from their code.

CA = verl/trainer/ppo/core_algos.py, RT = verl/trainer/ppo/ray_trainer.py,
GG = recipe/gigpo/core_gigpo.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from serl_cli.algos import core
from serl_cli.algos.objectives import cross_step_advantages, episode_advantages
from serl_cli.algos.serl import apply_placement, blend_weights, hindsight_weights, mixing_lambda
from serl_cli.artifacts.schema import TurnSample


# ---------------------------------------------------------------- the SERL weighted advantage
def authors_reweighted_advantage(
    adv, student, teacher, response_mask, serl_mask, action_mask, *, weight_clip, lambda0, decay_steps, update_step
):
    """compute_serl_action_mask_reweighted_advantages (CA:447-526), from its description:

    lambda   = lambda0 * max(0, 1 - k / decay)  (decay 0: constant)            CA:432-444
    delta    = log pi_T - log pi_student (no gradient)                          CA:465
    s        = clamp(sign(A) * delta, -20, 20); w = clamp(exp(s), 1-c, 1+c)     CA:466-469
    selected = response token AND row has a hindsight block AND action token    CA:471-482
    A'       = A * ((1 - lambda) + lambda * w if selected else 1) * response     CA:484-490
    """
    lam = lambda0 if decay_steps == 0 else lambda0 * max(0.0, 1.0 - update_step / decay_steps)
    out = []
    for b in range(len(adv)):
        row = []
        for k in range(len(adv[b])):
            a = adv[b][k]
            sign = (a > 0) - (a < 0)
            s = min(20.0, max(-20.0, sign * (teacher[b][k] - student[b][k])))
            w = min(1.0 + weight_clip, max(1.0 - weight_clip, math.exp(s)))
            selected = response_mask[b][k] and serl_mask[b] and action_mask[b][k]
            blended = (1.0 - lam) + lam * w if selected else 1.0
            row.append(a * blended * response_mask[b][k])
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def serl_weighted_advantage(
    adv_rows,
    logp_old,
    logp_teacher,
    reply_mask,
    has_block,
    action_mask,
    *,
    weight_clip,
    lambda0,
    decay_steps,
    update_step,
):
    """What serl trains on: algos/serl.py's blended weights on the selected action tokens,
    times the turn's advantage (core.ppo_clip_loss multiplies weights by A before the clip)."""
    lam = mixing_lambda(update_step, lambda0, decay_steps)
    w = blend_weights(hindsight_weights(logp_teacher, logp_old, adv_rows, weight_clip), lam)
    selected = reply_mask.bool() & has_block.unsqueeze(-1) & action_mask.bool()
    weights = apply_placement(w, selected)
    return (weights * adv_rows.unsqueeze(-1)) * reply_mask


def random_batch(seed: int, B: int = 24, T: int = 20):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    rewards[:4] = 1.0  # group 0: all equal, so A = 0 there
    adv = core.group_advantages(rewards, torch.arange(B) // 4)
    logp_old = -torch.rand(B, T, generator=g) * 4
    # teacher - student spans the clip on both sides, and sits exactly on 0 at some tokens
    delta = torch.randn(B, T, generator=g) * 0.5
    delta[:, 0] = 0.0
    delta[:, 1] = 3.0
    delta[:, 2] = -3.0
    delta[5, 3] = 30.0  # past the authors' +-20 clamp: same clipped weight
    logp_teacher = logp_old + delta
    reply_mask = (torch.arange(T) >= torch.randint(0, 6, (B, 1), generator=g)).float()  # left padding
    has_block = torch.rand(B, generator=g) > 0.3
    action_mask = (torch.rand(B, T, generator=g) > 0.4).float()
    action_mask[7] = 0.0  # a reply with no parseable action: no weights
    return adv, logp_old, logp_teacher, reply_mask, has_block, action_mask


@pytest.mark.parametrize("update_step, decay_steps", [(0, 50), (10, 50), (49, 50), (50, 50), (80, 50), (7, 0)])
@pytest.mark.parametrize("weight_clip", [0.2, 0.0, 0.5])
def test_serl_weighted_advantages_equal_the_authors(update_step, decay_steps, weight_clip):
    """On the first mini-batch of an on-policy update the authors' student log-prob (the
    CURRENT policy's, DPA:472,491-494) equals pi_old, which serl uses: the two agree."""
    adv, logp_old, logp_teacher, reply_mask, has_block, action_mask = random_batch(update_step * 7 + 1)
    T = logp_old.shape[1]
    ours = serl_weighted_advantage(
        adv,
        logp_old,
        logp_teacher,
        reply_mask,
        has_block,
        action_mask,
        weight_clip=weight_clip,
        lambda0=0.5,
        decay_steps=decay_steps,
        update_step=update_step,
    )
    theirs = authors_reweighted_advantage(
        adv.unsqueeze(-1).expand(-1, T).tolist(),
        logp_old.tolist(),
        logp_teacher.tolist(),
        reply_mask.tolist(),
        has_block.tolist(),
        action_mask.tolist(),
        weight_clip=weight_clip,
        lambda0=0.5,
        decay_steps=decay_steps,
        update_step=update_step,
    )
    torch.testing.assert_close(ours.double(), theirs, rtol=0, atol=1e-6)
    # not vacuous: A = 0 rows, the clip edges and lambda all show up
    assert (adv == 0).any() and (adv != 0).any()
    ratio = ours / adv.unsqueeze(-1).where(adv.unsqueeze(-1) != 0, torch.ones(1))
    lam = mixing_lambda(update_step, 0.5, decay_steps)
    if lam > 0 and weight_clip > 0:
        edges = ratio[adv != 0][:, 1:3]
        assert torch.isclose(edges, torch.tensor(1 + lam * weight_clip)).any()
        assert torch.isclose(edges, torch.tensor(1 - lam * weight_clip)).any()


def test_the_authors_student_is_the_current_policy_not_pi_old():
    """The one real difference in the formula (docs/PARITY.md): after the first optimizer
    step of an update the current policy has moved; the authors' weight follows it, serl's
    stays on pi_old. Equal only while current == old."""
    adv, logp_old, logp_teacher, reply_mask, has_block, action_mask = random_batch(3)
    T = logp_old.shape[1]
    current = logp_old + 0.3  # the policy one optimizer step later
    kw = {"weight_clip": 0.2, "lambda0": 0.5, "decay_steps": 50, "update_step": 0}
    ours = serl_weighted_advantage(adv, logp_old, logp_teacher, reply_mask, has_block, action_mask, **kw)
    masks = (reply_mask.tolist(), has_block.tolist(), action_mask.tolist())
    theirs_drifted = authors_reweighted_advantage(
        adv.unsqueeze(-1).expand(-1, T).tolist(), current.tolist(), logp_teacher.tolist(), *masks, **kw
    )
    assert not torch.allclose(ours.double(), theirs_drifted, atol=1e-4)


# ---------------------------------------------------------------- dual-clip PPO
def authors_policy_loss(adv, ratio, mask, clip, c):
    """compute_policy_loss (CA:529-590) from its description, token-mean (CA:411-412):
    L1 = -A r, L2 = -A clip(r, 1-e, 1+e), Lc = max(L1, L2); where A < 0: min(Lc, -A c)."""
    total, n = 0.0, 0
    for b in range(len(adv)):
        for k in range(len(adv[b])):
            if not mask[b][k]:
                continue
            a, r = adv[b][k], ratio[b][k]
            lc = max(-a * r, -a * min(1 + clip, max(1 - clip, r)))
            total += min(lc, -a * c) if a < 0 else lc
            n += 1
    return total / n


def test_dual_clip_equals_the_authors_policy_loss():
    g = torch.Generator().manual_seed(5)
    B, T = 16, 12
    logp_old = -torch.rand(B, T, generator=g) * 3
    logp = logp_old + torch.randn(B, T, generator=g) * 1.2  # ratios well past 3 and below 1/3
    adv = torch.randn(B, generator=g)
    weights = 0.8 + 0.4 * torch.rand(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    loss, stats = core.ppo_clip_loss(logp, logp_old, adv, weights, mask, 0.2, dual_clip=3.0)
    wa = (weights * adv.unsqueeze(-1)).tolist()
    theirs = authors_policy_loss(wa, torch.exp(logp - logp_old).tolist(), mask.tolist(), 0.2, 3.0)
    assert loss.item() == pytest.approx(theirs, rel=1e-5)
    assert stats["dual_clip_frac"] > 0  # the cap bound somewhere
    plain, _ = core.ppo_clip_loss(logp, logp_old, adv, weights, mask, 0.2)
    assert plain.item() != pytest.approx(theirs, rel=1e-3)  # and it matters


# ---------------------------------------------------------------- GRPO across steps, penalty
def sample(episode, group, reward, invalid=False, success=None, state="s", turn_reward=0.0, faulted=False):
    return TurnSample(
        episode=episode,
        turn=0,
        group_key=(group, 0),
        prompt_ids=[1],
        action_ids=[2],
        behaviour_logprobs=[-1.0],
        episode_reward=reward,
        success=bool(reward >= 1.0) if success is None else success,
        state_key=state,
        turn_reward=turn_reward,
        invalid=invalid,
        faulted=faulted,
    )


def authors_grpo_cross_steps(rows, eps=1e-6, std_norm=True):
    """compute_grpo_outcome_advantage with compute_mean_std_cross_steps=True (CA:114-175),
    from its description: each step-row's score is its episode reward minus the penalty if
    the row's action was invalid (RT:198-222, applied before the advantage, RT:1231-1248);
    mean and unbiased std pooled over all rows of the task group; (s - mean) / (std + eps)."""
    by_group: dict = {}
    for group, score in rows:
        by_group.setdefault(group, []).append(score)
    out = []
    for group, score in rows:
        xs = by_group[group]
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
        out.append((score - mean) / (std + eps) if std_norm else score - mean)
    return out


def random_turns(seed: int, *, faulted_episode: int | None = None):
    rng = random.Random(seed)
    samples, ep = [], 0
    for group in range(3):
        for _ in range(4):
            won = rng.random() < 0.4
            for _ in range(rng.randint(1, 5)):
                samples.append(
                    sample(ep, group, 1.0 if won else 0.0, invalid=rng.random() < 0.3, faulted=ep == faulted_episode)
                )
            ep += 1
    return samples


@pytest.mark.parametrize("std_norm", [True, False])
def test_cross_step_grpo_with_the_invalid_penalty_equals_the_authors(std_norm):
    samples = random_turns(11)
    # the authors' reward scale: 10 for a win (env_package/webshop/envs.py:47-53), 0.1 per invalid action
    ours = cross_step_advantages(samples, 1e-6, std_norm=std_norm, invalid_penalty=0.1, success_reward=10.0)
    rows = [(s.group_key, (10.0 if s.success else 0.0) - (0.1 if s.invalid else 0.0)) for s in samples]
    theirs = authors_grpo_cross_steps(rows, std_norm=std_norm)
    assert ours.tolist() == pytest.approx(theirs, abs=1e-5)
    # with the penalty a turn's advantage depends on its own validity, not only its episode's outcome
    assert any(
        len({round(a, 6) for a, s in zip(ours.tolist(), samples, strict=True) if s.episode == e}) > 1 for e in range(12)
    )


def test_faulted_episodes_leave_their_group_statistics():
    """An episode an environment broke is scored as if it never ran: the others' advantages
    are what they would be without it, and its own turns get 0 (serl's rule; the authors'
    envs have no fault path)."""
    with_fault = random_turns(4, faulted_episode=2)
    without = [s for s in with_fault if not s.faulted]
    for fn in (episode_advantages, cross_step_advantages):
        a, b = fn(with_fault, 1e-6).tolist(), fn(without, 1e-6).tolist()
        assert [x for x, s in zip(a, with_fault, strict=True) if not s.faulted] == pytest.approx(b)
        assert all(x == 0.0 for x, s in zip(a, with_fault, strict=True) if s.faulted)
