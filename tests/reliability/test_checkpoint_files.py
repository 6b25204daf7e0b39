"""A run folder is data: resuming one someone else wrote runs no code from it. Every ``torch.load`` of a
run's files (the trainer state, the teacher snapshot, DeepSpeed's engine checkpoint) reads tensors and
plain values only; a planted ``__reduce__`` payload is refused in one line, unrun, and a truncated
file is one line too."""

from __future__ import annotations

import builtins
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support import assert_one_line_error, serl

from serl_cli.artifacts import io
from serl_cli.errors import SerlError


class Payload:
    """Unpickled, it creates ``marker``: what a planted checkpoint could run instead."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


def plant(path: Path, marker: Path) -> None:
    """A torch file at ``path`` that holds the payload beside a plausible state."""
    with open(path, "wb") as f:
        torch.save({"updates": 1, "optimizer": Payload(marker)}, f)


def test_a_payload_in_a_torch_file_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    plant(tmp_path / "state.pt", marker)
    with pytest.raises(SerlError, match="never unpickles objects from a run folder") as e:
        io.torch_load(tmp_path / "state.pt", "the trainer state")
    assert not marker.exists(), "the payload ran"
    assert "\n" not in str(e.value)


def test_a_truncated_torch_file_is_one_line(tmp_path):
    torch.save({"updates": 3, "w": torch.ones(1000)}, tmp_path / "state.pt")
    data = (tmp_path / "state.pt").read_bytes()
    (tmp_path / "state.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(SerlError, match="unreadable, truncated or corrupt"):
        io.torch_load(tmp_path / "state.pt", "the trainer state")


def test_deepspeeds_checkpoint_files_are_read_as_data(tmp_path):
    """The engine's own loader (which unpickles whatever its files hold) is replaced by a data-only one."""
    from serl_cli.training.deepspeed import loads_data_only

    engine = SimpleNamespace(checkpoint_engine=SimpleNamespace())
    loads_data_only(engine)
    marker = tmp_path / "ran"
    plant(tmp_path / "optim_states.pt", marker)
    with pytest.raises(SerlError, match="a DeepSpeed checkpoint file"):
        engine.checkpoint_engine.load(str(tmp_path / "optim_states.pt"), map_location="cpu")
    assert not marker.exists()
    torch.save({"global_steps": 2, "module": {"w": torch.zeros(2)}}, tmp_path / "model_states.pt")
    assert engine.checkpoint_engine.load(str(tmp_path / "model_states.pt"))["global_steps"] == 2


def test_the_planted_payload_is_an_attack_without_the_guard(tmp_path):
    """The payload does what the guard keeps it from doing, when loaded the unsafe way: the tests
    above would pass vacuously otherwise."""
    marker = tmp_path / "ran"
    plant(tmp_path / "state.pt", marker)
    with open(tmp_path / "state.pt", "rb") as f:
        torch.load(f, weights_only=False)
    assert marker.exists()
    assert pickle.dumps(Payload(marker))  # and it pickles as an ordinary object would


@pytest.fixture(scope="module")
def online_run(tiny_model_dir, tmp_path_factory) -> Path:
    """Two iterations of GRPO, each checkpointed."""
    out = tmp_path_factory.mktemp("online") / "run"
    args = ["--model", str(tiny_model_dir), "--tasks", "1", "--group-size", "2", "--max-turns", "2"]
    done = serl("train", "--iterations", "2", *args, "--out", str(out), "--set", "env.settings.catalog=synthetic")
    assert done.returncode == 0, done.stderr
    return out


def resume(run: Path, tiny_model_dir: Path):
    args = ["--model", str(tiny_model_dir), "--tasks", "1", "--group-size", "2", "--max-turns", "2"]
    return serl(
        "train", "--iterations", "3", *args, "--out", str(run), "--resume", "--set", "env.settings.catalog=synthetic"
    )


def forge_digest(run: Path, k: int, name: str) -> None:
    """What whoever planted a file would do too: record its digest as the iteration's own."""
    manifest = io.read_json(run / "manifest.json")
    entry = manifest["stages"][f"iter_{k:04d}"]
    entry["checkpoint_sha256"][name] = io.file_sha256(run / f"iter_{k:04d}" / "checkpoint" / name)
    io.write_json(run / "manifest.json", manifest)


def test_resuming_a_run_with_a_planted_trainer_state_runs_nothing(online_run, tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(online_run, run)
    marker = tmp_path / "ran"
    plant(run / "iter_0001" / "checkpoint" / "trainer_state.pt", marker)
    forge_digest(run, 1, "trainer_state.pt")
    proc = resume(run, tiny_model_dir)
    assert_one_line_error(proc, "trainer_state.pt", "never unpickles")
    assert not marker.exists(), "the planted payload ran on --resume"


def test_resuming_from_a_truncated_trainer_state_is_one_line(online_run, tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(online_run, run)
    state = run / "iter_0001" / "checkpoint" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    assert_one_line_error(resume(run, tiny_model_dir), "trainer_state.pt has changed since iteration 1 wrote it")
    forge_digest(run, 1, "trainer_state.pt")  # the digest check aside, the load itself says so
    assert_one_line_error(resume(run, tiny_model_dir), "trainer_state.pt", "truncated or corrupt")


# -- integrity: a resume checks the files it trusts against the digests written with them ------------
def test_a_resume_refuses_a_checkpoint_whose_weights_changed(online_run, tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(online_run, run)
    weights = run / "iter_0001" / "checkpoint" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of one weight: loads fine, trains from the wrong place
    weights.write_bytes(bytes(data))
    assert_one_line_error(resume(run, tiny_model_dir), "model.safetensors has changed since iteration 1 wrote it")


def test_keeping_a_finished_update_checks_its_weights(tiny_model_dir, tmp_path):
    """``serl train RUN --resume`` over a finished update keeps it only while its files are the ones it wrote."""
    run, out = tmp_path / "run", tmp_path / "update"
    args = ["--model", str(tiny_model_dir), "--tasks", "2", "--group-size", "2", "--max-turns", "2"]
    assert serl("rollout", *args, "--out", str(run), "--set", "env.settings.catalog=synthetic").returncode == 0
    assert serl("train", str(run), "--algo", "grpo", "--out", str(out)).returncode == 0
    assert serl("train", str(run), "--algo", "grpo", "--out", str(out), "--resume").returncode == 0
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = serl("train", str(run), "--algo", "grpo", "--out", str(out), "--resume")
    assert_one_line_error(proc, "model.safetensors has changed since this update wrote it")
