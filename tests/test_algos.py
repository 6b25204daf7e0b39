"""Algorithm math against values worked by hand (the arithmetic sits next to each value)."""

import math

import pytest
import torch

from serl_cli.algos.core import group_advantages, kl_k3, masked_mean, masked_sum, policy_loss, ppo_clip_loss
from serl_cli.algos.gigpo import discounted_returns, gigpo_advantages, step_advantages
from serl_cli.algos.sdpo import distill_kl, distill_token_mask, failed_rollout_mask
from serl_cli.algos.serl import apply_placement, blend_weights, hindsight_weights, mixing_lambda

torch.set_num_threads(1)
approx = lambda x: pytest.approx(x, abs=1e-5)  # noqa: E731
SQRT3 = math.sqrt(3)


# ---------------------------------------------------------------- group advantages
def test_group_advantages_bessel_equal_and_singleton():
    # Groups interleaved, non-contiguous ids: 7 = [1, 0, 0], 3 = [0.3]*3, 9 = [5].
    rewards = torch.tensor([1.0, 0.3, 0.0, 0.3, 5.0, 0.0, 0.3])
    groups = torch.tensor([7, 3, 7, 3, 9, 7, 3])
    adv = group_advantages(rewards, groups, eps=0.0)
    # group 7: mean 1/3; deviations 2/3, -1/3, -1/3; sum sq = 4/9+1/9+1/9 = 2/3;
    # unbiased var = (2/3)/(3-1) = 1/3, std = 1/sqrt3 (population std would be sqrt(2/9)).
    assert adv[0].item() == approx(2 / 3 * SQRT3)  # 1.1547
    assert adv[2].item() == approx(-1 / 3 * SQRT3)  # -0.57735
    assert adv[5].item() == approx(-1 / 3 * SQRT3)
    # group 3: all equal -> exactly 0 (not a float residue); group 9: singleton -> exactly 0.
    assert adv[[1, 3, 4, 6]].tolist() == [0.0, 0.0, 0.0, 0.0]
    # default eps=1e-6: 2/3 / (1/sqrt3 + 1e-6) = 1.154698..., within 1e-5 of 1.1547
    assert group_advantages(rewards, groups)[0].item() == approx(2 / 3 * SQRT3)
    # mean-only variant: 1 - 1/3 = 2/3
    assert group_advantages(rewards, groups, std_norm=False)[0].item() == approx(2 / 3)


def test_masked_reductions_ignore_masked_nan():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_sum(x, m).item() == 13.0  # 1 + 2 + 4 + 6
    assert masked_mean(x, m).item() == 3.25  # 13 / 4
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0  # empty mask: no loss


# ---------------------------------------------------------------- PPO clip
def test_ppo_clip_branches_and_clip_frac():
    # logp_old = 0, so ratio r = exp(logp). eps = 0.2, clip range [0.8, 1.2].
    ratios = torch.tensor([[1.1, 1.5, 0.5], [1.5, 0.5, 1.1]])
    logp = ratios.log().requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    loss, stats = ppo_clip_loss(logp, torch.zeros(2, 3), adv, None, torch.ones(2, 3))
    # A=+1: r=1.1 inside -> -1.1 | r=1.5: min(1.5, 1.2) = 1.2 clipped binds -> -1.2
    #       r=0.5: min(0.5, 0.8) = 0.5 unclipped binds -> -0.5
    # A=-1: r=1.5: min(-1.5, -1.2) = -1.5 unclipped -> +1.5 | r=0.5: min(-0.5, -0.8) = -0.8
    #       clipped binds -> +0.8 | r=1.1 inside -> +1.1
    # sum = -2.8 + 3.4 = 0.6; / N_tokens 6 = 0.1
    assert loss.item() == approx(0.1)
    assert stats["clip_frac"] == approx(2 / 6)  # r=1.5 at A>0 and r=0.5 at A<0
    assert stats["ratio_mean"] == approx(3.1 / 3)  # (1.1+1.5+0.5) * 2 / 6 = 1.03333
    assert stats["approx_kl"] == approx(-math.log(0.825) / 3)  # -2 ln(1.1*1.5*0.5)/6 = 0.064124
    # k3 = (r - 1) - ln r per token: 0.1 - ln 1.1, 0.5 - ln 1.5, -0.5 - ln 0.5; each twice, mean of 6:
    # (3.1 - 3 - ln 0.825) / 3 = (0.1 + 0.192372) / 3 = 0.097457, and never below 0
    assert stats["kl_k3"] == approx((0.1 - math.log(0.825)) / 3)
    # d loss/d logp = -A r / N on the unclipped branch, 0 where the clip binds.
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.tensor([[-1.1, 0.0, -0.5], [1.5, 0.0, 1.1]]) / 6
    assert torch.allclose(grad, expected, atol=1e-6)


def test_ppo_weights_scale_the_advantage():
    # One token, r = 1.1 (inside), A = -1, w = 0.8: loss = -min(1.1*-0.8, 1.1*-0.8) = 0.88
    logp = torch.tensor([[math.log(1.1)]])
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.tensor([[0.8]]), torch.ones(1, 1))
    assert loss.item() == approx(0.88)


def test_loss_divided_by_n_tokens_with_prompt_masked():
    # Sample 0: 2 prompt + 2 action tokens; sample 1: 1 prompt + 3 action. N_tokens = 5.
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    logp_old = torch.full((2, 4), -1.0)
    logp = logp_old.clone()
    logp[0, 0], logp[1, 0] = 100.0, float("nan")  # garbage on prompt tokens must not count
    logp.requires_grad_()
    adv = torch.tensor([1.0, -0.5])
    loss, stats = ppo_clip_loss(logp, logp_old, adv, None, mask)
    # ... not even as a nan gradient: -A / N on action tokens, exactly 0 on prompt tokens
    (grad,) = torch.autograd.grad(loss, logp, retain_graph=True)
    assert grad.flatten().tolist() == approx([0, 0, -0.2, -0.2, 0, 0.1, 0.1, 0.1])
    # r = 1 on action tokens: per token -A -> 2 * (-1) + 3 * (+0.5) = -0.5; / 5 = -0.1
    # (a per-sequence mean would give (-1 + 0.5) / 2 = -0.25)
    assert loss.item() == approx(-0.1)
    assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == approx(1.0)
    # micro-batch of a 10-token batch: -0.5 / 10 = -0.05
    loss10, _ = ppo_clip_loss(logp, logp_old, adv, None, mask, num_tokens=10)
    assert loss10.item() == approx(-0.05)
    # [B, T] advantages give the same as [B] broadcast
    loss_bt, _ = ppo_clip_loss(logp, logp_old, adv[:, None].expand(2, 4), None, mask)
    assert loss_bt.item() == loss.item()


# ---------------------------------------------------------------- k3 KL
def test_kl_k3_hand_values():
    lp = torch.tensor([-0.7, -2.0])
    assert kl_k3(lp, lp).tolist() == [0.0, 0.0]
    # d = logp_ref - logp = ln 2: e^d - d - 1 = 2 - 0.693147 - 1 = 0.306853
    assert kl_k3(torch.tensor(math.log(0.25)), torch.tensor(math.log(0.5))).item() == approx(0.306853)
    # d = -ln 2: 0.5 + 0.693147 - 1 = 0.193147
    assert kl_k3(torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25))).item() == approx(0.193147)


def test_policy_loss_adds_kl_and_distill_terms():
    # r = 1, A = 0 -> PPO term 0. Two tokens, both masked.
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.5, 0.5]]))  # k3 = [0, 0.306853]
    teacher = torch.log(torch.tensor([[1.0, 0.25]]))  # k3 = [0.306853, 0]
    loss, stats = policy_loss(
        logp,
        logp.clone(),
        torch.zeros(1),
        torch.ones(1, 2),
        logp_ref=ref,
        kl_coef=0.1,
        logp_teacher=teacher,
        distill_coef=2.0,
        distill_mask=torch.tensor([[1, 0]]),
    )
    # KL mean over 2 tokens = 0.306853 / 2 = 0.153426; distill over 1 token = 0.306853
    # loss = 0 + 0.1 * 0.153426 + 2 * 0.306853 = 0.015343 + 0.613706 = 0.629049
    assert stats["kl_ref"] == approx(0.153426) and stats["distill_kl"] == approx(0.306853)
    assert loss.item() == approx(0.629049)


# ---------------------------------------------------------------- SERL weights
def test_hindsight_weights_signs_and_clip_edges():
    diff = torch.tensor([[math.log(1.5), math.log(1.1), -math.log(1.5), math.log(1.2), math.log(1.25)]])
    pos = hindsight_weights(diff, torch.zeros_like(diff), torch.tensor([2.3]))
    neg = hindsight_weights(diff, torch.zeros_like(diff), torch.tensor([-0.7]))
    # A>0: exp(+d) = [1.5 -> 1.2, 1.1, 0.667 -> 0.8, 1.2 (edge), 1.25 -> 1.2]
    assert pos.flatten().tolist() == approx([1.2, 1.1, 0.8, 1.2, 1.2])
    # A<0: exp(-d) = [0.667 -> 0.8, 1/1.1 = 0.909091, 1.5 -> 1.2, 0.833333, 0.8 (edge)]
    assert neg.flatten().tolist() == approx([0.8, 0.909091, 1.2, 0.833333, 0.8])
    # A = 0: exactly 1, even where the teacher log-prob is -inf
    t = torch.tensor([[float("-inf"), 3.0]])
    assert hindsight_weights(t, torch.zeros(1, 2), torch.zeros(1)).tolist() == [[1.0, 1.0]]


def test_mixing_lambda_schedule():
    assert mixing_lambda(0) == 0.5
    assert mixing_lambda(10) == approx(0.4)  # 0.5 * (1 - 10/50)
    assert mixing_lambda(25) == approx(0.25)  # 0.5 * (1 - 25/50)
    assert mixing_lambda(50) == 0.0
    assert mixing_lambda(80) == 0.0  # clamped, not negative
    assert mixing_lambda(1000, decay_steps=0) == 0.5


def test_blend_and_placement():
    w = torch.tensor([[1.2, 0.8, 1.1]])
    assert torch.equal(blend_weights(w, 0.0), torch.ones(1, 3))  # exactly 1
    assert blend_weights(w, 0.5).flatten().tolist() == approx([1.1, 0.9, 1.05])  # 0.5 + 0.5w
    sel = torch.tensor([[0, 1, 1]])
    assert apply_placement(w, sel).flatten().tolist() == approx([1.0, 0.8, 1.1])


def test_sdpo_masks():
    failed = failed_rollout_mask(torch.tensor([1.0, 0.0, 0.5]))  # success only at 1.0
    assert failed.tolist() == [False, True, True]
    sel = torch.tensor([[1, 1], [0, 1], [1, 0]])
    assert distill_token_mask(sel, failed).tolist() == [[False, False], [False, True], [True, False]]
    assert distill_kl(torch.tensor(math.log(0.25)), torch.tensor(math.log(0.5))).item() == approx(0.306853)


# ---------------------------------------------------------------- GiGPO
def test_gigpo_returns_and_step_advantages():
    # gamma 0.9 on [0, 0, 1]: R2 = 1, R1 = 0 + 0.9*1 = 0.9, R0 = 0.9*0.9 = 0.81
    assert discounted_returns([0.0, 0.0, 1.0], 0.9) == approx([0.81, 0.9, 1.0])
    assert discounted_returns([1.0, -1.0, 2.0], 1.0) == approx([2.0, 1.0, 2.0])
    # anchors: 0 = {0.81, 0.0}; 1 = {0.9} singleton; 2 = {1.0, 0.0, 0.5}
    returns = torch.tensor([0.81, 0.9, 1.0, 0.0, 0.0, 0.5])
    anchors = torch.tensor([0, 1, 2, 0, 2, 2])
    step = step_advantages(returns, anchors)
    # anchor 0: any pair gives +-d / (d*sqrt2) = +-0.707107 with Bessel std
    # anchor 2: mean 0.5, sum sq 0.25+0.25+0 = 0.5, var 0.5/2 = 0.25, std 0.5 -> 1, -1, 0
    assert step.tolist() == approx([0.707107, 0.0, 1.0, -0.707107, -1.0, 0.0])
    episode = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    # 1 + 0.5 * [0.707107, 0, 1] ; -1 + 0.5 * [-0.707107, -1, 0]
    assert gigpo_advantages(episode, step, omega=0.5).tolist() == approx([1.353553, 1.0, 1.5, -1.353553, -1.5, -1.0])


# ---------------------------------------------------------------- the key property
def test_serl_with_lambda_zero_is_grpo_loss_and_gradient():
    g = torch.Generator().manual_seed(0)
    B, T = 8, 12
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    logp_old = logp.detach() + 0.3 * torch.randn(B, T, generator=g)
    logp_teacher = logp_old + torch.randn(B, T, generator=g)
    logp_ref = logp_old + 0.1 * torch.randn(B, T, generator=g)
    adv = group_advantages(torch.randint(0, 2, (B,), generator=g).float(), torch.arange(B) // 4)
    mask = (torch.arange(T) >= 4).expand(B, T) & (torch.rand(B, T, generator=g) > 0.1)
    selected = mask & (torch.rand(B, T, generator=g) > 0.5)
    w = hindsight_weights(logp_teacher, logp_old, adv)
    kw = dict(logp_ref=logp_ref, kl_coef=0.05)

    def loss_and_grad(weights):
        loss, _ = policy_loss(logp, logp_old, adv, mask, weights=weights, **kw)
        return loss, torch.autograd.grad(loss, logp)[0]

    grpo_loss, grpo_grad = loss_and_grad(None)
    serl_loss, serl_grad = loss_and_grad(apply_placement(blend_weights(w, mixing_lambda(50)), selected))
    assert torch.equal(serl_loss, grpo_loss) and torch.equal(serl_grad, grpo_grad)
    # Not vacuous: with lambda = 0.5 the same batch gives a different gradient.
    _, g_half = loss_and_grad(apply_placement(blend_weights(w, 0.5), selected))
    assert not torch.allclose(g_half, grpo_grad)


def test_advantage_mass_moved_hand_values():
    """sum |A (w - 1)| / sum |A| over every action token; a turn with no weights counts at w = 1."""
    from serl_cli.algos.objectives import _annotation_stats
    from serl_cli.artifacts.records import make_annotation

    ann = [
        make_annotation(
            selected=True, weights=[1.2, 1.0], action_mask=[1, 1], log_ratio_mean=-0.5, teacher_logprobs=[-1.0, -0.1]
        ),
        make_annotation(selected=False, weights=None, action_mask=[1], log_ratio_mean=None, teacher_logprobs=None),
        make_annotation(
            selected=True, weights=[0.9, 5.0], action_mask=[1, 0], log_ratio_mean=0.2, teacher_logprobs=[-0.2, -0.3]
        ),
    ]
    adv = torch.tensor([0.5, -2.0, -1.0])
    stats = _annotation_stats(ann, adv, {"weight_clip": 0.2}, {"lambda": 1.0})
    # moved: 0.5 * 0.2 + 0.5 * 0 + 2 * 0 + 1 * 0.1 = 0.2 (the masked 5.0 is not an action token);
    # total: 0.5 + 0.5 + 2 + 1 = 4
    assert stats["advantage_mass_moved"] == pytest.approx(0.05)
    assert _annotation_stats(ann[1:2], adv[1:2], {}, {})["advantage_mass_moved"] == 0.0
