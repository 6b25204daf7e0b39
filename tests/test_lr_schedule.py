"""train.optim's learning-rate warmup and schedule: hand-worked rates at given steps, a default
run exactly as it was (no scheduler at all), the schedule's step through a checkpoint and
resume, and bad settings refused in one line. Pure math first, then a tiny model."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
from support import rollout_config

from serl_cli.artifacts.schema import read_rollouts
from serl_cli.errors import SerlError
from serl_cli.stages.rollout import run_rollout
from serl_cli.training.learner import Learner
from serl_cli.training.step import lr_factor, make_scheduler
from serl_cli.training.train_config import OptimConfig, TrainConfig, check_train_config


def _rates(schedule: str, steps: int, **kw) -> list[float]:
    """The lr of each of the first ``steps`` optimizer steps, as torch's scheduler sets them."""
    param = torch.nn.Parameter(torch.zeros(1))
    cfg = OptimConfig(lr=1.0, schedule=schedule, **kw)
    optimizer = torch.optim.AdamW([param], lr=cfg.lr)
    scheduler = make_scheduler(optimizer, cfg)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_linear_warmup_then_linear_decay_by_hand():
    # warmup 4: 0, 1/4, 2/4, 3/4; then (10 - s) / (10 - 4) from s = 4 to 0 at s = 10, and 0 after
    expected = [0, 0.25, 0.5, 0.75, 1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0, 0]
    assert _rates("linear", 12, warmup_steps=4, total_steps=10) == pytest.approx(expected)


def test_cosine_decay_by_hand_and_stays_at_zero_past_the_end():
    # no warmup, 4 steps: 0.5 (1 + cos(pi s / 4)) = 1, (2 + sqrt 2) / 4, 1/2, (2 - sqrt 2) / 4, 0, then 0
    r2 = math.sqrt(2)
    expected = [1, (2 + r2) / 4, 0.5, (2 - r2) / 4, 0, 0, 0]
    assert _rates("cosine", 7, total_steps=4) == pytest.approx(expected, abs=1e-12)


def test_constant_with_warmup_by_hand():
    assert _rates("constant", 5, warmup_steps=2) == pytest.approx([0, 0.5, 1, 1, 1])
    assert lr_factor(7, OptimConfig(warmup_steps=2, schedule="constant")) == 1.0


def test_the_default_has_no_scheduler_at_all():
    param = torch.nn.Parameter(torch.zeros(1))
    assert make_scheduler(torch.optim.AdamW([param]), OptimConfig()) is None
    assert (OptimConfig().schedule, OptimConfig().warmup_steps) == ("constant", 0)


@pytest.mark.parametrize(
    ("optim", "needle"),
    [
        ({"schedule": "linear"}, r"train\.optim\.total_steps, which must be above train\.optim\.warmup_steps \(0\)"),
        ({"schedule": "cosine", "warmup_steps": 5, "total_steps": 5}, r"above train\.optim\.warmup_steps \(5\)"),
        ({"warmup_steps": -1}, r"train\.optim\.warmup_steps must be a whole number"),
        ({"warmup_steps": 1.5}, r"train\.optim\.warmup_steps must be a whole number"),
        ({"schedule": "step"}, r"unknown train\.optim\.schedule 'step': choose one of constant, linear, cosine"),
    ],
)
def test_bad_schedules_are_one_line_before_anything_loads(optim, needle):
    with pytest.raises(SerlError, match=needle):
        check_train_config(TrainConfig(optim=OptimConfig(**optim)))


# ------------------------------------------------------------------------------ on a tiny model
@pytest.fixture(scope="module")
def episodes(stopping_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("schedule") / "run"
    run_rollout(rollout_config(stopping_model_dir, run, max_new_tokens=10))
    eps = read_rollouts(run)
    for ep in eps:
        ep.reward, ep.success = (1.0, True) if ep.rollout_index == 0 else (0.0, False)
    return eps


def _cfg(**optim) -> TrainConfig:
    return TrainConfig(algo="grpo", mini_batches=2, threads=1, optim=OptimConfig(lr=1e-3, **optim))


def _weights(learner: Learner) -> dict:
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def test_an_update_steps_the_schedule_and_reports_its_lr(episodes, stopping_model_dir):
    learner = Learner(str(stopping_model_dir), _cfg(schedule="linear", warmup_steps=2, total_steps=6))
    first = learner.update(copy.deepcopy(episodes), 1.0)
    second = learner.update(copy.deepcopy(episodes), 1.0)
    assert first["optimizer_steps"] == second["optimizer_steps"] == 2
    # steps 0, 1 (warmup: 0, 1/2) then 2, 3 (decay: 4/4, 3/4), each update reporting its steps' mean
    assert first["lr"] == pytest.approx(1e-3 * (0 + 0.5) / 2)
    assert second["lr"] == pytest.approx(1e-3 * (1 + 0.75) / 2)
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 2 / 4)  # the next step's: 4


def test_a_default_update_is_the_constant_lr_one(episodes, stopping_model_dir, tmp_path):
    """The default (constant, no warmup) runs as a run did before schedules existed: no scheduler
    touches the optimizer (its param group holds no initial_lr), the lr metric is the constant one, and
    the resume state holds what it held (the updates and AdamW's state)."""
    default = Learner(str(stopping_model_dir), _cfg())
    metrics = default.update(copy.deepcopy(episodes), 1.0)
    assert default.backend.scheduler is None and metrics["lr"] == 1e-3
    assert default.optimizer.param_groups[0]["lr"] == 1e-3 and "initial_lr" not in default.optimizer.param_groups[0]
    state = torch.load(default.save(tmp_path / "ckpt") / "trainer_state.pt", weights_only=False)
    assert set(state) == {"updates", "optimizer"}


def test_the_schedule_resumes_where_it_stopped(episodes, stopping_model_dir, tmp_path):
    """Two updates in one learner equal one update, a checkpoint, a new learner from it, one more
    update: the schedule's step survives trainer_state.pt (at lr 0 after a restart it would not)."""
    cfg = _cfg(schedule="cosine", warmup_steps=1, total_steps=5)
    straight = Learner(str(stopping_model_dir), cfg)
    straight.update(copy.deepcopy(episodes), 1.0)
    expected = straight.update(copy.deepcopy(episodes), 1.0)

    first = Learner(str(stopping_model_dir), replace(cfg))
    first.update(copy.deepcopy(episodes), 1.0)
    ckpt = first.save(tmp_path / "ckpt")
    resumed = Learner(str(ckpt), replace(cfg), state_file=ckpt / "trainer_state.pt")
    assert resumed.backend.scheduler.last_epoch == 2
    got = resumed.update(copy.deepcopy(episodes), 1.0)
    assert got["lr"] == pytest.approx(expected["lr"]) and got["lr"] > 0
    for name, value in _weights(straight).items():
        torch.testing.assert_close(_weights(resumed)[name], value, rtol=1e-5, atol=1e-6)


def test_a_deepspeed_scheduler_section_and_serls_schedule_are_not_both_taken(tmp_path):
    """DeepSpeed would silently prefer serl's scheduler over its file's: one of them is refused."""
    import json

    from serl_cli.training.deepspeed_config import DeepSpeedConfig, resolve_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "scheduler": {"type": "WarmupLR"}}))
    ds = DeepSpeedConfig(config=str(path))
    resolve_config(ds, OptimConfig(), bf16_available=False)  # the file's own scheduler alone: fine
    with pytest.raises(SerlError, match=r"has a scheduler section and train\.optim\.schedule/warmup_steps"):
        resolve_config(ds, OptimConfig(warmup_steps=1), bf16_available=False)


def test_the_online_loop_derives_total_steps_from_the_run_and_keeps_it():
    """A schedule without total_steps decays over the run (TRL derives its max steps the same way); the
    number goes into the run's settings, so a resume that runs longer keeps the run's schedule."""
    from serl_cli.online.config import OnlineConfig, check_online_config
    from serl_cli.online.run_file import run_settings

    cfg = OnlineConfig(iterations=10)
    cfg.train.epochs, cfg.train.mini_batches, cfg.train.optim.schedule = 2, 3, "cosine"
    check_online_config(cfg)
    assert cfg.train.optim.total_steps == 60 and run_settings(cfg)["train"]["optim"]["total_steps"] == 60
    cfg.iterations = 20  # a resume going on for longer: the stored number stands
    check_online_config(cfg)
    assert cfg.train.optim.total_steps == 60
    constant = OnlineConfig(iterations=10)
    check_online_config(constant)
    assert constant.train.optim.total_steps == 0
    by_turns = OnlineConfig(iterations=10)
    by_turns.train.optim.schedule, by_turns.train.mini_batch_turns = "linear", 64
    with pytest.raises(SerlError, match="train.optim.total_steps"):
        check_online_config(by_turns)  # the steps per update depend on the turns: left to set
