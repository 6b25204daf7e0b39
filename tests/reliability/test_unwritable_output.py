"""Every command that writes, pointed at a folder it cannot write (a read-only mount; for root, sysfs):
one line naming what could not be written, exit 2, no traceback, and nothing left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import assert_one_line_error, serl, tiny_grid

SYNTH = ["--set", "env.settings.catalog=synthetic"]


def commands(out: Path, model: Path, run: Path, grid: Path) -> dict[str, list[str]]:
    """Each writing command, its output under ``out`` (a folder that cannot be written)."""
    small = ["--tasks", "1", "--group-size", "2", "--max-turns", "2"]
    return {
        "rollout": ["rollout", "--model", str(model), *small, "--out", str(out / "r"), *SYNTH],
        "eval": ["eval", "--policy", "expert", "--episodes", "1", "--out", str(out / "e"), *SYNTH],
        "eval-model": ["eval", "--model", str(model), "--episodes", "1", "--out", str(out / "e"), *SYNTH],
        "train-update": ["train", str(run), "--algo", "grpo", "--out", str(out / "ckpt")],
        "train-online": ["train", "--iterations", "1", "--model", str(model), *small, "--out", str(out / "o"), *SYNTH],
        "model-init": ["model", "init", "--preset", "micro", "--env", "sokoban", "--out", str(out / "m")],
        "demo-quick": ["demo", "--quick", "--out", str(out / "demo")],
        "plot": ["plot", str(run), "--out", str(out / "curves.png")],
        "ablate": ["ablate", str(grid), "--out", str(out / "abl")],
        "ablate-emit": ["ablate", str(grid), "--out", str(out / "abl"), "--emit", "slurm"],
    }


@pytest.fixture(scope="module")
def rollout_run(tiny_model_dir, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "rollout"
    args = ["--tasks", "2", "--group-size", "2", "--max-turns", "2", *SYNTH]
    done = serl("rollout", "--model", str(tiny_model_dir), *args, "--out", str(run))
    assert done.returncode == 0, done.stderr
    (run / "metrics.jsonl").write_text('{"iteration": 0, "update": 1, "mean_reward": 0.5}\n')  # for plot
    return run


@pytest.mark.parametrize(
    "name",
    [
        "rollout",
        "eval",
        "eval-model",
        "train-update",
        "train-online",
        "model-init",
        "demo-quick",
        "plot",
        "ablate",
        "ablate-emit",
    ],
)
def test_a_command_that_cannot_write_says_so_in_one_line(name, unwritable, tiny_model_dir, rollout_run, tmp_path):
    if name == "plot":
        pytest.importorskip("matplotlib")
    before = sorted(p.name for p in unwritable.iterdir())
    grid = tiny_grid(tmp_path, tiny_model_dir, seeds=1, algos=("grpo",))
    done = serl(*commands(unwritable, tiny_model_dir, rollout_run, grid)[name])
    assert_one_line_error(done, str(unwritable))
    assert sorted(p.name for p in unwritable.iterdir()) == before
