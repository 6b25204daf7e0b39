"""The off-policy correction (train.offpolicy): the weight pi_prox / pi_behav of each token's
policy-gradient term, truncated (tis) or masked (mis), per token, turn or episode. Hand-worked
weights first, then the loss, the settings, and an online run on the tiny model."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace

import pytest
import torch

from serl_cli.algos import core
from serl_cli.artifacts.schema import read_rollouts
from serl_cli.errors import SerlError
from serl_cli.online.config import OnlineConfig
from serl_cli.online.loop import run_online
from serl_cli.stages.rollout import run_rollout
from serl_cli.training.learner import Learner
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import (
    OffPolicyConfig,
    TrainConfig,
    check_train_config,
    recompute_enabled,
    resolve_correction,
)

# Three turns (rows), right-aligned like a micro-batch; rows 0 and 1 are one episode, row 2 another.
# pi_behav = 1 everywhere (log 0), so each token's ratio pi_prox / pi_behav is the number written:
#   row 0: 0.4  1.5  3.0
#   row 1:  -   1.0  2.5     (first column is padding)
#   row 2:  -   0.8  0.9
RATIOS = [[0.4, 1.5, 3.0], [1.0, 1.0, 2.5], [1.0, 0.8, 0.9]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
EPISODES = torch.tensor([0, 0, 1])
PROX = torch.tensor(RATIOS, dtype=torch.float64).log()
BEHAV = torch.zeros(3, 3, dtype=torch.float64)
N = 7  # masked-in tokens


def weights(correction, level):
    return core.offpolicy_weights(PROX, BEHAV, MASK, correction, level, episode_ids=EPISODES)


# Each case: the weight of every masked-in token, row by row (padding is 1), the mean weight over
# the 7 tokens, the clipped fraction (tis: ratio > 2) and the masked fraction (mis: outside [0.5, 2]).
HAND = {
    # token: each ratio alone. tis caps 3.0 and 2.5 at 2; mis zeroes 0.4, 3.0, 2.5
    ("tis", "token"): ([[0.4, 1.5, 2.0], [1, 1.0, 2.0], [1, 0.8, 0.9]], (0.4 + 1.5 + 2 + 1 + 2 + 0.8 + 0.9) / 7, 2, 0),
    ("mis", "token"): ([[0.0, 1.5, 0.0], [1, 1.0, 0.0], [1, 0.8, 0.9]], (1.5 + 1 + 0.8 + 0.9) / 7, 0, 3),
    # turn: the product of the row's ratios. row 0: 0.4 * 1.5 * 3 = 1.8; row 1: 1 * 2.5 = 2.5; row 2: 0.72
    ("tis", "turn"): ([[1.8] * 3, [1, 2.0, 2.0], [1, 0.72, 0.72]], (3 * 1.8 + 2 * 2 + 2 * 0.72) / 7, 2, 0),
    ("mis", "turn"): ([[1.8] * 3, [1, 0.0, 0.0], [1, 0.72, 0.72]], (3 * 1.8 + 2 * 0.72) / 7, 0, 2),
    # episode: rows 0 and 1 together, 1.8 * 2.5 = 4.5 (capped at 2 / masked); row 2 alone, 0.72
    ("tis", "episode"): ([[2.0] * 3, [1, 2.0, 2.0], [1, 0.72, 0.72]], (5 * 2 + 2 * 0.72) / 7, 5, 0),
    ("mis", "episode"): ([[0.0] * 3, [1, 0.0, 0.0], [1, 0.72, 0.72]], (2 * 0.72) / 7, 0, 5),
}


@pytest.mark.parametrize("correction,level", sorted(HAND))
def test_tis_and_mis_weights_by_hand(correction, level):
    expected, mean, clipped, masked = HAND[(correction, level)]
    w, stats = weights(correction, level)
    assert w.flatten().tolist() == pytest.approx([x for row in expected for x in row], abs=1e-12)
    assert not w.requires_grad
    assert stats["is_weight_mean"] == pytest.approx(mean, abs=1e-12)
    assert stats["is_clipped_frac"] == pytest.approx(clipped / N)
    assert stats["is_masked_frac"] == pytest.approx(masked / N)


def test_the_mismatch_is_k1_and_k3_of_kl_behav_to_prox():
    """k1 = mean log(pi_behav / pi_prox) = -mean log r; k3 = mean (r - 1 - log r), whatever the correction."""
    r = [0.4, 1.5, 3.0, 1.0, 2.5, 0.8, 0.9]
    for correction in ("none", "tis", "mis"):
        _, stats = weights(correction, "token")
        assert stats["logp_mismatch_k1"] == pytest.approx(-math.log(3.24) / 7)  # product of the ratios: 3.24
        assert stats["logp_mismatch_k3"] == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 7)


def test_none_weighs_one_and_caps_are_settings():
    w, stats = weights("none", "token")
    assert torch.equal(w, torch.ones(3, 3, dtype=torch.float64)) and stats["is_weight_mean"] == 1.0
    w, _ = core.offpolicy_weights(PROX, BEHAV, MASK, "tis", "token", tis_cap=2.75)
    assert w[0, 2].item() == pytest.approx(2.75) and w[1, 2].item() == pytest.approx(2.5)
    w, _ = core.offpolicy_weights(PROX, BEHAV, MASK, "mis", "token", mis_low=0.3, mis_high=5.0)
    assert w[MASK.bool()].tolist() == pytest.approx([0.4, 1.5, 3.0, 1.0, 2.5, 0.8, 0.9])


def test_a_masked_token_stays_in_the_token_count():
    """Three tokens, ratio to pi_old 1, A = 1: each token's term is -1. MIS zeroes the middle one's
    weight: the loss is -(1 + 0 + 1) / 3, not / 2, and that token has no gradient."""
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = core.policy_loss(
        logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3), is_weights=torch.tensor([[1.0, 0.0, 1.0]])
    )
    loss.backward()
    assert loss.item() == pytest.approx(-2 / 3)
    assert logp.grad[0].tolist() == pytest.approx([-1 / 3, 0.0, -1 / 3])


def _loss_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = 4, 6
    logp_old = -torch.rand(b, t, generator=g) * 3
    logp = (logp_old + 0.3 * torch.randn(b, t, generator=g)).requires_grad_()
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    adv = torch.randn(b, generator=g)
    w = 1 + 0.2 * torch.randn(b, t, generator=g)
    return logp, logp_old, adv, mask, w


@pytest.mark.parametrize("correction", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "turn", "episode"])
def test_with_behav_equal_to_prox_the_corrected_loss_is_the_plain_one_bit_for_bit(correction, level):
    logp, logp_old, adv, mask, w = _loss_inputs()
    kw = {"weights": w, "dual_clip": 3.0, "num_tokens": 30.0, "entropy": None}
    plain, _ = core.policy_loss(logp, logp_old, adv, mask, **kw)
    (grad_plain,) = torch.autograd.grad(plain, logp)
    is_w, stats = core.offpolicy_weights(
        logp_old, logp_old.clone(), mask, correction, level, episode_ids=torch.tensor([0, 0, 1, 1])
    )
    assert stats["is_weight_mean"] == 1.0 and stats["is_clipped_frac"] == stats["is_masked_frac"] == 0.0
    corrected, _ = core.policy_loss(logp, logp_old, adv, mask, is_weights=is_w, **kw)
    (grad_corrected,) = torch.autograd.grad(corrected, logp)
    assert torch.equal(plain, corrected) and torch.equal(grad_plain, grad_corrected)


def test_no_correction_is_the_loss_of_before_bit_for_bit():
    """The loss and gradient of fixed inputs as the code gave them before the correction existed
    (recorded as float hex from that commit): correction none passes no weights, so nothing moved."""
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.4, -1.5], [-0.3, -1.6, 0.0]])
    w = torch.tensor([[1.0, 1.1, 0.9], [1.0, 0.8, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, _ = core.policy_loss(logp, old, torch.tensor([0.7, -1.3]), mask, weights=w, dual_clip=3.0, num_tokens=6.0)
    loss.backward()
    assert loss.item().hex() == "0x1.5501560000000p-3"
    before = ["-0x1.080fec0000000p-3", "-0x1.dba17c0000000p-4", "-0x1.04db520000000p-4"]
    before += ["0x1.bbbbbc0000000p-3", "0x1.08c9f60000000p-2", "0x0.0p+0"]
    assert [x.hex() for x in logp.grad.flatten().tolist()] == before


# ------------------------------------------------------------------------------ settings
def _cfg(**offpolicy) -> TrainConfig:
    return TrainConfig(device="cpu", offpolicy=OffPolicyConfig(**offpolicy))


def test_auto_resolves_by_staleness_through_one_function():
    assert resolve_correction(OffPolicyConfig()) == ("none", "token")  # every serl loop today: staleness 0
    assert resolve_correction(OffPolicyConfig(), staleness=1) == ("tis", "token")
    assert resolve_correction(OffPolicyConfig(level="turn"), staleness=2) == ("tis", "turn")
    assert resolve_correction(OffPolicyConfig(correction="mis", level="episode")) == ("mis", "episode")
    assert resolve_correction(OffPolicyConfig(correction="none"), staleness=3) == ("none", "token")


def test_a_correction_turns_the_recompute_on_and_refuses_it_off():
    assert not recompute_enabled(_cfg(), "hf")  # auto at staleness 0: nothing changes on fp32 hf rollouts
    assert recompute_enabled(_cfg(correction="tis"), "hf") and recompute_enabled(_cfg(correction="mis"), None)
    check_train_config(_cfg(correction="tis"))
    check_train_config(replace(_cfg(correction="none"), recompute_logp_old=False))
    with pytest.raises(
        SerlError,
        match=r"^train.offpolicy.correction mis weighs by the trainer's recomputed pi_old: "
        r"set train.recompute_logp_old to null or true$",
    ):
        check_train_config(replace(_cfg(correction="mis"), recompute_logp_old=False))
    with pytest.raises(
        SerlError, match=r"^train.offpolicy.correction tis needs behaviour log-probs: --algo sft has none$"
    ):
        check_train_config(replace(_cfg(correction="tis"), algo="sft"))


@pytest.mark.parametrize(
    "settings,needle",
    [
        ({"tis_cap": 0.5}, r"train.offpolicy.tis_cap must be a number of at least 1, got 0.5"),
        ({"mis_low": 1.5}, r"must bracket 1 \(0 <= low <= 1 <= high\), got \[1.5, 2.0\]"),
        ({"mis_high": float("nan")}, r"must bracket 1"),
        ({"level": "batch"}, r"unknown train.offpolicy.level 'batch': choose one of token, turn, episode"),
        ({"correction": "ppo"}, r"unknown train.offpolicy.correction 'ppo': choose one of auto, none, tis, mis"),
    ],
)
def test_bad_correction_settings_are_one_line(settings, needle):
    with pytest.raises(SerlError, match=needle):
        check_train_config(_cfg(**settings))


# ------------------------------------------------------------------------------ on the tiny model
@pytest.fixture(scope="module")
def episodes(stopping_model_dir, tmp_path_factory):
    from support import rollout_config

    run = tmp_path_factory.mktemp("offpolicy") / "run"
    run_rollout(rollout_config(stopping_model_dir, run, max_new_tokens=10))
    eps = read_rollouts(run)
    for ep in eps:
        if ep.rollout_index == 0:
            ep.reward, ep.success = 1.0, True
    return eps


def test_the_weight_reaches_the_update(episodes, stopping_model_dir):
    """Engine log-probs 0.05 below the trainer's (a skewed engine): every token's ratio is
    e^0.05, so token TIS multiplies the PPO term by e^0.05 (lr 0: the policy is pi_prox), turn
    MIS keeps only the turns whose product stays in [0.5, 2], and the metrics say so."""
    skewed = copy.deepcopy(episodes)
    for e in skewed:
        for t in e.turns:
            t.behaviour_logprobs = [x - 0.05 for x in t.behaviour_logprobs]

    def update(**offpolicy):
        # on the CPU in fp32 wherever the suite runs: the trainer's numerics are then the hf engine's
        cfg = TrainConfig(device="cpu", optim=OptimConfig(lr=0.0), threads=1, offpolicy=OffPolicyConfig(**offpolicy))
        return Learner(str(stopping_model_dir), cfg).update(copy.deepcopy(skewed), 1.0, engine="vllm")

    plain, tis = update(correction="none"), update(correction="tis")
    assert "is_weight_mean" not in plain and plain["logp_mismatch_k1"] == pytest.approx(-0.05, abs=1e-4)
    assert tis["logp_mismatch_k3"] == pytest.approx(math.exp(0.05) - 1 - 0.05, rel=1e-2)
    assert tis["is_weight_mean"] == pytest.approx(math.exp(0.05), abs=1e-4) and tis["is_clipped_frac"] == 0.0
    assert tis["pg_loss"] == pytest.approx(math.exp(0.05) * plain["pg_loss"], rel=1e-4)
    for key in ("clip_frac", "ratio_mean", "approx_kl", "turns_with_gradient"):  # the PPO ratio is untouched
        assert tis[key] == plain[key]
    mis = update(correction="mis", level="turn", mis_high=1.3)
    lengths = [len(t.action_ids) for e in skewed for t in e.turns]
    kept = sum(n for n in lengths if n <= 5)  # a turn's ratio e^(0.05 n) is above 1.3 from n = 6 tokens on
    assert 0 < kept < sum(lengths)
    assert mis["is_masked_frac"] == pytest.approx(1 - kept / sum(lengths))


def test_online_run_with_tis_writes_the_mismatch_metrics(stopping_model_dir, tmp_path):
    """correction tis on hf rollouts: the recompute is turned on by it (recompute_logp_old null),
    and every iteration's metrics carry the mismatch and the weights' statistics."""
    cfg = OnlineConfig()
    cfg.env.settings, cfg.env.max_turns = {"catalog": "synthetic"}, 2
    cfg.model, cfg.iterations, cfg.out = str(stopping_model_dir), 1, str(tmp_path / "run")
    cfg.rollout.tasks, cfg.rollout.group_size, cfg.rollout.threads = 1, 2, 1
    cfg.rollout.sampling.max_new_tokens = 8
    tis = OffPolicyConfig(correction="tis")
    cfg.train = TrainConfig(algo="grpo", device="cpu", threads=1, optim=OptimConfig(lr=0.0), offpolicy=tis)
    run_online(cfg)
    m = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert m["logp_old_recomputed_turns"] == m["turns"]
    # hf in fp32: the engine's numerics are the trainer's, so the weights are 1 to float precision
    assert abs(m["logp_mismatch_k1"]) < 1e-5 and 0 <= m["logp_mismatch_k3"] < 1e-8
    assert m["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["is_clipped_frac"] == 0.0 and m["is_masked_frac"] == 0.0


def test_plot_draws_the_mismatch_and_weight_panels_only_when_logged():
    from serl_cli.views.plot import drawn_panels

    plain = [{"iteration": i, "loss": 1.0} for i in range(3)]
    corrected = [{**r, "logp_mismatch_k1": 0.01, "logp_mismatch_k3": 1e-4, "is_weight_mean": 1.0} for r in plain]
    assert [t for t, _ in drawn_panels(plain, "iteration")] == ["loss"]
    panels = dict(drawn_panels(corrected, "iteration"))
    assert [k for k, _ in panels["engine mismatch"]] == ["logp_mismatch_k1", "logp_mismatch_k3"]
    assert [k for k, _ in panels["off-policy weights"]] == ["is_weight_mean"]
