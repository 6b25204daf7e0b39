"""One writer per run directory: a second one refuses with one line naming the owner; a
lock whose owner died is taken over with a warning."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import time

import pytest
from faults import cli, kill_during, one_line_error, tree_hash

from serl_cli.artifacts import runlock
from serl_cli.errors import SerlError

SYNTH = ["--set", "env.settings.catalog=synthetic"]


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def expert_rollout(capsys, model, out, *extra):
    return cli(
        capsys,
        "rollout",
        "--policy",
        "expert",
        "--model",
        str(model),
        "--tasks",
        "2",
        "--group-size",
        "1",
        "--max-turns",
        "4",
        "--out",
        str(out),
        "-q",
        *SYNTH,
        *extra,
    )


def test_second_writer_refuses_naming_the_owner(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    pid = os.fork()
    if pid == 0:  # the first writer: holds the lock of `run` until killed
        with runlock.run_lock(run):
            time.sleep(120)
        os._exit(0)
    try:
        lock = runlock.lock_path(run)
        deadline = time.monotonic() + 30
        while not lock.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        line = one_line_error(
            expert_rollout(capsys, tiny_model_dir, run), "in use by", f"pid {pid}", f"host {platform.node()}"
        )
        assert "wait for it" in line
        # the other writing stages refuse too, and nothing of the first writer's is touched
        run.mkdir()
        (run / "manifest.json").write_text("{}")
        before = tree_hash(run)
        one_line_error(cli(capsys, "train", str(run), "--algo", "sft"), f"pid {pid}")
        one_line_error(cli(capsys, "annotate", str(run)), f"pid {pid}")
        assert tree_hash(run) == before
        assert json.loads(lock.read_text())["pid"] == pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_stale_lock_is_taken_over_with_a_warning(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    lock = runlock.lock_path(run)
    gone = dead_pid()
    lock.write_text(json.dumps({"pid": gone, "host": platform.node(), "started": time.time(), "command": ["serl"]}))
    code, _, err = expert_rollout(capsys, tiny_model_dir, run)
    assert code == 0, err
    assert f"took over the lock of {run} from pid {gone}" in err and "no longer running" in err
    assert (run / "rollouts.jsonl").is_file()
    assert not lock.exists()  # released at the end


def test_lock_of_a_killed_writer_is_taken_over_by_resume(tiny_model_dir, tmp_path):
    from support import rollout_config

    from serl_cli.stages.rollout import run_rollout

    run = tmp_path / "run"
    assert kill_during(
        lambda: run_rollout(rollout_config(tiny_model_dir, run)), lambda: (run / "manifest.json").exists()
    )
    assert json.loads(runlock.lock_path(run).read_text())["host"] == platform.node()  # SIGKILL left it behind
    run_rollout(rollout_config(tiny_model_dir, run), resume=True)
    assert not runlock.lock_path(run).exists()


def test_lock_from_another_host_is_never_taken_over(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    lock = runlock.lock_path(run)
    lock.write_text(json.dumps({"pid": 1, "host": "node-017.cluster", "started": 0, "command": ["serl", "rollout"]}))
    one_line_error(expert_rollout(capsys, tiny_model_dir, run), "pid 1 on host node-017.cluster", f"delete {lock}")
    assert not run.exists()


def test_a_lock_file_that_is_not_serl_s(tmp_path):
    run = tmp_path / "run"
    runlock.lock_path(run).write_text("not json")
    with pytest.raises(SerlError, match="is not a serl lock"):
        with runlock.run_lock(run):
            pass


def test_refused_command_leaves_no_directories_behind(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "run"
    one_line_error(
        cli(capsys, "rollout", "--policy", "nosuch", "--out", str(out), *SYNTH), "--policy", "'nosuch' is not one of"
    )
    assert not (tmp_path / "a").exists()


def test_same_ablate_cell_twice_refuses(tmp_path):
    from serl_cli.ablate import cells as ab_cells
    from serl_cli.ablate import grid as ab
    from serl_cli.ablate import grid_record as ab_record

    grid = ab.load_grid(None, overrides=["env.settings.catalog=synthetic"], flags={"algo": "grpo", "seeds": 2})
    record = ab_record.grid_record(grid, [])
    ab_record.write_grid(tmp_path, record)
    cell = ab_cells.cell_dir(tmp_path, record["cells"][0])
    with runlock.run_lock(cell):  # a first runner busy with cell 0
        with pytest.raises(SerlError, match=f"in use by pid {os.getpid()}"):
            ab_cells.run_cell(record, tmp_path, 0, log=lambda m: None)
        assert not cell.exists()  # refused before writing anything


def test_a_reader_names_the_writer_that_holds_the_run(tmp_path):
    """A run read while another process writes it: the refusal names that process, instead of advising
    a resume of a stage that is running this minute."""
    from serl_cli.artifacts import io, runlock
    from serl_cli.artifacts.schema import read_annotations, read_rollouts

    run = tmp_path / "run"
    io.write_json(run / "manifest.json", io.new_manifest("rollout", {}, 0))
    with runlock.run_lock(run):
        assert runlock.writer(run) is None  # the holder reading its own run is no other writer
        lock = runlock.lock_path(run)
        owner = json.loads(lock.read_text())
        other = subprocess.Popen(["sleep", "60"])  # a live process of this host: the lock's holder
        lock.write_text(json.dumps({**owner, "pid": other.pid, "identity": None}))
        try:
            with pytest.raises(SerlError, match=rf"the rollout of {run} is running now, in pid {other.pid} on host"):
                read_rollouts(run)
            io.mark_stage(run, "annotate", "running")
            (run / "annotations.jsonl").write_text("")
            with pytest.raises(SerlError, match=rf"the annotation of {run} is running now, in pid {other.pid}"):
                read_annotations(run)
        finally:
            other.kill()
            other.wait()
            lock.write_text(json.dumps(owner))  # the lock is this process's again, for run_lock to release
    with pytest.raises(SerlError, match="did not finish: run `serl annotate .* --resume` first"):
        read_annotations(run)
