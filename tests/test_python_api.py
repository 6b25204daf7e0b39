"""The Python API (serl_cli/api.py, docs/API.md): its example script runs end to end and writes
the run directories the CLI would; bad input raises SerlError; load_config resolves as
``serl config show`` does."""

from __future__ import annotations

import dataclasses
import runpy
from pathlib import Path

import pytest
import yaml
from support import serl_in_process

from serl_cli import api
from serl_cli.online.run_file import run_settings

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "experiments" / "python_api.py"
RUN_FILE = ROOT / "experiments" / "sokoban" / "serl.yaml"


@pytest.mark.slow
def test_the_example_script_runs_and_writes_every_stage(tmp_path, capsys):
    main = runpy.run_path(str(EXAMPLE))["main"]  # as a notebook user would run it, not as a subprocess
    result = main(["--out", str(tmp_path), "--iterations", "2"])

    assert (tmp_path / "model" / "config.json").is_file()
    episodes = api.read_rollouts(result["expert"])
    assert len(episodes) == 8 and all(isinstance(e, api.Episode) for e in episodes)
    assert all(isinstance(t, api.Turn) and not t.behaviour_logprobs for e in episodes for t in e.turns)  # the expert
    assert yaml.safe_load((tmp_path / "expert" / "rollout.yaml").read_text())["policy"] == "expert"
    assert api.read_manifest(tmp_path / "expert").stage("train:sft").done

    assert result["sft"].path == tmp_path / "expert" / "checkpoint"
    assert (result["sft"].path / "config.json").is_file()
    assert api.read_metrics(tmp_path / "expert") == [result["sft"].summary]  # the single update's books

    online = tmp_path / "grpo"
    assert [m["iteration"] for m in api.read_metrics(online)] == [0, 1]
    assert api.read_metrics(online) == result["online"]
    assert (online / "checkpoint" / "config.json").is_file()
    stored = yaml.safe_load((online / "online.yaml").read_text())
    assert stored["train"]["algo"] == "grpo" and stored["model"] == str(result["sft"].path)

    for name, summary in result["eval"].items():
        folder = tmp_path / f"eval_{name.replace(' + ', '+').replace(' ', '_')}"
        assert api.read_eval(folder) == summary
        assert summary["episodes"] == 4
        assert (folder / "eval_config.yaml").is_file()
    printed = capsys.readouterr().out
    assert "grpo iteration 1:" in printed and "warm start + grpo" in printed

    # annotate (not in the script: its loop is GRPO's) on the warm start's own rollouts, as serl annotate would
    cfg = api.load_config("rollout", overrides=["env.name=sokoban", "tasks=1", "group_size=2", "threads=1"])
    cfg.model, cfg.out, cfg.sampling.max_new_tokens = str(result["sft"].path), str(tmp_path / "sampled"), 3
    sampled = api.rollout(cfg)
    annotated = api.annotate(sampled, api.AnnotateConfig(sources="error,diff", placement="feedback", threads=1))
    turns = sum(e.num_turns for e in api.read_rollouts(sampled))
    assert len(api.read_annotations(sampled)) == turns == annotated.summary["turns"]
    assert yaml.safe_load((tmp_path / "sampled" / "annotate.yaml").read_text())["placement"] == "feedback"


def test_a_missing_model_raises_serl_error(tmp_path):
    cfg = api.RolloutConfig(
        env=api.EnvConfig(name="sokoban", split="train"),
        model=str(tmp_path / "no-such-model"),
        tasks=1,
        group_size=1,
        threads=1,
        out=str(tmp_path / "run"),
    )
    with pytest.raises(api.SerlError, match="no-such-model"):
        api.rollout(cfg)


def test_bad_input_raises_serl_error_before_anything_is_written(tmp_path):
    with pytest.raises(api.SerlError, match="run directory not found"):
        api.train(tmp_path / "missing", api.TrainConfig(algo="sft"))
    with pytest.raises(api.SerlError, match="learns from no annotations"):
        api.annotate(tmp_path, train=api.TrainConfig(algo="grpo"))
    with pytest.raises(api.SerlError, match="unknown setting train.optim.lrr"):
        api.load_config("train", overrides=["train.optim.lrr=1e-5"])
    with pytest.raises(api.SerlError, match="--resume"):
        api.train_online(api.OnlineConfig(out=str(tmp_path / "nothing-here")), resume=True, plan_check=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "command, files, overrides",
    [
        ("train", [RUN_FILE], ["train.optim.lr=1e-5", "iterations=3"]),
        ("eval", [RUN_FILE], ["eval.episodes=7"]),  # a run file read as the loop's evaluation
        ("rollout", [RUN_FILE], ["rollout.tasks=5"]),
        ("annotate", [], ["granularity=anchor", "seed=4"]),
    ],
)
def test_load_config_resolves_as_config_show_does(command, files, overrides):
    args = ["config", "show", command]
    for f in files:
        args += ["--config", str(f)]
    for o in overrides:
        args += ["--set", o]
    shown = serl_in_process(*args)
    assert shown.returncode == 0, shown.stderr
    cfg = api.load_config(command, files, overrides)
    plain = run_settings(cfg) if command == "train" else dataclasses.asdict(cfg)
    assert yaml.safe_load(shown.stdout) == yaml.safe_load(yaml.safe_dump(plain, sort_keys=False))
    assert cfg != api.load_config(command)  # the files and overrides were read
