"""Inputs that used to trap a researcher.

The SLURM scripts run the same from any directory; a file in --out's way and a malformed
$SERL_THREADS are one line; a --set path means the same with or without a config; ``serl plan
--gpus`` plans for that many GPUs and counts a tiny model's parameters; ``--help`` shows every
switch as it is accepted, and extras with their brackets; repeated ``--config`` composes in
``serl demo`` as in the other commands. The CLI runs in-process (:func:`cli`) where the process
itself is not under test.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import typer
import yaml
from support import tiny_grid
from typer.testing import CliRunner

from serl_cli.cli import COMMAND_MODULES
from serl_cli.cli.root import app, run

try:  # the click typer builds its commands with: its own copy in recent typer versions
    from typer import _click as click
except ImportError:
    import click

ROOT = Path(__file__).resolve().parent.parent

for _module in set(COMMAND_MODULES.values()):  # importing a command module registers it on the app
    importlib.import_module(f"serl_cli.cli.{_module}")


def cli(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    """``serl ARGS`` in this process, as the entry point runs it (SerlError: one line, exit 2)."""
    monkeypatch.setattr(sys, "argv", ["serl", *args])
    code = 0
    try:
        run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code: int, err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


# -- the job array runs the same from any directory --------------------------------------


def test_slurm_scripts_run_from_where_they_were_written(tmp_path, tiny_model_dir, monkeypatch, capsys):
    work = tmp_path / "project"
    (work / "models").mkdir(parents=True)
    (work / "models" / "tiny").symlink_to(tiny_model_dir)
    grid = tiny_grid(work, Path("models/tiny"), algos=("grpo",), seeds=1)
    monkeypatch.chdir(work)
    code, _, err = cli(capsys, monkeypatch, "ablate", "grid.yaml", "--out", "runs/abl", "--emit", "slurm")
    assert code == 0, err
    out = work / "runs" / "abl"
    record = json.loads((out / "grid.json").read_text())
    # the model is recorded where it is, so the cell finds it from any directory
    assert record["base"]["model"] == str((work / "models" / "tiny").resolve())
    from serl_cli.ablate.cells import cell_config

    monkeypatch.chdir(tmp_path)  # the cell, run from elsewhere
    assert Path(cell_config(record, out, record["cells"][0]).model).is_dir()
    for script in ("ablate.sbatch", "report.sbatch"):
        lines = (out / script).read_text().splitlines()
        assert f"#SBATCH --chdir={work}" in lines, script
    assert f"cd {work}" in (out / "ablate.sbatch").read_text().splitlines()
    assert grid.is_file()


def test_a_setup_that_activates_an_environment_runs_its_python(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The paper grids source $SERL_VENV/bin/activate: every program of the scripts is then that
    environment's python, not the absolute interpreter of the venv that wrote them."""
    grid = tiny_grid(tmp_path, tiny_model_dir, algos=("grpo",), seeds=1)
    data = yaml.safe_load(grid.read_text())
    data["slurm"]["setup"] = ['source "${SERL_VENV:?set SERL_VENV}/bin/activate"']
    data["base"]["train"].update(backend="deepspeed")
    data["slurm"]["gpus"] = 2
    grid.write_text(yaml.safe_dump(data))
    out = tmp_path / "abl"
    code, _, err = cli(capsys, monkeypatch, "ablate", str(grid), "--out", str(out), "--emit", "slurm")
    assert code == 0, err
    text = (out / "ablate.sbatch").read_text() + (out / "report.sbatch").read_text()
    assert sys.executable not in text
    assert "${TORCHRUN:-python -m torch.distributed.run} --standalone" in text
    assert "${SERL:-python -m serl_cli} ablate --report" in text


# -- tracebacks -----------------------------------------------------------------------------


def test_out_naming_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "f").write_text("not a folder")
    code, _, err = cli(
        capsys, monkeypatch, "rollout", "--env", "sokoban", "--policy", "expert", "--out", str(tmp_path / "f")
    )
    assert_one_line(code, err, str(tmp_path / "f"), "is a file, not a directory")
    code, _, err = cli(capsys, monkeypatch, "eval", "--env", "sokoban", "--out", str(tmp_path / "f" / "sub"))
    assert_one_line(code, err, "is a file, not a directory")
    assert (tmp_path / "f").read_text() == "not a folder"


@pytest.mark.parametrize("value", ["two", "0", "-1"])
def test_a_malformed_serl_threads_is_one_line(value, tmp_path, tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("SERL_THREADS", value)
    code, _, err = cli(
        capsys,
        monkeypatch,
        "eval",
        "--env",
        "sokoban",
        "--model",
        str(tiny_model_dir),
        "--episodes",
        "1",
        "--out",
        str(tmp_path / "e"),
    )
    assert_one_line(code, err, "SERL_THREADS", repr(value))


@pytest.mark.parametrize(
    "args,needle",
    [
        (["rollout", "--tasks", "many"], "'--tasks'"),  # not a number
        (["rollout", "--tsks", "3"], "--tsks"),  # no such flag
        (["annotate"], "'run'"),  # an argument missing
    ],
)
def test_a_usage_error_is_one_line(args, needle, capsys, monkeypatch):
    code, _, err = cli(capsys, monkeypatch, *args)
    assert_one_line(code, err, needle, f"(see serl {args[0]} --help)")


def test_no_command_still_shows_the_help(capsys, monkeypatch):
    code, out, err = cli(capsys, monkeypatch)
    assert "Usage" in out + err and "rollout" in out + err


# -- one --set scheme ----------------------------------------------------------------------


def test_a_run_file_path_in_set_works_without_a_run_file(tmp_path, monkeypatch, capsys):
    from serl_cli.cli.common import resolve
    from serl_cli.stages.rollout import RolloutConfig

    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump({"env": {"name": "sokoban"}, "iterations": 1}))
    key = "rollout.prompt.bare_replies=true"
    with_file = resolve(RolloutConfig, config_file=[str(run_file)], overrides=[key], flags={}, command="rollout")
    without = resolve(RolloutConfig, config_file=None, overrides=[key], flags={}, command="rollout")
    assert with_file.prompt.bare_replies and without.prompt.bare_replies
    # the command's own path still works, and the run itself
    own = resolve(RolloutConfig, config_file=None, overrides=["prompt.bare_replies=true"], flags={}, command="rollout")
    assert own.prompt.bare_replies
    out = tmp_path / "r"
    code, _, err = cli(
        capsys,
        monkeypatch,
        *("rollout", "--env", "sokoban", "--policy", "expert", "--tasks", "1", "--group-size", "1"),
        *("--out", str(out), "--set", key, "-q"),
    )
    assert code == 0, err
    assert yaml.safe_load((out / "rollout.yaml").read_text())["prompt"]["bare_replies"] is True


def test_ablate_set_takes_the_grid_files_paths(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """``--set base.iterations=30`` is the grid file's base.iterations (the same as
    ``iterations=30``, the base's); grid., slurm., final_eval. paths set those sections."""
    from serl_cli.ablate import grid as ab

    grid = tiny_grid(tmp_path, tiny_model_dir, algos=("grpo",), seeds=1)
    g = ab.load_grid(str(grid), overrides=["base.iterations=30"])
    assert g.base["iterations"] == 30
    assert ab.load_grid(str(grid), overrides=["iterations=30"]).base == g.base
    g = ab.load_grid(
        str(grid),
        overrides=["grid.seeds=3", "slurm.partition=long", "final_eval.episodes=5", "base.train.optim.lr=0.5"],
    )
    assert g.axes["seeds"] == [0, 1, 2] and g.slurm["partition"] == "long" and g.final_eval["episodes"] == 5
    assert g.base["train"]["optim"]["lr"] == 0.5
    out = tmp_path / "abl"
    code, _, err = cli(
        capsys, monkeypatch, "ablate", str(grid), "--out", str(out), "--set", "base.iterations=30", "--emit", "slurm"
    )
    assert code == 0, err
    assert json.loads((out / "grid.json").read_text())["base"]["iterations"] == 30
    code, _, err = cli(capsys, monkeypatch, "ablate", str(grid), "--out", str(out), "--set", "base.iteratons=3")
    assert_one_line(code, err, "unknown setting base.iteratons", "did you mean base.iterations?")


# -- serl plan --gpus ------------------------------------------------------------------------


def test_plan_replans_the_layout_for_gpus(monkeypatch, capsys):
    paper = str(ROOT / "experiments" / "alfworld" / "paper" / "serl.yaml")
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = cli(capsys, monkeypatch, "plan", paper, "--gpus", "1")
    assert code in (0, 1), err
    assert "planned for 1: trainer on GPU 0, 1 vLLM engine(s) of TP 1 on the same GPUs" in err
    assert "on 1 trainer GPU(s); vLLM colocated, one engine per 1 GPU(s)" in out
    code, out, err = cli(capsys, monkeypatch, "plan", paper, "--gpus", "4")  # data parallel: 2 engines of TP 2
    assert "(trainer on GPUs 0-7, a vLLM engine per 2 of them) needs 8 GPUs per node" in err
    assert "trainer on GPUs 0-3, 2 vLLM engine(s) of TP 2 on the same GPUs" in err
    assert "on 4 trainer GPU(s); vLLM colocated, one engine per 2 GPU(s)" in out
    split = ["--set", "train.gpus=[0,1,2,3,4,5]", "--set", "rollout.gpus=[6,7]"]
    split += ["--set", "rollout.vllm.data_parallel=false", "--set", "rollout.vllm.sleep=false"]
    code, out, err = cli(capsys, monkeypatch, "plan", paper, "--gpus", "4", *split)
    assert "trainer on GPUs 0-1, vLLM on GPUs 2-3" in err and "on 2 trainer GPU(s); vLLM on 2 GPU(s)" in out
    code, out, err = cli(capsys, monkeypatch, "plan", paper)  # no --gpus: the config's own 8
    assert "note:" not in err and "on 8 trainer GPU(s); vLLM colocated, one engine per 2 GPU(s)" in out


def test_parameter_counts_of_tiny_models():
    from serl_cli.online.plan import count

    assert count(7.615e9) == "7.62B" and count(494e6) == "494M" and count(4.2e5) == "420K"
    assert count(1234) == "1.23K" and count(856) == "856"


def test_plan_names_a_tiny_models_size(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from serl_cli.models.shapes import model_shape
    from serl_cli.online.plan import count

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": str(tiny_model_dir)}))
    monkeypatch.setenv("COLUMNS", "300")
    code, out, err = cli(capsys, monkeypatch, "plan", str(config), "--gpus", "1")
    assert code in (0, 1), err
    params = model_shape(str(tiny_model_dir)).params
    assert f"({count(params)} parameters)" in out and "0.00B" not in out


# -- --help as it is accepted ----------------------------------------------------------------


def _commands():
    # every command registered (a command module registers itself when imported, and which ones a
    # worker has imported depends on the tests it ran) and in one order: xdist workers must agree
    import importlib

    from serl_cli.cli import COMMAND_MODULES

    for name in sorted(set(COMMAND_MODULES.values())):
        importlib.import_module(f"serl_cli.cli.{name}")
    root = typer.main.get_command(app)

    def walk(cmd, path):
        if hasattr(cmd, "commands"):  # a group (env, data, model, config)
            for name, sub in cmd.commands.items():
                yield from walk(sub, [*path, name])
        else:
            yield path, cmd

    return sorted(walk(root, []), key=lambda pc: pc[0])


SAMPLES = {"bool": "true", "int": "100", "float": "0.5", "str": "x", "text": "x"}  # by the shown type's first word


def _sample(shown: str) -> str:
    """A value of the type --help shows: its first word for a choice (``auto|cpu|cuda``)."""
    shown = re.sub(r"list\[(.*)\]", r"\1", shown).split()[0]
    return shown.split("|")[0] if "|" in shown else SAMPLES[shown]


def _shown_rows(help_text: str, option) -> list[tuple[str, str | None]]:
    """(name, the type --help shows for it or None) for each of the option's names on its row."""
    names = [n for n in (*option.opts, *option.secondary_opts) if n.startswith("--")]
    for line in help_text.splitlines():
        fields = [f for f in re.split(r"\s{2,}", line.strip("│ ").strip()) if f]
        if fields and fields[0] == names[0]:
            shown = next((m.group(1) for f in fields if (m := re.match(r"<([^>]+)>", f))), None)
            return [(n, shown) for n in names]
    raise AssertionError(f"{names[0]} is not in the help:\n{help_text}")


@pytest.mark.parametrize("path,cmd", _commands(), ids=[" ".join(p) for p, _ in _commands()])
def test_every_flag_is_accepted_as_help_shows_it(path, cmd):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    required = ["x" for p in cmd.params if p.param_type_name == "argument" and p.required]
    for option in cmd.params:
        if option.param_type_name != "option" or option.hidden or option.name in ("help", "version"):
            continue
        for name, shown in _shown_rows(result.output, option):
            value = [] if shown is None else [_sample(shown)]
            args = [name, *value, *required]
            try:
                cmd.make_context(" ".join(["serl", *path]), list(args))
            except click.ClickException as e:  # a usage error: no such option, a value missing or extra
                pytest.fail(f"serl {' '.join(path)} {' '.join(args)}: {e.format_message()} (--help shows {shown})")


def test_help_keeps_an_extras_brackets():
    result = CliRunner().invoke(app, ["plot", "--help"], env={"COLUMNS": "250"})
    assert "pip install 'serl[plots]'" in result.output


def test_demo_composes_repeated_config_files(tmp_path, monkeypatch, capsys):
    from serl_cli.cli import demo as demo_cli

    seen = {}

    def stop(cfg, **kw):  # the demo itself is not under test: the configuration it is given is
        seen["cfg"] = cfg
        raise SystemExit(0)

    monkeypatch.setattr(demo_cli, "run_demo", stop)
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text(yaml.safe_dump({"expert_tasks": 11}))
    second.write_text(yaml.safe_dump({"eval_episodes": 7}))
    code, _, err = cli(
        capsys, monkeypatch, "demo", "--config", str(first), "--config", str(second), "--out", str(tmp_path / "d")
    )
    assert code == 0, err
    assert seen["cfg"].expert_tasks == 11 and seen["cfg"].eval_episodes == 7
