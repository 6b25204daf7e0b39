"""A full disk: the write that fails is one clear line (exit 2), the previous artifact is
whole, no temporary file is left, and the stage resumes once there is room.

Two simulations: RLIMIT_FSIZE in a forked child (the kernel fails the write that crosses
the limit part-way through, with EFBIG) and ``/dev/full`` (every write fails with ENOSPC).
"""

from __future__ import annotations

import errno
import os
import shutil

import pytest
from faults import cli_exit_code, run_with_file_size_limit, same_weights, tree_hash
from support import rollout_config, synthetic_env

from serl_cli.artifacts import io
from serl_cli.errors import SerlError
from serl_cli.stages.rollout import JOURNAL_FILE, run_rollout

SETTINGS = dict(seed=3, env=synthetic_env(max_turns=4), tasks=2, group_size=3, max_new_tokens=10, batch_size=4)
CLI_SETTINGS = [
    "--tasks",
    "2",
    "--group-size",
    "3",
    "--max-turns",
    "4",
    "--seed",
    "3",
    "--set",
    "env.settings.catalog=synthetic",
    "--set",
    "sampling.max_new_tokens=10",
    "--set",
    "batch_size=4",
    "--threads",
    "1",
    "-q",
]


def one_line(stderr_path) -> str:
    text = stderr_path.read_text()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def test_disk_fills_during_rollout_then_resume(tiny_model_dir, tmp_path):
    ref = tmp_path / "ref"
    run_rollout(rollout_config(tiny_model_dir, ref, **SETTINGS))
    run = tmp_path / "run"
    limit = 30_000  # a few rounds of the journal fit; the next append is cut part-way
    err = tmp_path / "stderr.txt"
    code = run_with_file_size_limit(
        lambda: cli_exit_code("rollout", "--model", str(tiny_model_dir), "--out", str(run), *CLI_SETTINGS), limit, err
    )
    line = one_line(err)
    assert code == 2
    assert f"could not write {run / JOURNAL_FILE}" in line and "File too large (disk full?)" in line
    assert (run / JOURNAL_FILE).stat().st_size == limit  # the failed append wrote part of its line
    assert not list(run.glob(".*.tmp")) and not (run / "rollouts.jsonl").exists()
    # room again: --resume drops the torn line and finishes with what an uninterrupted run writes
    run_rollout(rollout_config(tiny_model_dir, run, **SETTINGS), resume=True)
    assert (run / "rollouts.jsonl").read_bytes() == (ref / "rollouts.jsonl").read_bytes()


def test_disk_full_while_saving_a_checkpoint_keeps_the_old_one(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    run_rollout(
        rollout_config(tiny_model_dir, run, policy="expert", tasks=2, group_size=1, env=synthetic_env(max_turns=3))
    )
    shutil.copytree(tiny_model_dir, run / "checkpoint")  # the previous checkpoint, to be replaced
    old_checkpoint = tree_hash(run / "checkpoint")
    err = tmp_path / "stderr.txt"
    # the weights (~16 MB) do not fit under 1 MB; the manifest and metrics lines do
    code = run_with_file_size_limit(
        lambda: cli_exit_code("train", str(run), "--algo", "sft", "--overwrite", "--threads", "1"), 1 << 20, err
    )
    line = one_line(err)
    assert code == 2 and f"could not write {run / 'checkpoint'}" in line and "(disk full?)" in line
    assert tree_hash(run / "checkpoint") == old_checkpoint
    assert not (run / "metrics.jsonl").exists()  # the failed update is not logged as done
    assert not [p for p in run.iterdir() if p.name.startswith(".")]
    assert io.load_manifest(run)["stages"]["train:sft"]["status"] == "running"


def test_disk_full_at_an_online_checkpoint_is_one_line_and_resume_finishes(tiny_model_dir, tmp_path):
    """Iteration 0's checkpoint under a 20 MB file limit: the model (13 MB) fits, the resume
    state (torch.save, 27 MB) does not. torch reports that write as a RuntimeError ("unexpected
    pos") that has lost its errno; it is one line all the same, and the loop resumes."""
    import dataclasses

    import yaml
    from test_resume_kill import online_cfg

    from serl_cli.online.loop import run_online

    ref = tmp_path / "ref"
    run_online(online_cfg(tiny_model_dir, ref))
    run = tmp_path / "run"
    cfg_file = tmp_path / "online.yaml"
    cfg_file.write_text(yaml.safe_dump(dataclasses.asdict(online_cfg(tiny_model_dir, run))))
    err = tmp_path / "stderr.txt"
    code = run_with_file_size_limit(lambda: cli_exit_code("train", "--config", str(cfg_file), "-q"), 20_000_000, err)
    line = one_line(err)
    assert code == 2 and f"could not write {run / 'iter_0000' / 'checkpoint'}: File too large (disk full?)" in line
    assert (run / "iter_0000" / "rollouts.jsonl").is_file()  # the iteration got as far as its checkpoint
    assert not (run / "iter_0000" / "checkpoint").exists() and not list(run.rglob(".*.partial"))
    assert not (run / "metrics.jsonl").exists()  # the iteration is not logged as done
    run_online(online_cfg(tiny_model_dir, run), resume=True)  # room again
    assert (run / "metrics.jsonl").read_bytes() == (ref / "metrics.jsonl").read_bytes()
    assert same_weights(run / "checkpoint", ref / "checkpoint")


def test_enospc_on_an_atomic_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "eval.json"
    io.write_json(path, {"success_rate": 0.5})
    before = path.read_bytes()
    real_mkstemp = io.tempfile.mkstemp

    def on_a_full_disk(prefix, suffix, dir):  # the temporary file lands on a device with no space left
        fd, name = real_mkstemp(prefix=prefix, suffix=suffix, dir=dir)
        os.close(fd)
        return os.open("/dev/full", os.O_WRONLY), name

    monkeypatch.setattr(io.tempfile, "mkstemp", on_a_full_disk)
    with pytest.raises(SerlError) as e:
        io.write_json(path, {"success_rate": 0.75, "padding": "x" * 100_000})
    assert str(e.value) == (
        f"could not write {path}: {os.strerror(errno.ENOSPC)} (disk full?); the previous version, if any, is intact"
    )
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]
