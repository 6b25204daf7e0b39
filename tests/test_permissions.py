"""Artifacts honour the process umask (teammates on a shared cluster can read a run).

Atomic writes go through ``mkstemp``/``mkdtemp``, which create 0600 files and 0700
directories whatever the umask; serl sets what ``open``/``mkdir`` would have given.
"""

from __future__ import annotations

import os
import stat

import pytest
from support import webshop_like_corpus

from serl_cli.artifacts import io
from serl_cli.models.tiny import init_model
from serl_cli.training.checkpoint import commit_dir


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(old)


@pytest.mark.parametrize(
    "mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775), (0o077, 0o600, 0o700)]
)
def test_atomic_writes_and_staging_dirs_follow_the_umask(umask, tmp_path, mask, file_mode, dir_mode):
    umask(mask)
    io.write_json(tmp_path / "run" / "eval.json", {"success": 1.0})
    io.append_jsonl(tmp_path / "run" / "metrics.jsonl", {"update": 1})
    assert mode(tmp_path / "run" / "eval.json") == file_mode
    assert mode(tmp_path / "run" / "metrics.jsonl") == file_mode
    staged = tmp_path / ".checkpoint.tmp"
    (staged / "sub").mkdir(parents=True)
    (staged / "model.safetensors").write_bytes(b"x")
    os.chmod(staged / "model.safetensors", 0o600)  # as safetensors leaves it
    os.chmod(staged, 0o700)  # as mkdtemp leaves it
    commit_dir(staged, tmp_path / "checkpoint")
    assert mode(tmp_path / "checkpoint") == mode(tmp_path / "checkpoint" / "sub") == dir_mode
    assert mode(tmp_path / "checkpoint" / "model.safetensors") == file_mode


def test_a_model_directory_is_readable_by_the_group(umask, tmp_path):
    umask(0o022)
    out = init_model("tiny", tmp_path / "model", webshop_like_corpus(20))
    assert mode(out) == 0o755
    assert all(mode(f) == 0o644 for f in out.iterdir())
