"""`serl plot RUN`: one PNG of the curves the run logged, and one line for a run that has none."""

from __future__ import annotations

import pytest
from support import assert_one_line_error, serl

from serl_cli.artifacts import io
from serl_cli.views.plot import plot_run, series

pytest.importorskip("matplotlib")


def write_metrics(run, n=4, serl_weights=True):
    for i in range(n):
        rec = {
            "update": i + 1,
            "iteration": i,
            "env_steps": 40 * (i + 1),
            "mean_reward": 0.1 * i,
            "success_rate": 0.1 * i,
            "loss": 1.0 / (i + 1),
            "clip_frac": 0.0,
            "mean_abs_advantage": 0.5,
        }
        if serl_weights:
            rec.update(weight_mean=1.0, weight_min=0.9, weight_max=1.1)
        io.append_jsonl(run / "metrics.jsonl", rec)


def test_plot_writes_a_png_of_the_logged_metrics(tmp_path):
    write_metrics(tmp_path)
    out = plot_run(str(tmp_path), x="env_steps")
    assert out == tmp_path / "curves.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert series(list(io.iter_jsonl(tmp_path / "metrics.jsonl")), "env_steps", "mean_reward") == (
        [40.0, 80.0, 120.0, 160.0],
        [0.0, 0.1, 0.2, pytest.approx(0.3)],
    )


def test_plot_cli_and_bad_input(tmp_path):
    assert_one_line_error(serl("plot", str(tmp_path)), "has no metrics.jsonl")
    write_metrics(tmp_path, serl_weights=False)
    assert_one_line_error(serl("plot", str(tmp_path), "--x", "wall"), "unknown x axis 'wall'")
    p = serl("plot", str(tmp_path), "--out", str(tmp_path / "c.png"))
    assert p.returncode == 0 and (tmp_path / "c.png").is_file()


def test_plot_into_a_folder_it_cannot_write_is_one_line(tmp_path, unwritable):
    """A run on a read-only mount (or any folder this process cannot write): one line, no traceback."""
    write_metrics(tmp_path)
    done = serl("plot", str(tmp_path), "--out", str(unwritable / "curves.png"))
    assert_one_line_error(done, f"could not write {unwritable / 'curves.png'}", "--out")
    assert not (unwritable / "curves.png").exists()


def test_a_cut_metrics_file_says_how_to_read_the_rest(tmp_path):
    write_metrics(tmp_path)
    data = (tmp_path / "metrics.jsonl").read_bytes()
    (tmp_path / "metrics.jsonl").write_bytes(data[:-10])
    assert_one_line_error(serl("plot", str(tmp_path)), "truncated last line", "delete the cut last line")
