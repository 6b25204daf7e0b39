"""Bad input to rollout and train: one clear line, exit code 2, existing artifacts untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reliability.faults import tree_hash
from support import assert_one_line_error, serl

SYNTH = ["--set", "env.settings.catalog=synthetic"]


@pytest.fixture(scope="module")
def expert_run(tiny_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "expert"
    p = serl(
        "rollout",
        "--policy",
        "expert",
        "--model",
        str(tiny_model_dir),
        "--tasks",
        "2",
        "--group-size",
        "1",
        "--max-turns",
        "6",
        "--out",
        str(run),
        *SYNTH,
    )
    assert p.returncode == 0, p.stderr
    return run


def copy_run(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in ("manifest.json", "rollouts.jsonl"):
        (dst / f).write_bytes((src / f).read_bytes())
    return dst


def test_missing_model_directory(tmp_path):
    assert_one_line_error(
        serl("rollout", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), *SYNTH), "does not exist"
    )
    assert not (tmp_path / "o").exists()


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "readme.txt").write_text("hello")
    assert_one_line_error(
        serl("rollout", "--model", str(tmp_path / "notamodel"), "--out", str(tmp_path / "o"), *SYNTH), "no config.json"
    )


def test_unknown_algorithm(expert_run, tmp_path):
    run = copy_run(expert_run, tmp_path / "r")
    before = tree_hash(run)
    assert_one_line_error(serl("train", str(run), "--algo", "ppo-max"), "unknown algorithm 'ppo-max'")
    assert tree_hash(run) == before


@pytest.mark.slow
def test_not_a_run_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(serl("train", str(tmp_path / "empty"), "--algo", "sft"), "not a serl run directory")
    assert_one_line_error(serl("train", str(tmp_path / "absent"), "--algo", "sft"), "run directory not found")


def test_run_without_rollouts(expert_run, tmp_path):
    run = copy_run(expert_run, tmp_path / "r")
    (run / "rollouts.jsonl").unlink()
    assert_one_line_error(serl("train", str(run), "--algo", "sft"), "holds no rollouts")
    assert not (run / "checkpoint").exists()


def test_truncated_rollouts_file(expert_run, tmp_path):
    run = copy_run(expert_run, tmp_path / "r")
    data = (run / "rollouts.jsonl").read_bytes()
    (run / "rollouts.jsonl").write_bytes(data[: len(data) - 40])  # cut inside the last record
    before = tree_hash(run)
    assert_one_line_error(serl("train", str(run), "--algo", "sft"), "truncated last line", "rollouts.jsonl:2")
    assert tree_hash(run) == before


def test_unknown_schema_version(expert_run, tmp_path):
    run = copy_run(expert_run, tmp_path / "r")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (run / "manifest.json").write_text(json.dumps(manifest))
    before = tree_hash(run)
    assert_one_line_error(serl("train", str(run), "--algo", "sft"), "schema version 99")
    assert tree_hash(run) == before


def test_rollouts_without_feedback_fields(expert_run, tmp_path):
    run = copy_run(expert_run, tmp_path / "r")
    lines = (run / "rollouts.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    del rec["turns"][0]["feedback"]
    (run / "rollouts.jsonl").write_text("\n".join([json.dumps(rec)] + lines[1:]) + "\n")
    assert_one_line_error(serl("train", str(run), "--algo", "sft"), "lacks feedback")


def test_grpo_on_expert_data_needs_logprobs(expert_run, tmp_path):
    run = copy_run(expert_run, tmp_path / "r")
    assert_one_line_error(serl("train", str(run), "--algo", "grpo"), "needs behaviour log-probs")
    assert not (run / "checkpoint").exists()


@pytest.mark.parametrize(
    "override,needle",
    [
        ("=3", "malformed --set"),
        ("train.optim.lr", "malformed --set"),
        ("train.optim.lr=fast", "must be a number"),
        ("train.nosuch=1", "unknown setting train.nosuch"),
        ("train.optim=3", "must be a mapping"),
    ],
)
def test_malformed_set(expert_run, tmp_path, override, needle):
    run = copy_run(expert_run, tmp_path / "r")
    before = tree_hash(run)
    assert_one_line_error(serl("train", str(run), "--algo", "sft", "--set", override), needle)
    assert tree_hash(run) == before


def test_existing_checkpoint_needs_overwrite(expert_run, tmp_path):
    run = copy_run(expert_run, tmp_path / "r")
    assert serl("train", str(run), "--algo", "sft").returncode == 0
    before = tree_hash(run)
    assert_one_line_error(serl("train", str(run), "--algo", "sft"), "already exists", "--overwrite")
    assert tree_hash(run) == before


def test_rollout_refuses_to_overwrite(expert_run, tmp_path):
    run = copy_run(expert_run, tmp_path / "r")
    before = tree_hash(run)
    assert_one_line_error(serl("rollout", "--policy", "expert", "--out", str(run), *SYNTH), "already exists")
    assert tree_hash(run) == before
