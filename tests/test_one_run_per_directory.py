"""One run per directory: a resume keeps the settings its run was made with, no
command replaces a checkpoint another training wrote unless told ``--overwrite`` (nor does any
error's advice lead there), and training only reads the run whose rollouts it trains on when
its checkpoint goes elsewhere -- so several trainings read one rollout directory at once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from reliability.faults import cli, cli_exit_code, one_line_error, tree_hash
from support import rollout_config, synthetic_env

from serl_cli.artifacts import runlock
from serl_cli.errors import SerlError
from serl_cli.stages.resume_settings import RESUMABLE_CHANGES
from serl_cli.stages.rollout import run_rollout
from serl_cli.stages.train import UPDATE_RECORD, train_on_run
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig

ONLINE = [
    "train",
    "--iterations",
    "1",
    "--tasks",
    "1",
    "--group-size",
    "2",
    "--max-turns",
    "2",
    "--threads",
    "1",
    "--set",
    "env.settings.catalog=synthetic",
    "--set",
    "rollout.sampling.max_new_tokens=6",
    "-q",
]


@pytest.fixture(scope="module")
def online_run(tiny_model_dir, tmp_path_factory):
    """A finished one-iteration GRPO run of the online loop, made by the CLI."""
    out = tmp_path_factory.mktemp("online") / "run"
    args = [*ONLINE, "--model", str(tiny_model_dir), "--out", str(out)]
    assert cli_exit_code(*args) == 0
    return out, args


@pytest.mark.parametrize(
    "change, named",
    [
        (["--set", "train.algo=serl"], "train.algo: stored grpo, now serl"),
        (["--tasks", "3"], "rollout.tasks: stored 1, now 3"),
        (["--set", "train.optim.lr=0.001"], "train.optim.lr: stored 1e-06, now 0.001"),
    ],
)
def test_online_resume_with_other_settings_is_refused_and_changes_nothing(online_run, capsys, change, named):
    run, args = online_run
    before = tree_hash(run.parent)  # the run and its lock's folder
    result = cli(capsys, *args, "--iterations", "2", *change, "--resume")
    line = one_line_error(result, named, "--out", "--overwrite")
    # the way out never continues the run with the other settings: only with its own, nothing else given
    assert "--resume" not in line.replace(f"`serl train --out {run} --resume` alone", "")
    assert tree_hash(run.parent) == before


def test_a_resume_needs_only_the_run_and_names_every_difference(online_run, tmp_path, capsys):
    """`serl train --out RUN --resume` reads RUN's own settings: nothing of the command that made it is
    retyped; what is given besides must agree, and every setting that does not is named at once."""
    src, _ = online_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    before = tree_hash(run)
    result = cli(capsys, "train", "--out", str(run), "--resume", "--tasks", "3", "--set", "train.algo=serl")
    one_line_error(result, "rollout.tasks: stored 1, now 3; train.algo: stored grpo, now serl")
    assert tree_hash(run) == before
    code, _, err = cli(capsys, "train", "--out", str(run), "--resume", "--iterations", "2", "-q")
    assert code == 0, err
    online = json.loads((run / "manifest.json").read_text())["stages"]["online"]
    assert online["status"] == "done" and online["config"]["iterations"] == 2
    assert online["config"]["rollout"]["tasks"] == 1 and online["config"]["env"]["settings"]["catalog"] == "synthetic"


def test_online_resume_may_go_on_for_longer_and_the_manifest_says_so(online_run, tmp_path, capsys):
    src, args = online_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    args = [a if a != str(src) else str(run) for a in args]
    code, _, err = cli(capsys, *args, "--iterations", "2", "--resume")
    assert code == 0, err
    online = json.loads((run / "manifest.json").read_text())["stages"]["online"]
    assert online["status"] == "done" and online["config"]["iterations"] == 2
    (resumed,) = online["resumed"]
    # the run was copied to another directory: that is recorded too
    assert resumed["at_iteration"] == 1 and resumed["changed"] == {"iterations": [1, 2], "out": [str(src), str(run)]}
    assert yaml.safe_load((run / "online.yaml").read_text())["iterations"] == 2
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def test_the_settings_a_resume_may_change_are_documented():
    doc = (Path(__file__).parent.parent / "docs" / "RELIABILITY.md").read_text()
    assert all(f"`{key}`" in doc for key in RESUMABLE_CHANGES)


# -- a single update --------------------------------------------------------------------------------


@pytest.fixture
def expert_run(tiny_model_dir, tmp_path):
    run = tmp_path / "expert"
    cfg = rollout_config(tiny_model_dir, run, policy="expert", tasks=2, group_size=1, env=synthetic_env(max_turns=3))
    run_rollout(cfg)
    return run


def test_resume_never_replaces_another_updates_checkpoint(expert_run, capsys):
    """The refusal's advice was '--resume to keep it', and --resume with another
    algorithm then trained over the checkpoint."""
    run = expert_run
    assert cli(capsys, "train", str(run), "--algo", "sft", "--threads", "1", "-q")[0] == 0
    kept = tree_hash(run / "checkpoint")
    plain = one_line_error(cli(capsys, "train", str(run), "--algo", "grpo", "--threads", "1"), "--out", "--overwrite")
    assert "train.algo: stored sft, now grpo" in plain and "--resume" not in plain
    resumed = cli(capsys, "train", str(run), "--algo", "grpo", "--threads", "1", "--resume")
    one_line_error(resumed, "train.algo: stored sft, now grpo", "--out", "--overwrite")
    assert tree_hash(run / "checkpoint") == kept
    # the same update resumed: its metrics back, nothing trained
    before = tree_hash(run)
    assert cli(capsys, "train", str(run), "--algo", "sft", "--threads", "1", "--resume")[0] == 0
    assert tree_hash(run) == before


def test_resume_refuses_a_checkpoint_no_update_wrote(expert_run, tiny_model_dir, capsys):
    """A policy copied in (or an online run's): no record says what made it, so it is not ours."""
    shutil.copytree(tiny_model_dir, expert_run / "checkpoint")
    kept = tree_hash(expert_run)
    result = cli(capsys, "train", str(expert_run), "--algo", "sft", "--threads", "1", "--resume")
    one_line_error(result, f"no {UPDATE_RECORD}", "--out", "--overwrite")
    assert tree_hash(expert_run) == kept


def test_two_updates_read_one_run_at_once(expert_run, tmp_path):
    """While one update (checkpoint in a/) is mid-way, a second (checkpoint in b/) starts on the
    same rollouts and finishes; neither writes into the run they read, not even a 'running' mark."""
    run = expert_run
    before = tree_hash(run)

    def cfg(out):
        return TrainConfig(algo="sft", optim=OptimConfig(lr=1e-3), threads=1, checkpoint=str(tmp_path / out))

    second = {}

    def during_first(done, total):
        if not second:  # the first update holds whatever it holds now
            assert json.loads((run / "manifest.json").read_text()).get("stages", {}).get("train:sft") is None
            second["metrics"] = train_on_run(str(run), cfg("b"))

    first = train_on_run(str(run), cfg("a"), progress=during_first)
    assert second, "the first update reported no progress"
    for out, metrics in (("a", first), ("b", second["metrics"])):
        record = json.loads((tmp_path / out / UPDATE_RECORD).read_text())
        assert record["metrics"] == metrics and record["train"]["algo"] == "sft"
        assert not runlock.lock_path(tmp_path / out).exists()
    assert tree_hash(run) == before and not runlock.lock_path(run).exists()
    # resuming an update whose checkpoint is elsewhere returns its metrics from the record
    assert train_on_run(str(run), cfg("a"), resume=True) == first


def test_resume_of_a_finished_rollout_with_other_settings_is_refused(expert_run, tiny_model_dir):
    """Before, ``--resume`` handed back the finished rollout's summary as if it were the one asked for."""
    before = tree_hash(expert_run)
    other = rollout_config(
        tiny_model_dir, expert_run, policy="expert", tasks=3, group_size=1, env=synthetic_env(max_turns=3)
    )
    with pytest.raises(SerlError, match=r"with other settings \(tasks: stored 2, now 3\).*--out.*--overwrite"):
        run_rollout(other, resume=True)
    assert tree_hash(expert_run) == before
    same = rollout_config(
        tiny_model_dir, expert_run, policy="expert", tasks=2, group_size=1, env=synthetic_env(max_turns=3)
    )
    same.threads = 2  # not a setting of what is made
    assert run_rollout(same, resume=True)["episodes"] == 2


def test_a_run_recorded_before_a_setting_existed_resumes_at_its_default():
    """A setting added to serl after the run started is compared at its default (which computes
    what the run computed), so an upgrade does not lock a run; a changed value is still refused."""
    from serl_cli.errors import SerlError
    from serl_cli.online.config import OnlineConfig
    from serl_cli.online.resume import check_online_resume
    from serl_cli.online.run_file import run_settings

    now = run_settings(OnlineConfig())
    older = run_settings(OnlineConfig())
    del older["train"]["optim"]["schedule"]  # as a run of a serl without learning-rate schedules
    assert check_online_resume("RUN", older, now, 0) == {}
    older["train"]["optim"]["lr"] = now["train"]["optim"]["lr"] * 10
    with pytest.raises(SerlError, match=r"train\.optim\.lr: stored"):
        check_online_resume("RUN", older, now, 0)
