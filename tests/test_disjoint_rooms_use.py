"""Sokoban's ``disjoint_rooms`` as the studies and the demo reach it: an environment setting that every
stage playing the train split carries (docs/SOKOBAN.md, "Test rooms the policy never trained on")."""

from __future__ import annotations

from serl_cli import config as cfgmod
from serl_cli.demo.config import DemoConfig, expert_data_config, online_arm_config, panel_eval_config
from serl_cli.rollout.worlds import EnvConfig, build_world


def test_a_world_built_from_run_settings_keeps_panel_rooms_out_of_train():
    world = build_world(EnvConfig(name="sokoban", split="train", settings={"disjoint_rooms": True}))
    panel = {world.room("test", i) for i in range(world.num_tasks("test"))}
    assert world.test_rooms == panel
    assert not panel & {world.room("train", i) for i in range(100)}


def test_the_demo_carries_the_setting_to_every_stage():
    cfg = cfgmod.resolve(DemoConfig, config_file=None, flags={}, overrides=["env.settings.disjoint_rooms=true"])
    expert = expert_data_config(cfg, "model", "out").env
    arm = online_arm_config(cfg, "serl", "warm_start").env
    panel = panel_eval_config(cfg, "model", "out").env
    assert expert.settings["disjoint_rooms"] and expert.split == "train"
    assert arm.settings["disjoint_rooms"] and arm.settings["end_on_deadlock"]  # with the arms' own setting
    assert panel.settings["disjoint_rooms"]  # the panel's rooms are the test split's, the option or not
    assert "disjoint_rooms" not in DemoConfig().env.settings  # off by default
