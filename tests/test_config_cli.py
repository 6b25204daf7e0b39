"""`serl config show`, composed --config files and "did you mean" for unknown keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fixtures_model import tiny_model_dir  # noqa: F401  (fixture)
from test_cli_env import assert_one_line_error, serl

from serl_cli import config as cfgmod
from serl_cli.errors import SerlError
from serl_cli.stages.online import OnlineConfig

SERL_YAML = str(Path(__file__).resolve().parent.parent / "experiments" / "webshop" / "serl.yaml")


def test_config_show_prints_the_complete_resolved_config():
    p = serl("config", "show", "train", "--config", SERL_YAML, "--set", "train.optim.lr=1e-5")
    assert p.returncode == 0, p.stderr
    shown = yaml.safe_load(p.stdout)
    assert shown["train"]["optim"]["lr"] == 1e-5  # --set wins
    assert shown["train"]["algo"] == "serl" and shown["env"]["name"] == "webshop"  # from the file
    assert shown["train"]["optim"]["grad_clip"] == 1.0 and "annotate" in shown and "rollout" in shown  # every section


def test_config_show_defaults_and_bad_input():
    p = serl("config", "show", "eval", "--defaults")
    assert p.returncode == 0 and "episodes:" in p.stdout
    assert_one_line_error(serl("config", "show", "nope"), "unknown command 'nope'")


def test_repeated_config_files_compose_left_to_right(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("iterations: 3\ntrain: {algo: grpo, optim: {lr: 0.1}}\n")
    b.write_text("train: {optim: {lr: 0.2}}\n")
    cfg = cfgmod.resolve(OnlineConfig, config_file=[str(a), str(b)], flags={}, overrides=[])
    assert (cfg.iterations, cfg.train.algo, cfg.train.optim.lr) == (3, "grpo", 0.2)  # b's section merges into a's
    p = serl("config", "show", "train", "--config", str(a), "--config", str(b))
    assert yaml.safe_load(p.stdout)["train"]["optim"]["lr"] == 0.2


def test_unknown_key_suggests_the_closest():
    with pytest.raises(SerlError, match=r"unknown setting train\.kl_cof: did you mean train\.kl_coef\?"):
        cfgmod.resolve(OnlineConfig, config_file=None, flags={}, overrides=["train.kl_cof=0.1"])
    with pytest.raises(SerlError) as info:  # nothing close: no guess, the known keys
        cfgmod.resolve(OnlineConfig, config_file=None, flags={}, overrides=["train.optim.zzz=1"])
    assert "did you mean" not in str(info.value) and "known: " in str(info.value)


def test_help_shows_the_effective_defaults():
    from serl_cli.stages.rollout import RolloutConfig

    p = serl("rollout", "--help", env={"COLUMNS": "200"})
    line = next(ln for ln in p.stdout.splitlines() if "--tasks" in ln)
    assert f"[default: ({RolloutConfig().tasks})]" in line


def test_single_update_honours_out_and_warns_without_gradient(tiny_model_dir, tmp_path):
    """A random-init model never succeeds: every group's rewards are equal, so the update has no gradient."""
    from fixtures_model import rollout_config

    from serl_cli.stages.rollout import run_rollout

    run = tmp_path / "run"
    run_rollout(rollout_config(tiny_model_dir, run, tasks=1, group_size=2, max_new_tokens=4))
    p = serl("train", str(run), "--algo", "grpo", "--out", str(tmp_path / "ckpt"), "--threads", "1")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "ckpt" / "config.json").is_file() and not (run / "checkpoint").exists()
    assert "no turn had a gradient" in p.stderr


def test_live_table_of_the_online_loop_shows_the_last_iterations():
    from rich.console import Console

    from serl_cli.cli.train import iterations_table

    rows = [{"iteration": i, "mean_reward": 0.1 * i, "success_rate": 0.0, "loss": 0.5} for i in range(3)]
    rows[-1]["eval_success_rate"] = 0.25
    console = Console(width=150, record=True)
    console.print(iterations_table(rows, total=10))
    text = console.export_text()
    assert "iteration 3 of 10" in text and "eval" in text and "0.25" in text
    assert "weight mean" not in text  # a GRPO run logs no SERL weights: no empty column
