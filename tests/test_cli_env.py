"""The CLI around the environments: `serl eval` with the expert and random policies,
`serl env play`, and the one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import assert_one_line_error, requires_webshop_data, serl


def test_eval_expert_writes_summary(tmp_path):
    requires_webshop_data()
    out = tmp_path / "ev"
    proc = serl(
        "eval", "--env", "webshop", "--policy", "expert", "--split", "test", "--episodes", "40", "--out", str(out)
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "eval.json").read_text())
    for key in ("success_rate", "success_ci95", "score", "episodes", "invalid_action_rate", "mean_turns"):
        assert key in summary
    assert summary["episodes"] == 40
    lo, hi = summary["success_ci95"]
    assert lo <= summary["success_rate"] <= hi
    assert summary["success_rate"] >= 0.9
    assert summary["invalid_action_rate"] == 0.0
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert [e["task_id"] for e in episodes] == list(range(40))
    assert (out / "eval_config.yaml").is_file()
    assert "success rate" in proc.stdout


@pytest.mark.slow
def test_eval_random_is_seeded(tmp_path):
    requires_webshop_data()
    runs = []
    for name in ("a", "b"):
        proc = serl("eval", "--policy", "random", "--episodes", "20", "--seed", "3", "--out", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr
        runs.append((tmp_path / name / "episodes.jsonl").read_text())
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_eval_refuses_to_overwrite(tmp_path):
    requires_webshop_data()
    out = tmp_path / "ev"
    assert serl("eval", "--episodes", "3", "--out", str(out)).returncode == 0
    before = (out / "eval.json").read_bytes()
    assert_one_line_error(serl("eval", "--episodes", "3", "--out", str(out)), "already exists", "--overwrite")
    assert (out / "eval.json").read_bytes() == before
    assert serl("eval", "--episodes", "4", "--out", str(out), "--overwrite").returncode == 0


def test_env_play_script(tmp_path):
    requires_webshop_data()
    proc = serl(
        "env",
        "play",
        "--env",
        "webshop",
        "--split",
        "test",
        "--task",
        "0",
        "--json",
        "--actions",
        "search[decorative pillows];click[nope]",
    )
    assert proc.returncode == 0, proc.stderr
    assert "is not clickable on this page" in proc.stdout
    assert '"Page 1 (Total results: 50)' in proc.stdout or "Page 1 (Total results: 50)" in proc.stdout


def test_env_play_interactive_reads_stdin():
    requires_webshop_data()
    proc = serl("env", "play", "--task", "0", input="search[pillow]\n")
    assert proc.returncode == 0, proc.stderr
    assert "Total results" in proc.stdout


@pytest.mark.parametrize(
    "args,env,needles",
    [
        (["eval", "--env", "nosuchenv"], {}, ["unknown environment 'nosuchenv'"]),
        (["eval", "--split", "dev"], {}, ["unknown webshop split 'dev'"]),
        (["eval", "--episodes", "501"], {}, ["out of range"]),
        (["eval", "--policy", "oracle"], {}, ["--policy", "'oracle' is not one of", "see serl eval --help"]),
        (["env", "play", "--task", "500"], {}, ["task id 500 out of range"]),
        (["env", "play", "--task", "-1"], {}, ["out of range"]),
        (["env", "play", "--actions", " ; "], {}, ["--actions holds no action"]),
        (["eval", "--set", "episodes"], {}, ["malformed --set"]),
        (["eval", "--set", "episodes=many"], {}, ["must be an integer"]),
        (["eval", "--set", "nosuch.key=1"], {}, ["unknown setting nosuch"]),
        (["eval", "--set", "env.settings.catalog=marsupial"], {}, ["unknown WebShop catalog"]),
        (["eval", "--set", "env.settings.flavour=1"], {}, ["bad settings for environment"]),
    ],
)
def test_bad_input_one_line_exit_2(tmp_path, args, env, needles):
    requires_webshop_data()
    assert_one_line_error(
        serl(*args, "--out", str(tmp_path / "o")) if args[0] == "eval" else serl(*args, env=env), *needles
    )
    assert not (tmp_path / "o").exists()


def test_missing_data_dir_is_one_line(tmp_path):
    assert_one_line_error(
        serl("eval", "--out", str(tmp_path / "o"), env={"SERL_DATA_DIR": str(tmp_path)}),
        "WebShop data not found",
        "documents_1k.jsonl",
    )
    assert_one_line_error(
        serl("env", "play", "--set", "settings.catalog=real", env={"SERL_DATA_DIR": ""}), "SERL_DATA_DIR is not set"
    )


def test_malformed_yaml_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("env: {name: webshop\nsplit: [")
    assert_one_line_error(serl("eval", "--config", str(bad), "--out", str(tmp_path / "o")), "malformed YAML", str(bad))
    assert_one_line_error(serl("eval", "--config", str(tmp_path / "nope.yaml")), "config file not found")


@pytest.mark.slow
def test_synthetic_catalog_without_data(tmp_path):
    proc = serl(
        "eval", "--policy", "expert", "--episodes", "20", "--out", str(tmp_path / "ev"), env={"SERL_DATA_DIR": ""}
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert summary["success_rate"] >= 0.9


@pytest.mark.slow
def test_eval_spread_panel_takes_evenly_spaced_tasks(tmp_path):
    out = tmp_path / "ev"
    p = serl(
        "eval", "--episodes", "4", "--panel", "spread", "--out", str(out), "--set", "env.settings.catalog=synthetic"
    )
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    total = json.loads((out / "eval.json").read_text())
    from serl_cli.stages.evaluate import PANELS

    assert PANELS["spread"](4, 10) == [0, 2, 5, 7] and PANELS["first"](3, 10) == [0, 1, 2]
    assert total["panel"] == "spread" and len(rows) == 4
    assert [r["task_id"] for r in rows] == sorted({r["task_id"] for r in rows}) and rows[-1]["task_id"] > 3
    assert_one_line_error(
        serl(
            "eval",
            "--episodes",
            "4",
            "--panel",
            "middle",
            "--out",
            str(tmp_path / "x"),
            "--set",
            "env.settings.catalog=synthetic",
        ),
        "'--panel'",
        "'middle' is not one of 'first', 'spread'",
    )


def test_a_command_loads_only_its_own_module():
    """`serl eval` with bad input fails before torch or transformers is imported (the CLI imports
    the named command's module only); `serl --help` still lists every command."""
    code = (
        "import sys; sys.argv = ['serl', 'eval', '--set', 'episodes=many']\n"
        "from serl_cli.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n"
        "    print(e.code, 'torch' in sys.modules, 'transformers' in sys.modules, 'serl_cli.cli.train' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["2", "False", "False", "False"], proc.stderr
    assert "must be an integer" in proc.stderr
    listed = serl("--help").stdout
    for command in (
        "ablate",
        "annotate",
        "config",
        "data",
        "demo",
        "env",
        "eval",
        "model",
        "plot",
        "rollout",
        "show",
        "train",
    ):
        assert f" {command} " in listed, command
