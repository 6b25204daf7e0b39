"""The demo's warm start aimed at a success band (``stages.warm_start``): which checkpoint is
chosen on a success curve, the validation rooms, the settings' checks, and SFT to a band end to
end on the micro model (the step it stops at, the checkpoint it keeps, what it reports)."""

from __future__ import annotations

import pytest
import torch

from envs.sokoban.env import SokobanWorld
from serl_cli.artifacts import io
from serl_cli.cli.demo import in_words
from serl_cli.demo.config import DemoConfig, demo_defaults, online_arm_config, quick
from serl_cli.demo.pipeline import best_iteration, paired_gain
from serl_cli.errors import SerlError
from serl_cli.models.tiny import init_model
from serl_cli.rollout.default_model import tokenizer_corpus
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.rollout import RolloutConfig, run_rollout
from serl_cli.stages.warm_start import (
    BELOW,
    IN_BAND,
    STEPPED_OVER,
    WARM_START_FILE,
    WarmStartConfig,
    check_warm_start,
    choose_checkpoint,
    reached_band,
    sft_to_band,
    steps_to_next_check,
    validation_rooms,
)
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig

BAND = [0.25, 0.35]


# -- choosing the checkpoint on a success curve ---------------------------------------------------
def test_the_first_checkpoint_in_the_band_is_chosen():
    # the curve SFT would see: flat, then climbing through the band; it stops at 0.27
    assert choose_checkpoint([0.0, 0.05, 0.12, 0.27], BAND) == (3, IN_BAND)
    # had it gone on, the first in the band is still the one (0.27, not the centre's 0.30)
    assert choose_checkpoint([0.0, 0.27, 0.30, 0.33], BAND)[0] == 1
    assert choose_checkpoint([0.35], BAND) == (0, IN_BAND)  # the edges are in the band
    assert choose_checkpoint([0.1, 0.25], BAND) == (1, IN_BAND)


def test_a_step_over_the_band_takes_the_checkpoint_nearest_its_centre():
    # 0.20 -> 0.45: |0.20 - 0.30| = 0.10 < |0.45 - 0.30| = 0.15, the one before the jump
    assert choose_checkpoint([0.05, 0.20, 0.45], BAND) == (1, STEPPED_OVER)
    # 0.10 -> 0.38: the one after it
    assert choose_checkpoint([0.05, 0.10, 0.38], BAND) == (2, STEPPED_OVER)
    # equally far (0.20 and 0.40, both 0.10 off): the earlier, which leaves RL more to gain
    assert choose_checkpoint([0.20, 0.40], BAND) == (0, STEPPED_OVER)


def test_sft_that_ends_below_the_band_takes_its_best_checkpoint():
    assert choose_checkpoint([0.0, 0.1, 0.2, 0.15], BAND) == (2, BELOW)
    assert choose_checkpoint([0.0, 0.0, 0.0], BAND) == (0, BELOW)  # nothing learnt: the first
    with pytest.raises(SerlError, match="no checkpoint"):
        choose_checkpoint([], BAND)


def test_sft_stops_at_the_band_s_lower_edge():
    assert [reached_band(s, BAND) for s in (0.0, 0.249, 0.25, 0.3, 0.9)] == [False, False, True, True, True]


def test_checks_come_closer_together_near_the_band():
    cfg = WarmStartConfig(band=[0.25, 0.35], every=25, every_near=10)
    # before any checkpoint, and below half the lower edge (0.125): every 25 steps; from there, every 10
    assert [steps_to_next_check(s, cfg) for s in (None, 0.0, 0.12, 0.125, 0.2, 0.5)] == [25, 25, 25, 10, 10, 10]


def test_validation_rooms_are_spread_over_the_split_and_never_ones_the_data_played():
    assert validation_rooms(100, 4, set()) == [0, 25, 50, 75]
    assert validation_rooms(100, 4, {0, 1, 50}) == [2, 25, 51, 75]
    assert validation_rooms(10, 3, {9, 0, 3}) == [1, 4, 6]
    with pytest.raises(SerlError, match="warm_start.rooms 8"):
        validation_rooms(10, 8, {1, 2, 3})


@pytest.mark.parametrize(
    "cfg, match",
    [
        (WarmStartConfig(band=[0.4, 0.3]), "warm_start.band"),
        (WarmStartConfig(band=[0.3]), "warm_start.band"),
        (WarmStartConfig(band=[0.3, 1.5]), "warm_start.band"),
        (WarmStartConfig(every=0), "at least 1"),
        (WarmStartConfig(every_near=0), "at least 1"),
        (WarmStartConfig(rooms=0), "at least 1"),
    ],
)
def test_bad_warm_start_settings_are_one_line(cfg, match):
    with pytest.raises(SerlError, match=match):
        check_warm_start(cfg)


# -- what the demo says at its end ----------------------------------------------------------------
def _result(rate: float) -> dict:
    return {"success_rate": rate, "success_ci95": [rate - 0.07, rate + 0.07]}


def test_the_demo_ends_in_plain_words():
    cfg = DemoConfig(out="runs/demo", eval_episodes=200)
    summary = {
        "results": {
            "expert": _result(1.0),
            "warm start": _result(0.3),
            "warm start + grpo": _result(0.5),
            "warm start + serl": _result(0.55),
        },
        "gains": {
            "grpo": {"points": 20.0, "ci95": [13.2, 26.8], "rooms": 200},
            "serl": {"points": 25.0, "ci95": None, "rooms": 1},
        },
        "warm_start": {"step": 275},
        "kept_iterations": {"grpo": 35, "serl": None},
        "teacher_signal": {"turns": 900, "iterations": 40, "right_direction": 0.61, "expert_prob_gain": -0.182},
    }
    text = "\n".join(in_words(cfg, summary))
    assert "The warm start (SFT stopped at step 275) solved 30% of 200 test rooms" in text
    assert "GRPO (its best round on train rooms, round 35) solved 50%: +20 points (95% interval +13 to +27)." in text
    assert "SERL solved 55%: +25 points." in text  # no interval from a single room: none shown
    assert "where it reaches down to 0, the gain could be luck" in text
    assert "rated the expert's move 18 points less likely" in text
    assert "serl show runs/demo/serl/iter_0079 --episode 0" in text  # the last of the 80 rounds
    assert "-0.182" not in text and "with the block" not in text  # no jargon


def test_a_gain_is_paired_room_by_room_with_its_t_interval():
    # per-room differences in points: 0, +100, 0, 0 (room 9 only the arm played: left out);
    # mean 25, sample sd 50, se 25, t(0.975, 3 df) = 3.182446 -> 25 +- 79.561
    gain = paired_gain({0: 1.0, 1: 0.0, 2: 0.0, 3: 1.0}, {0: 1.0, 1: 1.0, 2: 0.0, 3: 1.0, 9: 1.0})
    assert gain["points"] == 25.0 and gain["rooms"] == 4
    assert gain["ci95"] == pytest.approx([25 - 79.5612, 25 + 79.5612], abs=1e-3)
    # every room the same way: the gain and a zero-width interval; one room: no interval
    assert paired_gain({0: 1.0, 1: 0.0}, {0: 1.0, 1: 0.0}) == {"points": 0.0, "ci95": [0.0, 0.0], "rooms": 2}
    assert paired_gain({0: 1.0}, {0: 0.0})["ci95"] is None


def test_each_arm_keeps_its_best_checkpoint_on_train_rooms(tmp_path):
    run = tmp_path / "grpo"
    assert best_iteration(run) is None  # no periodic evaluation: the last checkpoint, as before
    for k, success, saved in [(4, 0.30, True), (9, 0.42, True), (12, 0.50, False), (14, 0.42, True), (19, 0.35, True)]:
        it = run / f"iter_{k:04d}"
        (it / "checkpoint").mkdir(parents=True) if saved else it.mkdir(parents=True)
        if saved:
            (it / "checkpoint" / "config.json").write_text("{}")
        io.write_json(it / "eval.json", {"success_rate": success})
    # 0.50 has no checkpoint to keep; 0.42 twice: the later, iteration 15 counted from 1
    kept = {"iteration": 15, "success": 0.42, "checkpoint": str(run / "iter_0014" / "checkpoint")}
    assert best_iteration(run) == kept


# -- SFT to a band, end to end on the micro model --------------------------------------------------
@pytest.fixture(scope="module")
def expert_run(tmp_path_factory):
    world = SokobanWorld()
    micro = init_model("micro", tmp_path_factory.mktemp("models") / "micro", tokenizer_corpus(world, episodes=50))
    out = tmp_path_factory.mktemp("runs") / "expert"
    prompt = PromptConfig(history_turns=0, max_admissible=0, system=False, bare_replies=True)
    cfg = RolloutConfig(
        env=EnvConfig(name="sokoban", split="train"),
        model=str(micro),
        policy="expert",
        tasks=12,
        group_size=1,
        prompt=prompt,
        threads=1,
        out=str(out),
    )
    run_rollout(cfg, overwrite=True)
    return out


SFT = TrainConfig(algo="sft", epochs=1, mini_batches=4, optim=OptimConfig(lr=1e-3), threads=1)


def _saved_updates(checkpoint) -> int:
    """How many SFT stretches the saved policy had run (the trainer state it was saved with)."""
    return torch.load(checkpoint / "trainer_state.pt", weights_only=False)["updates"]


@pytest.mark.slow
def test_sft_stops_at_the_first_checkpoint_in_the_band(expert_run):
    env = EnvConfig(name="sokoban", split="train")
    w = sft_to_band(str(expert_run), SFT, WarmStartConfig(band=[0.0, 1.0], every=2, rooms=3), env, log=lambda *_: None)
    assert (w["step"], w["outcome"], [r["step"] for r in w["curve"]]) == (2, IN_BAND, [2])
    assert _saved_updates(expert_run / "checkpoint") == 1
    assert io.read_json(expert_run / WARM_START_FILE) == w
    assert io.load_manifest(expert_run)["stages"]["warm_start"]["status"] == "done"


@pytest.mark.slow
def test_sft_that_never_reaches_the_band_runs_every_pass_and_says_so(expert_run):
    env = EnvConfig(name="sokoban", split="train")
    lines = []
    cfg = WarmStartConfig(band=[1.0, 1.0], every=1, every_near=1, rooms=3)
    w = sft_to_band(str(expert_run), SFT, cfg, env, overwrite=True, log=lines.append)
    assert [r["step"] for r in w["curve"]] == [1, 2, 3, 4] and w["max_steps"] == 4 and w["outcome"] == BELOW
    index, _ = choose_checkpoint([r["success"] for r in w["curve"]], cfg.band)
    assert w["step"] == w["curve"][index]["step"] and _saved_updates(expert_run / "checkpoint") == w["step"]
    assert len(lines) == 4 and lines[0].strip().startswith("SFT step 1: success")
    with pytest.raises(SerlError, match="already exists"):  # finished output is not overwritten unasked
        sft_to_band(str(expert_run), SFT, cfg, env, log=lambda *_: None)


def test_only_the_online_arms_end_an_episode_at_a_deadlock():
    cfg = DemoConfig(env=EnvConfig(name="sokoban", split="train", settings={"size": 7}))
    arm = online_arm_config(cfg, "serl", "runs/demo/expert/checkpoint")
    assert arm.env.settings == {"size": 7, "end_on_deadlock": True} and arm.train.algo == "serl"
    assert cfg.env.settings == {"size": 7}  # the expert data, the warm start and the test panel: env as it is
    webshop = demo_defaults("webshop")  # a setting of Sokoban's world only
    assert webshop.arm_settings == {} and online_arm_config(webshop, "grpo", "ckpt").env.settings == {}


def test_quick_keeps_a_warm_start_band_at_smoke_sizes():
    q = quick(DemoConfig())
    assert (q.warm_start.every, q.warm_start.every_near, q.warm_start.rooms) == (1, 1, 4)
    assert q.warm_start.band == DemoConfig().warm_start.band
    assert DemoConfig().threads == 1  # one thread per process unless --threads (demo.pipeline)


def test_the_demo_says_one_round_not_1_rounds():
    """`serl demo --quick` runs one iteration: its words said "After 1 rounds of RL"."""
    cfg = DemoConfig(out="runs/demo")
    cfg.online.iterations = 1
    summary = {
        "results": {"warm start": _result(0.3), "warm start + grpo": _result(0.5)},
        "gains": {"grpo": {"points": 20.0, "ci95": None, "rooms": 1}},
    }
    text = "\n".join(in_words(cfg, summary, quick_run=True))
    assert "After 1 round of RL, GRPO solved 50%" in text
