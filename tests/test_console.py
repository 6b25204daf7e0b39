"""What `serl train` prints, in the norms of TRL and verl: the settings a run starts with, the time spent
and left on every iteration line and progress line, the learning rate, and a closing table whose
counts agree with each other."""

from __future__ import annotations

import io

from rich.console import Console

from serl_cli.cli.common import LogProgress, clock_text, remaining
from serl_cli.cli.train import IterationsShown, final_rows, iterations_table, settings_block
from serl_cli.online.config import OnlineConfig


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_durations_read_as_a_person_reads_them():
    assert [clock_text(s) for s in (0.4, 42, 59.6, 187, 3729)] == ["0 s", "42 s", "1:00", "3:07", "1:02:09"]
    assert clock_text(float("nan")) == "?"
    assert remaining(30.0, 3, 10) == 70.0  # 10 s an item, 7 to go


def test_each_iteration_line_says_its_place_the_lr_and_the_time_left(monkeypatch):
    """An iteration every 10 s: after the 3rd of 10, 30 s have passed and 70 s are left."""
    clock = Clock()
    monkeypatch.setattr(IterationsShown, "clock", clock)
    out = io.StringIO()
    monkeypatch.setattr("serl_cli.cli.train.console", Console(file=out, width=300))
    shown = IterationsShown(10, quiet=False)
    for k in range(3):
        clock.now += 10
        shown.show({"iteration": k, "mean_reward": 0.5, "success_rate": 0.25, "loss": 0.1, "lr": 3e-4})
    last = out.getvalue().strip().splitlines()[-1]
    assert last.startswith("iteration 3/10: reward 0.500  success 0.250")
    assert "lr 0.0003" in last and last.endswith("(30 s elapsed, ETA 1:10)")


def test_a_resumed_run_counts_its_time_left_from_what_it_ran():
    """Resumed at iteration 6 of 10: 4 to run; after one (iteration 6) at 20 s, 3 are left: 60 s."""
    shown = IterationsShown(10, quiet=True)
    shown.clock = lambda: shown.start + 20.0  # type: ignore[method-assign]
    assert shown.pace(6) == "20 s elapsed, ETA 1:00"


def test_the_live_table_counts_iterations_from_one_as_its_title_does():
    table = iterations_table([{"iteration": 0, "mean_reward": 0.1, "lr": 1e-4}], total=10, pace="5 s elapsed")
    assert table.title == "online loop: iteration 1 of 10 (5 s elapsed)"
    assert [c.header for c in table.columns] == ["iteration", "reward", "lr"]


def test_the_closing_table_agrees_with_itself():
    history = [{"iteration": 8, "update": 9, "env_steps": 60}, {"iteration": 9, "update": 10, "env_steps": 50}]
    rows = dict(final_rows(history, 10, env_steps=110, elapsed="1:40"))
    assert rows["iterations"] == "10 of 10" and rows["updates"] == "10"
    assert rows["environment steps (this run)"] == "110" and rows["wall time"] == "1:40"
    assert "iteration" not in rows and "env_steps" not in rows


def test_the_settings_a_run_starts_with_fit_a_few_lines():
    cfg = OnlineConfig(iterations=80, out="runs/x")
    cfg.train.optim.lr, cfg.train.optim.schedule, cfg.train.optim.total_steps = 1e-4, "cosine", 80
    text = settings_block(cfg, resume=False)
    assert text.splitlines()[0] == "run: runs/x  (80 iterations, seed 0)"
    assert "lr 0.0001 (cosine to step 80)" in text and "every setting: runs/x/online.yaml" in text
    assert len(text.splitlines()) <= 6
    assert settings_block(cfg, resume=True).startswith("resuming: runs/x")


def test_a_progress_line_in_a_log_says_the_time_left(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(LogProgress, "clock", clock)
    out = io.StringIO()
    lines = LogProgress(Console(file=out, width=200), "update", "micro-batches", total=40)
    clock.now += 31
    lines.update(10)
    assert out.getvalue().strip() == "update: 10/40 micro-batches, 31 s, ETA 1:33"


def test_a_run_shorter_than_eval_every_still_ends_with_an_evaluation(tiny_model_dir, tmp_path):
    import json

    from support import serl

    args = ["--model", str(tiny_model_dir), "--tasks", "1", "--group-size", "2", "--max-turns", "2", "-q"]
    sets = ["--set", "env.settings.catalog=synthetic", "--set", "eval.episodes=1", "--set", "eval.every=5"]
    done = serl("train", "--iterations", "2", *args, *sets, "--out", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert "eval_success_rate" not in metrics[0] and "eval_success_rate" in metrics[1]
    assert all("lr" in m for m in metrics)  # the lr is in every iteration's metrics, a step taken or not
