"""--report-to: every metric of metrics.jsonl also in a TensorBoard event file, readable by TensorBoard's own reader."""

from __future__ import annotations

import json

import pytest
from support import assert_one_line_error, serl

from serl_cli.artifacts.tracking import check_backends, scalars
from serl_cli.errors import SerlError

SYNTH = ["--env", "webshop", "--set", "env.settings.catalog=synthetic", "--set", "env.settings.synthetic_size=40"]


def test_scalars_flattens_numbers_and_skips_the_rest():
    assert scalars({"loss": 0.5, "algo": "grpo", "ok": True, "timing": {"update_s": 2}}) == {
        "loss": 0.5,
        "timing/update_s": 2.0,
    }


def test_bad_backends_are_refused():
    for names, needle in ((["tb"], "unknown --report-to 'tb'"), (["none", "tensorboard"], "cannot be combined")):
        with pytest.raises(SerlError, match=needle):
            check_backends(names)
    assert check_backends(["none"]) == [] and check_backends(None) == []


def test_two_iterations_land_in_tensorboard(tiny_model_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    p = serl(
        "train",
        "--algo",
        "grpo",
        "--model",
        str(tiny_model_dir),
        "--iterations",
        "2",
        "--tasks",
        "2",
        "--group-size",
        "2",
        "--max-turns",
        "2",
        "--out",
        str(out),
        "--threads",
        "1",
        "--report-to",
        "tensorboard",
        *SYNTH,
        "--set",
        "rollout.sampling.max_new_tokens=8",
    )
    assert p.returncode == 0, p.stderr
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for key in ("mean_reward", "success_rate", "loss", "env_steps", "turns_with_gradient"):
        logged = events.Scalars(key)
        assert [e.step for e in logged] == [0, 1]
        assert [e.value for e in logged] == pytest.approx([m[key] for m in metrics])
    assert "config" in events.Tags()["tensors"] or "config" in str(events.Tags())


def test_report_to_bad_name_is_one_line(tmp_path):
    assert_one_line_error(
        serl("train", "--iterations", "1", "--report-to", "tb", "--out", str(tmp_path / "r")),
        "unknown --report-to 'tb'",
    )


def test_wandb_offline_run_is_written_where_the_run_is(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # not in the dev extra (heavy); runs where serl[wandb] is installed
    from serl_cli.artifacts.tracking import Tracker

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracker(["wandb"], tmp_path, "t", {"train": {"algo": "grpo"}})
    tracker.log({"mean_reward": 0.5, "timing": {"update_s": 1.0}}, step=0)
    tracker.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
