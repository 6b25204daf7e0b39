"""What serl prints when nothing new happened: a run's checkpoint size once when it starts (not
on each resume), and under -q no per-iteration warning (one line at the end instead). In
process (typer's CliRunner): the process itself is not under test."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from serl_cli.cli import train as _train_cmd  # noqa: F401  (registers `train`)
from serl_cli.cli.root import app

GRPO_YAML = str(Path(__file__).resolve().parent.parent / "experiments" / "webshop" / "grpo.yaml")


def _train(model_dir, run: Path, iterations: int, *extra: str):
    args = ["train", "--config", GRPO_YAML, "--model", str(model_dir), "--out", str(run), "--threads", "1"]
    args += ["--iterations", str(iterations), "--tasks", "1", "--group-size", "2", "--max-turns", "2"]
    args += ["--set", "env.settings.catalog=synthetic", "--set", "rollout.sampling.max_new_tokens=4"]
    args += ["--set", "eval.episodes=0", "--no-plan-check", *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.stderr


def test_quiet_run_says_its_checkpoint_size_once_and_its_empty_updates_in_one_line(tiny_model_dir, tmp_path):
    """A random-init tiny model never succeeds: every update has no gradient. Each iteration
    printed a warning that -q did not hide, and each resume said the checkpoint's size again."""
    run = tmp_path / "run"
    first = _train(tiny_model_dir, run, 2, "-q")
    assert first.count("serl: a checkpoint of this run takes") == 1
    assert "iteration 0: no turn had a gradient" not in first
    assert "warning: 2 updates of 2 had no gradient (every group's rewards were equal): iteration 0, 1" in first
    resumed = _train(tiny_model_dir, run, 3, "-q", "--resume")
    assert "a checkpoint of this run takes" not in resumed
    assert "warning: 1 update of 1 had no gradient" in resumed
