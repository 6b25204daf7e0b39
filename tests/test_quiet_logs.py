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


def test_a_long_step_prints_progress_lines_in_a_log_file(tiny_model_dir, tmp_path, monkeypatch):
    """`serl train RUN --algo sft` in a log file (not a terminal) was silent for minutes: the bar
    draws only on a terminal. Now a plain line at a steady interval (here every call: 0 s)."""
    from support import rollout_config

    from serl_cli.cli import common
    from serl_cli.stages.rollout import run_rollout

    run = tmp_path / "run"
    run_rollout(rollout_config(tiny_model_dir, run, tasks=1, group_size=2, max_new_tokens=4))
    monkeypatch.setattr(common, "LOG_EVERY_S", 0.0)
    args = ["train", str(run), "--algo", "sft", "--threads", "1", "--no-plan-check", "--set", "train.mini_batches=2"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("update: ")]
    assert lines and lines[-1].startswith("update: ") and " micro-batches, " in lines[-1]
    done, total = lines[-1].split()[1].split("/")
    assert done == total  # the last line is the update's end
    quiet = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b"), "-q"])
    assert quiet.exit_code == 0 and "update: " not in quiet.stdout


def test_progress_lines_keep_their_interval_and_stay_off_a_terminal(monkeypatch):
    from rich.console import Console

    from serl_cli.cli import common

    clock = iter([0.0, 10.0, 31.0, 40.0, 62.0, 70.0])
    monkeypatch.setattr(common.LogProgress, "clock", staticmethod(lambda: next(clock)))
    log = Console(record=True, force_terminal=False, width=100)
    lines = common.LogProgress(log, "rollout", "episodes", total=8)  # started at 0 s
    for _ in range(4):  # at 10, 31, 40, 62 s: a line at 31 and at 62
        lines.advance()
    assert log.export_text().splitlines() == [
        "rollout: 2/8 episodes, 31 s, ETA 1:33",
        "rollout: 4/8 episodes, 62 s, ETA 1:02",
    ]
    tty = Console(record=True, force_terminal=True)
    common.LogProgress(tty, "rollout", "episodes").update(5)
    assert tty.export_text() == ""  # the bar is there
