"""What a newcomer tried that went wrong: the WebShop catalog that ran is
said and recorded, Ctrl-C says how to resume, `serl env play` says how to quit, and the help
and refusals say what is true of each command."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import serl, webshop_data_dir

from serl_cli.ablate.runners import SELF_CMD
from serl_cli.cli import root

WITHOUT_DATA = {"SERL_DATA_DIR": ""}  # a fresh shell: the README's export not done
NOTE = "note: SERL_DATA_DIR is not set, so WebShop runs on serl's synthetic catalog"


# -- the WebShop catalog: said on stderr, recorded in every manifest and eval.json ---------------


def test_auto_catalog_without_data_says_so_once_and_records_it(tmp_path, tiny_model_dir):
    p = serl(
        "eval",
        "--env",
        "webshop",
        "--policy",
        "expert",
        "--episodes",
        "2",
        "--out",
        str(tmp_path / "ev"),
        env=WITHOUT_DATA,
    )
    assert p.returncode == 0, p.stderr
    assert p.stderr.count(NOTE) == 1 and "export SERL_DATA_DIR=" in p.stderr
    synthetic = {"name": "webshop", "catalog": "synthetic", "catalog_source": "synthetic:n=200,seed=0", "products": 200}
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["environment"] == synthetic
    ro = tmp_path / "ro"
    args = ["rollout", "--policy", "expert", "--model", str(tiny_model_dir), "--tasks", "1", "--group-size", "1"]
    p = serl(*args, "--max-turns", "2", "--out", str(ro), env=WITHOUT_DATA)
    assert p.returncode == 0 and p.stderr.count(NOTE) == 1, p.stderr
    assert json.loads((ro / "manifest.json").read_text())["environment"] == synthetic
    # chosen on purpose: nothing to warn about
    p = serl("env", "play", "--set", "settings.catalog=synthetic", "--actions", "search[pillow]", env=WITHOUT_DATA)
    assert p.returncode == 0 and NOTE not in p.stderr, p.stderr
    if webshop_data_dir() is not None:  # the real catalog where the data is there
        p = serl("eval", "--policy", "expert", "--episodes", "1", "--out", str(tmp_path / "real"))
        assert p.returncode == 0 and NOTE not in p.stderr, p.stderr
        env = json.loads((tmp_path / "real" / "eval.json").read_text())["environment"]
        assert env["catalog"] == "real" and env["catalog_source"].startswith("webshop-1k:")


# -- Ctrl-C: exit 130 and the exact command that continues ----------------------------------


def test_ctrl_c_says_the_command_that_resumes_and_that_command_finishes(tmp_path, tiny_model_dir):
    out = tmp_path / "ro"
    # one episode at a time, 8 of them: when the first round is journaled, seconds of work are left
    args = ["rollout", "--model", str(tiny_model_dir), "--tasks", "4", "--group-size", "2", "--max-turns", "6"]
    args += ["--set", "env.settings.catalog=synthetic", "--set", "sampling.max_new_tokens=16", "--threads", "1"]
    args += ["--set", "batch_size=1"]
    args += ["--out", str(out), "--overwrite"]
    env = {**os.environ, "COLUMNS": "400", "SERL_THREADS": "1"}
    # as a terminal's foreground process: SIGINT not ignored (a CI script started in the background with `&`
    # hands its children SIGINT ignored, and Python then leaves it so)
    p = subprocess.Popen(
        [*SELF_CMD, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    journal = out / "rollouts.journal.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None:
        if journal.is_file() and journal.read_bytes().count(b"\n") >= 2:  # a round is journaled
            break
        time.sleep(0.005)
    # frozen the moment a round is journaled, so the interrupt finds the rollout running however
    # late this poll ran (a busy machine once let it finish first: exit 0)
    os.kill(p.pid, signal.SIGSTOP)
    assert p.poll() is None, p.communicate()[1][-2000:]
    assert not (out / "rollouts.jsonl").exists(), "the rollout finished before it could be interrupted"
    p.send_signal(signal.SIGINT)  # what Ctrl-C sends: pending until the child runs again
    os.kill(p.pid, signal.SIGCONT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]
    line = [x for x in err.splitlines() if "interrupted (Ctrl-C)" in x]
    assert len(line) == 1 and "Traceback" not in err, err
    command = line[0].split("continue with: ", 1)[1]
    assert command.startswith("serl rollout ") and command.endswith(" --resume") and "--overwrite" not in command
    q = subprocess.run([*SELF_CMD, *shlex.split(command)[1:]], capture_output=True, text=True, env=env, timeout=300)
    assert q.returncode == 0, q.stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["stages"]["rollout"]["status"] == "done"
    assert len((out / "rollouts.jsonl").read_text().splitlines()) == 8


def test_ctrl_c_line_by_command(tmp_path, monkeypatch):
    monkeypatch.setattr(root, "_resume_check", {})
    assert root.interrupted_line(["eval", "--out", "x"]) == "interrupted (Ctrl-C)"
    assert root.interrupted_line(["annotate", "runs/r"]).endswith("continue with: serl annotate runs/r --resume")
    assert root.interrupted_line(["ablate", "g.yaml", "--out", "a"]).endswith("rerun it: serl ablate g.yaml --out a")
    run = tmp_path / "my run"
    root.resumable_at(str(run))  # `serl train --out RUN`: nothing written yet
    line = root.interrupted_line(["train", "--out", str(run), "--overwrite"])
    assert "before the run wrote anything" in line
    run.mkdir()
    (run / "manifest.json").write_text("{}")
    line = root.interrupted_line(["train", "--out", str(run), "--overwrite"])
    assert line.endswith(f"continue with: serl train --out '{run}' --resume")


# -- smaller items ---------------------------------------------------------------------------


def test_env_play_says_how_to_quit_and_quit_is_no_action():
    p = serl("env", "play", "--set", "settings.catalog=synthetic", input="quit\n")
    assert p.returncode == 0, p.stderr
    assert "quit, exit, Ctrl-D or Ctrl-C stops" in p.stdout
    assert "episode stopped: reward 0.0, 0 turns" in p.stdout  # "quit" never reached the shop


@pytest.mark.slow
def test_refusals_and_help_say_what_each_command_has(tmp_path):
    out = tmp_path / "ev"
    args = ["eval", "--policy", "expert", "--episodes", "1", "--set", "env.settings.catalog=synthetic"]
    assert serl(*args, "--out", str(out)).returncode == 0
    p = serl(*args, "--out", str(out))
    assert p.returncode == 2 and "pass --overwrite to replace it" in p.stderr and "--resume" not in p.stderr
    from serl_cli.models.tiny import PRESETS

    help_text = serl("model", "init", "--help").stdout
    assert all(f"{name} (~" in help_text for name in PRESETS), help_text  # micro too


def test_plot_names_its_extra(tmp_path, monkeypatch):
    """Without matplotlib: one line naming the `plots` extra."""
    from serl_cli.errors import SerlError
    from serl_cli.views.plot import plot_run

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "mean_reward": 0.5}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a missing package looks like to import
    with pytest.raises(SerlError, match=r"plots extra: pip install 'serl\[plots\]'"):
        plot_run(str(tmp_path))
    assert not Path(tmp_path / "curves.png").exists()
