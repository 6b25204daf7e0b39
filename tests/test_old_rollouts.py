"""``old_rollouts``: a finished iteration's rollouts and annotations, which the
loop never reads again, kept, gzipped or deleted once a later iteration is done; gzipped records
read as before (``serl show``, the readers of ``artifacts``), and ``serl plan`` counts what is kept
(tests/test_plan.py)."""

from __future__ import annotations

import gzip

import pytest
from reliability.faults import cli_exit_code

from serl_cli.artifacts import io
from serl_cli.artifacts.schema import read_rollouts, rollouts_fingerprint
from serl_cli.errors import SerlError
from serl_cli.online.checkpoints import iter_dir, retire_old_rollouts


def records(run, iterations: int) -> None:
    for k in range(iterations):
        io.write_jsonl(iter_dir(run, k) / "rollouts.jsonl", [{"iteration": k, "turns": list(range(50))}] * 20)
        io.write_jsonl(iter_dir(run, k) / "annotations.jsonl", [{"iteration": k}] * 5)


def test_gzip_keeps_every_record_of_the_older_iterations_and_leaves_the_newest(tmp_path):
    records(tmp_path, 3)
    before = {k: io.read_stored_bytes(iter_dir(tmp_path, k) / "rollouts.jsonl") for k in range(3)}
    freed = retire_old_rollouts(tmp_path, 2, "gzip")
    for k in (0, 1):
        assert not (iter_dir(tmp_path, k) / "rollouts.jsonl").exists()
        with gzip.open(iter_dir(tmp_path, k) / "rollouts.jsonl.gz", "rb") as f:
            assert f.read() == before[k]
        assert list(io.iter_jsonl(iter_dir(tmp_path, k) / "annotations.jsonl")) == [{"iteration": k}] * 5
    assert (iter_dir(tmp_path, 2) / "rollouts.jsonl").read_bytes() == before[2]  # the newest: as written
    assert freed > 0
    assert retire_old_rollouts(tmp_path, 2, "gzip") == 0  # done once


def test_delete_removes_older_records_plain_or_gzipped_and_keep_leaves_all(tmp_path):
    records(tmp_path, 3)
    assert retire_old_rollouts(tmp_path, 2, "keep") == 0
    assert len(list(tmp_path.glob("iter_*/*.jsonl"))) == 6
    retire_old_rollouts(tmp_path, 1, "gzip")  # a run that gzipped, resumed with delete
    retire_old_rollouts(tmp_path, 2, "delete")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("iter_*/*")) == [
        "iter_0002/annotations.jsonl",
        "iter_0002/rollouts.jsonl",
    ]


def test_a_gzipped_file_cut_short_is_one_clear_error(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    io.write_jsonl(path, [{"a": 1}, {"a": 2}])
    gz = io.gzip_file(path)
    gz.write_bytes(gzip.compress(b'{"a": 1}\n{"a": 2'))
    with pytest.raises(SerlError, match=r"rollouts\.jsonl\.gz:2: truncated last line"):
        list(io.iter_jsonl(path))


@pytest.mark.slow
def test_an_online_run_gzips_its_older_iterations_and_serl_show_reads_them(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    args = ["train", "--model", str(tiny_model_dir), "--out", str(run), "--iterations", "2", "--tasks", "1"]
    args += ["--group-size", "2", "--max-turns", "2", "--threads", "1", "--set", "env.settings.catalog=synthetic"]
    args += ["--set", "rollout.sampling.max_new_tokens=6", "--set", "old_rollouts=gzip", "-q"]
    assert cli_exit_code(*args) == 0
    first, last = iter_dir(run, 0), iter_dir(run, 1)
    assert (first / "rollouts.jsonl.gz").is_file() and not (first / "rollouts.jsonl").exists()
    assert (last / "rollouts.jsonl").is_file()  # the newest iteration's, as written
    episodes = read_rollouts(first)
    assert len(episodes) == 2 and rollouts_fingerprint(first)
    assert cli_exit_code("show", str(first), "--episode", "0") == 0
    assert "old_rollouts: gzip" in (run / "online.yaml").read_text()
