"""Environments as plugins: `--env package.module:factory`, the `serl.envs` entry-point group,
and one-line errors for each way a plugin can be wrong.

The plugin is the example of docs/ENVIRONMENTS.md, taken from the page as written (between
its `<!-- example: PATH -->` and `<!-- end example -->` markers), so the page cannot drift
from what is tested.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import envs
from envs import EnvError, make_world

DOC = Path(__file__).resolve().parent.parent / "docs" / "ENVIRONMENTS.md"

# helpers beside the example, for the error cases
BAD_MODULE = """
def not_a_world(**settings):
    return {"name": "x", "splits": ["test"]}


def half_a_world(**settings):
    class Half:
        name, rules, eval_split = "half", "", "test"
        splits = ["test"]  # an attribute, not a method

        def num_tasks(self, split):
            return 1

    return Half()


def broken(**settings):
    raise TypeError("make() got an unexpected keyword argument 'colour'\\nsecond line")


NOT_CALLABLE = 42
"""


def doc_example(path: str) -> str:
    text = DOC.read_text()
    m = re.search(rf"<!-- example: {re.escape(path)} -->\n```python\n(.*?)```\n<!-- end example -->", text, re.S)
    assert m, f"docs/ENVIRONMENTS.md has no example block for {path}"
    return m.group(1)


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """tmp_path/mypkg/{myenv,bad}.py on sys.path; mypkg is dropped from sys.modules before and after."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "myenv.py").write_text(doc_example("mypkg/myenv.py"))
    (pkg / "bad.py").write_text(BAD_MODULE)
    (pkg / "fails_import.py").write_text("import serl_no_such_dependency_xyz\n")
    (pkg / "raises.py").write_text("raise RuntimeError('no licence key\\nsecond line')\n")

    def forget():
        for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
            del sys.modules[name]

    forget()
    monkeypatch.syspath_prepend(str(tmp_path))  # restores sys.path afterwards
    yield tmp_path
    forget()


def add_entry_points(root: Path, lines: str, dist: str = "mypkg_plugin") -> None:
    """A fake installed distribution: importlib.metadata finds *.dist-info folders on sys.path."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[serl.envs]\n{lines}\n")


# -- (a) package.module:factory in-process ------------------------------------------------------


def test_module_factory_builds_a_world(plugin_dir):
    world = make_world("mypkg.myenv:make", high=10, max_turns=5)
    assert world.name == "guess" and world.eval_split in world.splits() and world.num_tasks("test") == 200
    episode = world.new_episode("test")
    step = episode.reset(3)
    assert step.admissible_actions == [f"guess {n}" for n in range(1, 11)]
    while not step.done:
        step = episode.step(step.expert_action)
    assert step.info["won"] and step.reward == 1.0
    with pytest.raises(EnvError, match="out of range"):
        world.new_episode("test").reset(200)


def test_doc_test_passes(plugin_dir):
    namespace: dict = {}
    exec(compile(doc_example("test_myenv.py"), "test_myenv.py", "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_")]
    assert tests
    for test in tests:
        test()


def test_yaml_config_names_a_plugin(plugin_dir, tmp_path):
    from serl_cli.config import resolve
    from serl_cli.stages.evaluate import EvalConfig, run_eval

    cfg_file = tmp_path / "eval.yaml"
    cfg_file.write_text(
        "env:\n  name: mypkg.myenv:make\n  settings: {high: 1000, max_turns: 10}\n"
        f"policy: expert\nepisodes: 5\nout: {tmp_path / 'ev'}\n"
    )
    cfg = resolve(EvalConfig, config_file=str(cfg_file), flags={}, overrides=[])
    summary = run_eval(cfg)
    assert summary["env"] == "mypkg.myenv:make" and summary["episodes"] == 5
    assert summary["success_rate"] == 1.0  # bisecting 1..1000 takes at most 10 guesses


# -- (b) the real CLI in a subprocess -------------------------------------------------------------


def serl(*args: str, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "SERL_THREADS": "1",
        "COLUMNS": "200",
    }
    return subprocess.run(
        [sys.executable, "-m", "serl_cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli_eval_with_a_plugin(plugin_dir, tmp_path):
    results = {}
    for policy in ("random", "expert"):
        out = tmp_path / f"ev-{policy}"
        proc = serl(
            "eval",
            "--env",
            "mypkg.myenv:make",
            "--policy",
            policy,
            "--episodes",
            "5",
            "--out",
            str(out),
            pythonpath=plugin_dir,
        )
        assert proc.returncode == 0, proc.stderr
        results[policy] = json.loads((out / "eval.json").read_text())
        assert results[policy]["env"] == "mypkg.myenv:make" and results[policy]["episodes"] == 5
        assert 0.0 <= results[policy]["success_rate"] <= 1.0
        assert len((out / "episodes.jsonl").read_text().splitlines()) == 5
    assert results["expert"]["success_rate"] == 1.0
    assert results["expert"]["invalid_action_rate"] == 0.0


def test_cli_bad_plugin_is_one_line(plugin_dir):
    proc = serl(
        "eval",
        "--env",
        "mypkg.nothere:make",
        "--policy",
        "random",
        "--episodes",
        "1",
        "--out",
        str(plugin_dir / "ev-bad"),
        pythonpath=plugin_dir,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot import module 'mypkg.nothere'" in lines[0]


# -- (c) the serl.envs entry-point group -----------------------------------------------------------


def test_entry_point_name(plugin_dir):
    add_entry_points(plugin_dir, "myenv = mypkg.myenv:make\nwebshop = mypkg.myenv:make\nnomod = mypkg.gone:make")
    world = make_world("myenv", high=10)
    assert world.name == "guess" and world.new_episode("test").reset(0).admissible_actions[-1] == "guess 10"
    names = envs.env_names()
    assert "myenv" in names and names.count("webshop") == 1
    # a built-in name wins over an entry point that claims it
    factory, plugin = envs._factory("webshop")
    assert factory is envs._REGISTRY["webshop"] and not plugin
    with pytest.raises(EnvError) as e:
        make_world("nope")
    assert "unknown environment 'nope'" in str(e.value) and "myenv" in str(e.value)
    with pytest.raises(EnvError, match=r"environment 'nomod': cannot import module 'mypkg.gone'"):
        make_world("nomod")


def test_entry_points_are_read_only_for_unknown_names(monkeypatch):
    calls = []
    monkeypatch.setattr(envs, "_entry_points", lambda: calls.append(1) or [])
    monkeypatch.setitem(envs._REGISTRY, "toy", lambda **settings: "built-in")
    assert make_world("toy") == "built-in"  # built-ins are not checked against the protocol either
    assert calls == []
    with pytest.raises(EnvError, match="unknown environment"):
        make_world("not-built-in")
    assert calls


# -- (d) one-line errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, settings, expected",
    [
        ("nope", {}, "unknown environment 'nope': choose one of "),
        ("mypkg.nothere:make", {}, "cannot import module 'mypkg.nothere': No module named 'mypkg.nothere' (install it"),
        (
            "nothere_pkg_xyz.env:make",
            {},
            "cannot import module 'nothere_pkg_xyz.env': No module named 'nothere_pkg_xyz'",
        ),
        (
            "mypkg.fails_import:make",
            {},
            "cannot import module 'mypkg.fails_import': No module named 'serl_no_such_dependency_xyz'",
        ),
        ("mypkg.raises:make", {}, "importing module 'mypkg.raises' raised RuntimeError: no licence key"),
        ("mypkg.myenv:nope", {}, "'mypkg.myenv' has no attribute 'nope'"),
        ("mypkg.myenv:GuessWorld.nope", {}, "'mypkg.myenv.GuessWorld' has no attribute 'nope'"),
        ("mypkg.bad:NOT_CALLABLE", {}, "mypkg.bad.NOT_CALLABLE is not callable (a int)"),
        (
            "mypkg.myenv:make",
            {"colour": "red"},
            "bad settings for environment 'mypkg.myenv:make': make() got an unexpected keyword argument 'colour'",
        ),
        ("mypkg.bad:broken", {}, "unexpected keyword argument 'colour'"),
        (
            "mypkg.bad:not_a_world",
            {},
            "returned a dict that is not a world (missing or not callable: name, rules, eval_split, splits, "
            "num_tasks, new_episode;",
        ),
        (
            "mypkg.bad:half_a_world",
            {},
            "returned a Half that is not a world (missing or not callable: new_episode, splits;",
        ),
        (":make", {}, "bad environment ':make': write a factory as package.module:function"),
        ("mypkg.myenv:", {}, "bad environment 'mypkg.myenv:': write a factory as package.module:function"),
    ],
)
def test_bad_plugins_give_one_line(plugin_dir, name, settings, expected):
    with pytest.raises(EnvError) as e:
        make_world(name, **settings)
    message = str(e.value)
    assert expected in message
    assert "\n" not in message
