"""The training settings that configure baselines as the paper ran them (docs/PARITY.md), and
what keeps the update right: distillation scale under mini-batches, environment
faults, pi_old recomputed by the trainer. Pure math first, then the learner on a tiny model."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from support import rollout_config, turn_sample

from serl_cli import config as cfgmod
from serl_cli.algos import core
from serl_cli.algos.batch import make_micro_batches
from serl_cli.algos.objectives import UpdateInputs, episode_advantages, get_objective, turn_advantages
from serl_cli.artifacts.records import make_annotation
from serl_cli.artifacts.schema import read_rollouts, turn_samples
from serl_cli.errors import SerlError
from serl_cli.models.loading import load_model
from serl_cli.online.config import OnlineConfig
from serl_cli.online.derive import eval_config
from serl_cli.online.loop import run_online
from serl_cli.stages.evaluate import eval_sampling
from serl_cli.stages.rollout import run_rollout
from serl_cli.training.learner import Learner
from serl_cli.training.step import OptimConfig, action_logprobs
from serl_cli.training.train_config import TrainConfig, check_train_config, recompute_enabled

ROOT = Path(__file__).parent.parent


# ------------------------------------------------------------------------------ pure math
def test_dual_clip_hand_values():
    # one token each: A = -1 with ratio 5 (capped at c = 3), A = -1 with ratio 2, A = +1 with ratio 5
    logp_old = torch.zeros(3, 1)
    logp = torch.log(torch.tensor([[5.0], [2.0], [5.0]]))
    adv, mask = torch.tensor([-1.0, -1.0, 1.0]), torch.ones(3, 1)
    loss, stats = core.ppo_clip_loss(logp, logp_old, adv, None, mask, 0.2, dual_clip=3.0)
    # tokens: min(max(5, 1.2), 3) = 3 ; min(max(2, 1.2), 3) = 2 ; -min(5, 1.2) = -1.2
    assert loss.item() == pytest.approx((3 + 2 - 1.2) / 3)
    assert stats["dual_clip_frac"] == pytest.approx(1 / 3)
    plain, plain_stats = core.ppo_clip_loss(logp, logp_old, adv, None, mask, 0.2)
    assert plain.item() == pytest.approx((5 + 2 - 1.2) / 3) and "dual_clip_frac" not in plain_stats


def test_entropy_term_is_a_token_mean_bonus():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    entropy = torch.tensor([[0.5, 1.5]], requires_grad=True)
    mask = torch.ones(1, 2)
    base, _ = core.policy_loss(logp, logp.detach(), torch.tensor([1.0]), mask, num_tokens=4.0)
    loss, stats = core.policy_loss(
        logp, logp.detach(), torch.tensor([1.0]), mask, num_tokens=4.0, entropy=entropy, entropy_coef=0.001
    )
    assert stats["entropy"] == pytest.approx(2.0 / 4)
    assert (loss - base).item() == pytest.approx(-0.001 * 0.5, abs=1e-7)
    loss.backward()
    assert entropy.grad[0].tolist() == pytest.approx([-0.001 / 4, -0.001 / 4])  # the bonus is differentiated


def _turn(ep, group, reward, *, invalid=False, state="s", turn_reward=0.0):
    return turn_sample(ep, reward, group=group, state=state, turn_reward=turn_reward, invalid=invalid)


def test_invalid_penalty_per_episode_and_across_steps_by_hand():
    # group: episode 0 won with one invalid turn out of 2; episode 1 lost, both turns valid
    s = [_turn(0, 0, 1.0, invalid=True), _turn(0, 0, 1.0), _turn(1, 0, 0.0), _turn(1, 0, 0.0)]
    episode = turn_advantages(s, TrainConfig(invalid_action_penalty=0.1))
    # scores 0.9 and 0.0: mean 0.45, Bessel std 0.6364 -> +-0.7071 (any two distinct values)
    assert episode.tolist() == pytest.approx([0.707106, 0.707106, -0.707106, -0.707106], abs=1e-5)
    cross = turn_advantages(s, TrainConfig(invalid_action_penalty=0.1, group_norm="cross_steps"))
    # scores 0.9, 1.0, 0, 0: mean 0.475, std sqrt((0.180625+0.275625+2*0.225625)/3) = 0.550000
    assert cross.tolist() == pytest.approx([0.425 / 0.55, 0.525 / 0.55, -0.475 / 0.55, -0.475 / 0.55], abs=1e-5)
    # defaults: exactly serl's episode advantage, no penalty
    assert torch.equal(turn_advantages(s, TrainConfig()), episode_advantages(s, 1e-6))
    assert turn_advantages(s, TrainConfig()).tolist() == pytest.approx(
        [0.707106, 0.707106, -0.707106, -0.707106], abs=1e-5
    )
    # the authors' reward scale: 10 for a win, the same 0.1 penalty weighs ten times less
    scaled = turn_advantages(s, TrainConfig(invalid_action_penalty=0.1, group_norm="cross_steps", success_reward=10.0))
    # scores 9.9, 10, 0, 0: mean 4.975, std 5.744780
    assert scaled.tolist() == pytest.approx(
        [4.925 / 5.744780, 5.025 / 5.744780, -4.975 / 5.744780, -4.975 / 5.744780], abs=1e-5
    )
    with pytest.raises(SerlError, match="group_norm"):
        turn_advantages(s, TrainConfig(group_norm="steps"))


def test_gigpo_mean_norm_subtracts_the_mean_only():
    # two episodes of one group, two turns each, both turns in one anchor state per step
    s = [
        _turn(0, 0, 1.0, state="a", turn_reward=0.0),
        _turn(0, 0, 1.0, state="b", turn_reward=1.0),
        _turn(1, 0, 0.0, state="a", turn_reward=0.0),
        _turn(1, 0, 0.0, state="b", turn_reward=0.0),
    ]
    s[1].turn, s[3].turn = 1, 1
    gigpo = get_objective("gigpo")
    mean_norm = gigpo.prepare(s, UpdateInputs([]), TrainConfig(algo="gigpo", gigpo_mode="mean_norm", gamma=0.5))
    # episode: 1 - 0.5 = +0.5 / -0.5 ; step returns: a: 0.5 vs 0 -> +-0.25, b: 1 vs 0 -> +-0.5
    assert mean_norm.advantages.tolist() == pytest.approx([0.75, 1.0, -0.75, -1.0])
    std_norm = gigpo.prepare(s, UpdateInputs([]), TrainConfig(algo="gigpo", gamma=0.5))
    assert std_norm.advantages.tolist() == pytest.approx([1.414213, 1.414213, -1.414213, -1.414213], abs=1e-5)


def test_settings_are_checked_before_anything_loads():
    for bad, match in [
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"entropy_coef": -1.0}, "entropy_coef"),
        ({"group_norm": "turn"}, "group_norm"),
        ({"gigpo_mode": "std"}, "gigpo_mode"),
        ({"mini_batch_turns": -2}, "mini_batch_turns"),
        ({"mini_batches": 0}, "mini_batches"),
    ]:
        with pytest.raises(SerlError, match=match):
            check_train_config(TrainConfig(**bad))
    cpu = TrainConfig(device="cpu")
    assert recompute_enabled(cpu, "vllm") and not recompute_enabled(cpu, "hf")
    assert not recompute_enabled(cpu, None)
    assert recompute_enabled(TrainConfig(recompute_logp_old=True), "hf")
    assert not recompute_enabled(TrainConfig(recompute_logp_old=False), "vllm")
    # hf in half precision: the trainer's own (the online loop's engine is its model), or the rollout's
    assert recompute_enabled(TrainConfig(device="cpu", dtype="bf16"), "hf")
    assert recompute_enabled(TrainConfig(device="cpu", dtype="fp16", backend="deepspeed"), "hf")
    assert not recompute_enabled(TrainConfig(device="cpu", backend="deepspeed"), "hf")  # auto: fp32 on a CPU
    assert recompute_enabled(cpu, "hf", rollout_half=True) and not recompute_enabled(cpu, "hf", rollout_half=False)
    assert not recompute_enabled(TrainConfig(device="cpu", dtype="bf16", recompute_logp_old=False), "hf")


def test_online_eval_samples_at_its_temperature():
    cfg = OnlineConfig()
    assert eval_sampling(eval_config(cfg, "out")).temperature == 0.0  # greedy by default, as before
    cfg.eval.temperature = 0.4
    s = eval_sampling(eval_config(cfg, "out"))
    assert (s.temperature, s.top_p, s.max_new_tokens) == (0.4, 1.0, cfg.rollout.sampling.max_new_tokens)


# ------------------------------------------------------------------------------ on a tiny model
@pytest.fixture(scope="module")
def episodes(stopping_model_dir, tmp_path_factory):
    """2 tasks x 3 rollouts of the tiny model (hf engine, T = 1); rollouts 0 succeed."""
    run = tmp_path_factory.mktemp("settings") / "run"
    run_rollout(rollout_config(stopping_model_dir, run, max_new_tokens=10))
    eps = read_rollouts(run)
    for ep in eps:
        if ep.rollout_index == 0:
            ep.reward, ep.success = 1.0, True
    return eps


def _learner(model_dir, **train) -> Learner:
    cfg = TrainConfig(optim=OptimConfig(lr=0.0, micro_batch_tokens=600), threads=1, **train)
    return Learner(str(model_dir), cfg)


def _fake_sdpo_annotations(eps, seed=0):
    """One record per turn, as `serl annotate` writes them for sdpo: every turn of a failed
    rollout carries the distillation term toward a teacher a little off the student."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in turn_samples(eps):
        lp = torch.tensor(s.behaviour_logprobs) + 0.3 * torch.randn(len(s.action_ids), generator=g)
        out.append(
            make_annotation(
                episode=s.episode,
                selected=True,
                hindsight="x",
                action_mask=[1] * len(s.action_ids),
                teacher_logprobs=lp.tolist(),
                log_ratio_mean=0.0,
                distill=not s.success,
            )
        )
    return out


def test_distillation_scale_does_not_depend_on_mini_batches(episodes, stopping_model_dir):
    """Bug: with M mini-batches the distillation term was divided by the whole batch's
    distillation-token count while PPO's was divided by the mini-batch's, shrinking
    distill_coef by M. With lr 0 every step sees the same policy, so each step's term is a
    mean over its tokens and the mean over steps must not move with M."""
    ann = _fake_sdpo_annotations(episodes)
    meta = {"config": {"skip_zero_advantage": False}, "stats": {}}
    kl = {}
    for m in (1, 2, 3):
        learner = _learner(stopping_model_dir, algo="sdpo", distill_coef=1.0, mini_batches=m)
        metrics = learner.update(copy.deepcopy(episodes), 1.0, ann, meta)
        assert metrics["optimizer_steps"] == m
        kl[m] = metrics["distill_kl"]
    assert kl[1] > 0
    assert kl[2] == pytest.approx(kl[1], rel=1e-5) and kl[3] == pytest.approx(kl[1], rel=1e-5)


def test_mini_batch_turns_sets_the_optimizer_steps(episodes, stopping_model_dir):
    turns = len(turn_samples(episodes))
    learner = _learner(stopping_model_dir, algo="grpo", mini_batch_turns=4)
    metrics = learner.update(copy.deepcopy(episodes), 1.0)
    assert metrics["optimizer_steps"] == -(-turns // 4)  # ceil(turns / 4): the authors' ppo_mini_batch_size


def test_update_reports_its_micro_batches_and_trains_the_same(episodes, stopping_model_dir):
    """progress(done, total) over the update's micro-batches (the `serl train RUN` bar): from 0,
    never back, ending full; the update itself is the one without it."""
    calls = []
    settings = {"algo": "grpo", "epochs": 2, "mini_batches": 2}
    with_bar = _learner(stopping_model_dir, **settings).update(
        copy.deepcopy(episodes), 1.0, progress=lambda d, t: calls.append((d, t))
    )
    plain = _learner(stopping_model_dir, **settings).update(copy.deepcopy(episodes), 1.0)
    total = calls[0][1]
    assert calls[0] == (0, total) and calls[-1] == (total, total) and {t for _, t in calls} == {total}
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and len(calls) == total + 1  # one per micro-batch
    assert total >= with_bar["optimizer_steps"] == 4  # 2 epochs x 2 mini-batches, micro-batched at 600 tokens
    with_bar.pop("timing"), plain.pop("timing")
    assert with_bar == plain


def test_update_bar_draws_on_a_terminal_only():
    import io

    from rich.console import Console

    from serl_cli.cli.train import update_bar

    def drive(console, quiet=False):
        with update_bar(console, quiet) as progress:
            for done in range(4):
                progress(done, 3)
        return console.file.getvalue()

    shown = drive(Console(file=io.StringIO(), force_terminal=True, width=120))
    assert "update" in shown and "3/3" in shown and "micro-batches" in shown
    assert drive(Console(file=io.StringIO(), force_terminal=True, width=120), quiet=True) == ""  # -q
    assert drive(Console(file=io.StringIO(), force_terminal=False, width=120)) == ""  # a log file


def _with_faults(episodes):
    eps = copy.deepcopy(episodes)
    crashed = eps[1]  # a rollout of task 0 that the environment broke mid-way: reward 0, cut short
    crashed.reward, crashed.success, crashed.truncated = 0.0, False, True
    crashed.error = "environment raised ValueError: corrupt state"
    # and one that failed at reset: no turns
    reset = replace(eps[2], turns=[], num_turns=0, reward=0.0, success=False, error="environment timed out")
    eps.append(reset)
    return eps, len(crashed.turns)


def test_faulted_episodes_are_out_of_the_groups_and_the_loss(episodes, stopping_model_dir):
    """Bug: an episode the environment crashed or timed out stayed in its GRPO group with
    reward 0 and a negative advantage. Now it is out of the statistics and the loss, and
    the metrics count it (reset failures included)."""
    eps, crashed_turns = _with_faults(episodes)
    learner = _learner(stopping_model_dir, algo="grpo")
    metrics = learner.update(eps, 1.0)
    clean = [e for e in eps if not e.error]
    assert metrics["faulted_episodes"] == 2 and metrics["faulted_turns"] == crashed_turns
    assert metrics["turns"] == len(turn_samples(clean))
    # the others' advantages are those of the group without the faulted episode
    reference = _learner(stopping_model_dir, algo="grpo").update(clean, 1.0)
    assert metrics["mean_abs_advantage"] == pytest.approx(reference["mean_abs_advantage"])
    assert metrics["pg_loss"] == pytest.approx(reference["pg_loss"], rel=1e-5)
    adv = turn_advantages(turn_samples(eps), TrainConfig())
    assert all(a == 0 for a, s in zip(adv.tolist(), turn_samples(eps), strict=True) if s.faulted)


def test_recomputed_pi_old_matches_hf_rollouts_and_reports_the_mismatch(episodes, stopping_model_dir):
    """pi_old by the trainer (the vLLM path's fix), forced on for hf rollouts: the hf engine's
    own log-probs are the trainer's numerics, so they agree to 1e-4, and the metrics say so."""
    eps = copy.deepcopy(episodes)
    stored = [list(t.behaviour_logprobs) for e in eps for t in e.turns]
    learner = _learner(stopping_model_dir, algo="grpo", recompute_logp_old=True)
    metrics = learner.update(eps, 1.0)
    recomputed = [t.behaviour_logprobs for e in eps for t in e.turns]
    assert [t.engine_logprobs for e in eps for t in e.turns] == stored
    for a, b in zip(recomputed, stored, strict=True):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    assert metrics["logp_old_recomputed_turns"] == len(stored)
    assert 0 < metrics["logp_mismatch_max"] < 1e-4 and metrics["logp_mismatch_mean"] <= metrics["logp_mismatch_max"]
    # not recomputed by default on hf rollouts: no such metrics, the stored log-probs stand
    default = _learner(stopping_model_dir, algo="grpo").update(copy.deepcopy(episodes), 1.0)
    assert "logp_mismatch_max" not in default
    # an engine whose log-probs are off: the mismatch shows, and the update uses the trainer's
    skewed = copy.deepcopy(episodes)
    for e in skewed:
        for t in e.turns:
            t.behaviour_logprobs = [x - 0.05 for x in t.behaviour_logprobs]
    m = _learner(stopping_model_dir, algo="grpo").update(skewed, 1.0, engine="vllm")
    assert m["logp_mismatch_mean"] == pytest.approx(0.05, abs=1e-4)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # lr 0: the trainer's pi_old is the policy


def test_entropy_is_computed_only_when_asked_and_leaves_logp_alone(episodes, stopping_model_dir):
    model, tokenizer = load_model(str(stopping_model_dir))
    model.eval()
    samples = turn_samples(episodes)[:3]
    mb = make_micro_batches(samples, [0, 1, 2], 10_000, tokenizer.pad_token_id)[0]
    with torch.no_grad():
        plain = action_logprobs(model, mb)
        logp, ent = action_logprobs(model, mb, entropy=True)
        logits = (
            model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
            .logits[:, -mb.reply_ids.shape[1] - 1 : -1]
            .float()
        )
    assert torch.equal(plain, logp)
    p = torch.softmax(logits, -1)
    manual = -(p * torch.log_softmax(logits, -1)).sum(-1) * mb.reply_mask
    torch.testing.assert_close(ent, manual, rtol=1e-4, atol=1e-5)
    learner = _learner(stopping_model_dir, algo="grpo", entropy_coef=0.001, dual_clip=3.0)
    metrics = learner.update(copy.deepcopy(episodes), 1.0)
    assert metrics["entropy"] > 0 and "dual_clip_frac" in metrics


def test_entropy_bonus_trains_zero_advantage_turns(episodes, stopping_model_dir):
    """The entropy bonus covers every row of the batch (the authors' entropy_loss over the whole
    response mask): a batch whose groups all have equal rewards (A = 0 everywhere) still moves
    the policy, toward higher entropy, and every turn counts as having a gradient."""
    flat = copy.deepcopy(episodes)
    for ep in flat:
        ep.reward, ep.success = 0.0, False  # every group ties: A = 0 on every turn
    learner = _learner(stopping_model_dir, algo="grpo", entropy_coef=0.01)
    learner.optimizer.param_groups[0]["lr"] = 1e-3
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    metrics = learner.update(flat, 1.0)
    assert metrics["mean_abs_advantage"] == 0.0
    assert metrics["turns_with_gradient"] == metrics["turns"] > 0 and metrics["optimizer_steps"] == 1
    moved = sum((v - before[k]).abs().sum().item() for k, v in learner.model.state_dict().items())
    assert moved > 0
    # without the bonus the same batch has no gradient at all
    plain = _learner(stopping_model_dir, algo="grpo")
    assert plain.update(copy.deepcopy(flat), 1.0)["turns_with_gradient"] == 0


def test_online_loop_recomputes_pi_old_before_the_update(stopping_model_dir, tmp_path):
    cfg = OnlineConfig()
    cfg.env.settings, cfg.env.max_turns = {"catalog": "synthetic"}, 2
    cfg.model, cfg.iterations, cfg.out = str(stopping_model_dir), 1, str(tmp_path / "run")
    cfg.rollout.tasks, cfg.rollout.group_size, cfg.rollout.threads = 1, 2, 1
    cfg.rollout.sampling.max_new_tokens = 8
    cfg.train = TrainConfig(algo="grpo", recompute_logp_old=True, threads=1, optim=OptimConfig(lr=0.0))
    run_online(cfg)
    m = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert m["logp_old_recomputed_turns"] == m["turns"] and m["logp_mismatch_max"] < 1e-4
    assert m["faulted_episodes"] == 0


# ------------------------------------------------------------------------------ paper configs
PAPER = sorted((ROOT / "experiments").glob("*/paper/*.yaml"))


def test_every_experiment_config_loads():
    """Every run config under experiments/ (not the grids: tests/test_ablate.py loads those)."""
    files = [f for f in sorted((ROOT / "experiments").rglob("*.yaml")) if f.parent.name not in ("ablations", "study")]
    assert len(PAPER) == 6 and set(PAPER) <= set(files)
    for f in files:
        cfgmod.from_dict(OnlineConfig, cfgmod.load_yaml(f), f.stem)


@pytest.mark.parametrize("path", PAPER, ids=lambda p: f"{p.parent.parent.name}-{p.stem}")
def test_paper_configs_pass_the_train_checks(path):
    """Their train section is one the backend takes: DeepSpeed's, so this needs the deepspeed extra."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (serl[deepspeed]): the paper configs use it")
    check_train_config(cfgmod.from_dict(OnlineConfig, cfgmod.load_yaml(path), path.stem).train)


@pytest.mark.parametrize("path", PAPER, ids=lambda p: f"{p.parent.parent.name}-{p.stem}")
def test_paper_configs_carry_the_authors_launch_settings(path):
    cfg = cfgmod.from_dict(OnlineConfig, cfgmod.load_yaml(path), path.stem)
    env = path.parent.parent.name
    assert cfg.train.algo == path.stem and cfg.env.name == env
    assert (cfg.rollout.tasks, cfg.rollout.group_size, cfg.rollout.prompt.history_turns) == (16, 8, 2)
    assert cfg.env.max_turns == {"webshop": 15, "alfworld": 50}[env]
    assert cfg.train.mini_batch_turns == {"webshop": 64, "alfworld": 256}[env]
    assert cfg.train.optim.lr == 1e-6 and cfg.iterations == 2400 and cfg.train.clip_eps == 0.2
    assert (cfg.eval.every, cfg.eval.temperature) == (15, 0.4)
    assert cfg.train.invalid_action_penalty == 0.1 and cfg.train.success_reward == 10.0
    assert cfg.train.group_norm == "cross_steps" and cfg.train.dual_clip == 3.0 and cfg.train.entropy_coef == 0.001
    a = cfg.annotate
    assert (a.weight_clip, a.mixing_lambda, a.lambda_decay_steps, a.teacher_sync_interval) == (0.2, 0.5, 50, 10)
    if path.stem == "serl":
        from serl_cli.method.annotation import validate

        validate(a)
        assert (a.sources, a.placement, a.tokens, a.unparsed) == ("obs", "all", "action", "none")
        assert a.max_hindsight_tokens == {"webshop": 4096, "alfworld": 2048}[env]  # their max_reprompt_len
    if path.stem == "gigpo":
        # verl-agent's examples/gigpo_trainer: mean_norm on WebShop, mean_std_norm on ALFWorld, gamma 0.95
        assert cfg.train.gigpo_mode == {"webshop": "mean_norm", "alfworld": "mean_std_norm"}[env]
        assert cfg.train.gamma == 0.95 and cfg.train.omega == 1.0


def test_paper_grids_are_built_on_the_paper_configs():
    from serl_cli.ablate import grid as ab

    for f in sorted((ROOT / "experiments" / "ablations").glob("*_paper.yaml")):
        grid = ab.load_grid(str(f))
        base = grid.base
        env = base["env"]["name"]
        paper = cfgmod.from_dict(OnlineConfig, cfgmod.load_yaml(ROOT / "experiments" / env / "paper" / "serl.yaml"))
        for key in (
            "invalid_action_penalty",
            "group_norm",
            "dual_clip",
            "entropy_coef",
            "mini_batch_turns",
            "success_reward",
        ):
            assert base["train"][key] == getattr(paper.train, key), (f.name, key)
        assert base["eval"]["temperature"] == 0.4 and base["iterations"] == 2400, f.name
        assert yaml.safe_load(f.read_text()).get("base_config"), f.name


def test_a_weighted_objective_must_train_on_the_configured_advantages():
    """Under cross-step groups or the invalid penalty, serl/rlsd must use those advantages, and
    their annotations' weights must be signed the same way: the update refuses otherwise."""
    from serl_cli.training.learner import _check_annotated_advantages

    cfg = TrainConfig(algo="serl", group_norm="cross_steps")
    expected = torch.tensor([0.5, -0.5, 0.0])
    ann = [
        make_annotation(weights=[1.1], advantage=0.7),
        make_annotation(weights=[0.9], advantage=-0.7),
        make_annotation(weights=None, advantage=0.0),
    ]
    _check_annotated_advantages(expected.clone(), ann, expected, cfg)  # consistent: fine
    with pytest.raises(SerlError, match="does not compute its advantages with train.group_norm=cross_steps"):
        _check_annotated_advantages(torch.tensor([0.7, -0.7, 0.0]), ann, expected, cfg)
    ann[1].advantage = 0.2  # a weight signed as if the turn had succeeded
    with pytest.raises(SerlError, match="push some turns the wrong way"):
        _check_annotated_advantages(expected.clone(), ann, expected, cfg)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("settings", [{}, {"group_norm": "cross_steps", "invalid_action_penalty": 0.1}])
def test_online_loop_signs_the_weights_with_the_updates_advantages(stopping_model_dir, tmp_path, monkeypatch, settings):
    """Non-default advantage settings reach the annotate stage (its ``advantages=``), so the
    weights are signed by the advantages the update trains on (the authors sign by the final,
    penalized advantage: core_algos.py:466 after ray_trainer.py:1231-1248)."""
    import serl_cli.online.loop as online

    seen = {}

    def capture(episodes, acfg, *args, advantages=None, **kw):
        seen["advantages"], seen["episodes"] = advantages, episodes
        raise _Stop

    monkeypatch.setattr(online, "annotate_episodes", capture)
    cfg = OnlineConfig()
    cfg.env.settings, cfg.env.max_turns = {"catalog": "synthetic"}, 2
    cfg.model, cfg.iterations, cfg.out = str(stopping_model_dir), 1, str(tmp_path / "run")
    cfg.rollout.tasks, cfg.rollout.group_size, cfg.rollout.threads = 1, 2, 1
    cfg.rollout.sampling.max_new_tokens = 8
    cfg.train = TrainConfig(algo="serl", threads=1, **settings)
    with pytest.raises(_Stop):
        run_online(cfg)
    if not settings:
        assert seen["advantages"] is None  # the annotate stage's own (episode) advantage, as before
    else:
        assert seen["advantages"] == turn_advantages(turn_samples(seen["episodes"]), cfg.train).tolist()


def test_serl_trains_on_the_configured_advantages():
    s = [_turn(0, 0, 1.0, invalid=True), _turn(0, 0, 1.0), _turn(1, 0, 0.0), _turn(1, 0, 0.0, invalid=True)]
    ann = [
        make_annotation(
            episode=t.episode,
            selected=True,
            hindsight="x",
            action_mask=[1],
            teacher_logprobs=[-1.0],
            weights=[1.0],
            log_ratio_mean=0.0,
        )
        for t in s
    ]
    cfg = TrainConfig(algo="serl", group_norm="cross_steps", invalid_action_penalty=0.1)
    prepared = get_objective("serl").prepare(s, UpdateInputs([], ann, {}, {}), cfg)
    assert prepared.advantages.tolist() == pytest.approx(turn_advantages(s, cfg).tolist())


@pytest.mark.parametrize("engine", ["hf", "vllm", "hf-bf16"])
def test_single_update_recomputes_pi_old_for_the_engine_that_rolled_out(stopping_model_dir, tmp_path, engine):
    """`serl train RUN` reads which engine generated the run, in which precision: on vLLM's
    rollouts and on hf's in bf16 pi_old is the trainer's by default (recompute_logp_old: null),
    as in the online loop; on hf's in fp32 it is not."""
    from serl_cli.artifacts import io
    from serl_cli.stages.train import train_on_run

    run = tmp_path / "run"
    run_rollout(rollout_config(stopping_model_dir, run, max_new_tokens=10))
    if engine != "hf":  # the manifest says who generated the rollouts; the stored log-probs stand in for theirs
        manifest = io.load_manifest(run)
        settings = {"engine": "vllm"} if engine == "vllm" else {"device": "cpu", "dtype": "bf16"}
        manifest["stages"]["rollout"]["config"].update(settings)
        io.write_json(run / "manifest.json", manifest)
    cfg = TrainConfig(algo="grpo", optim=OptimConfig(lr=0.0), threads=1, checkpoint=str(tmp_path / "ckpt"))
    metrics = train_on_run(str(run), cfg)
    assert ("logp_old_recomputed_turns" in metrics) == (engine != "hf")
    if engine != "hf":
        assert metrics["logp_old_recomputed_turns"] > 0 and metrics["logp_mismatch_max"] < 1e-4
