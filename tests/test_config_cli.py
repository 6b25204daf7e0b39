"""`serl config show`, composed --config files and "did you mean" for unknown keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from support import assert_one_line_error, serl

from serl_cli import config as cfgmod
from serl_cli.errors import SerlError
from serl_cli.online.config import OnlineConfig
from serl_cli.rollout.worlds import EnvConfig

SERL_YAML = str(Path(__file__).resolve().parent.parent / "experiments" / "webshop" / "serl.yaml")


def test_config_show_prints_the_complete_resolved_config():
    p = serl("config", "show", "train", "--config", SERL_YAML, "--set", "train.optim.lr=1e-5")
    assert p.returncode == 0, p.stderr
    shown = yaml.safe_load(p.stdout)
    assert shown["train"]["optim"]["lr"] == 1e-5  # --set wins
    assert shown["train"]["algo"] == "serl" and shown["env"]["name"] == "webshop"  # from the file
    assert shown["train"]["optim"]["grad_clip"] == 1.0 and "annotate" in shown and "rollout" in shown  # every section
    # as RUN/online.yaml holds it: each setting once, none of the loop's own copies
    assert p.stdout.count("seed:") == 1 and p.stdout.count("\nout:") + p.stdout.count(" out:") == 1
    assert "env" not in shown["rollout"] and "model" not in shown["train"]


def test_config_show_defaults_and_bad_input():
    p = serl("config", "show", "eval", "--defaults")
    assert p.returncode == 0 and "episodes:" in p.stdout
    assert_one_line_error(serl("config", "show", "nope"), "unknown command 'nope'")


def test_repeated_config_files_compose_left_to_right(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("iterations: 3\ntrain: {algo: grpo, optim: {lr: 0.1}}\n")
    b.write_text("train: {optim: {lr: 0.2}}\n")
    cfg = cfgmod.resolve(OnlineConfig, config_file=[str(a), str(b)], flags={}, overrides=[])
    assert (cfg.iterations, cfg.train.algo, cfg.train.optim.lr) == (3, "grpo", 0.2)  # b's section merges into a's
    p = serl("config", "show", "train", "--config", str(a), "--config", str(b))
    assert yaml.safe_load(p.stdout)["train"]["optim"]["lr"] == 0.2


def test_unknown_key_suggests_the_closest():
    with pytest.raises(SerlError, match=r"unknown setting train\.kl_cof: did you mean train\.kl_coef\?"):
        cfgmod.resolve(OnlineConfig, config_file=None, flags={}, overrides=["train.kl_cof=0.1"])
    with pytest.raises(SerlError) as info:  # nothing close: no guess, the known keys
        cfgmod.resolve(OnlineConfig, config_file=None, flags={}, overrides=["train.optim.zzz=1"])
    assert "did you mean" not in str(info.value) and "known: " in str(info.value)


def test_help_shows_the_effective_defaults():
    from serl_cli.stages.rollout import RolloutConfig

    p = serl("rollout", "--help", env={"COLUMNS": "200"})
    line = next(ln for ln in p.stdout.splitlines() if "--tasks" in ln)
    assert f"[default: ({RolloutConfig().tasks})]" in line


def test_single_update_honours_out_and_warns_without_gradient(tiny_model_dir, tmp_path):
    """A random-init model never succeeds: every group's rewards are equal, so the update has no gradient."""
    from support import rollout_config

    from serl_cli.stages.rollout import run_rollout

    run = tmp_path / "run"
    run_rollout(rollout_config(tiny_model_dir, run, tasks=1, group_size=2, max_new_tokens=4))
    run_file = tmp_path / "run.yaml"  # a whole run's file: the single update reads its train section and says so
    run_file.write_text("iterations: 3\nrollout: {tasks: 4}\ntrain: {algo: grpo}\n")
    p = serl("train", str(run), "--config", str(run_file), "--out", str(tmp_path / "ckpt"), "--threads", "1")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "ckpt" / "config.json").is_file() and not (run / "checkpoint").exists()
    assert "no turn had a gradient" in p.stderr
    assert "note: ignoring iterations, rollout of the run config" in p.stderr


def test_live_table_of_the_online_loop_shows_the_last_iterations():
    from rich.console import Console

    from serl_cli.cli.train import iterations_table

    rows = [{"iteration": i, "mean_reward": 0.1 * i, "success_rate": 0.0, "loss": 0.5} for i in range(3)]
    rows[-1]["eval_success_rate"] = 0.25
    console = Console(width=150, record=True)
    console.print(iterations_table(rows, total=10))
    text = console.export_text()
    assert "iteration 3 of 10" in text and "eval" in text and "0.25" in text
    assert "weight mean" not in text  # a GRPO run logs no SERL weights: no empty column


# ------------------------------------------------------------------ a run file read by serl eval / rollout
GRPO_YAML = str(Path(__file__).resolve().parent.parent / "experiments" / "webshop" / "grpo.yaml")


def _count_keys(node, name: str) -> int:
    if not isinstance(node, dict):
        return 0
    return sum((k == name) + _count_keys(v, name) for k, v in node.items())


def test_eval_takes_a_training_config_and_reads_its_eval_section(tmp_path):
    """`serl eval --config grpo.yaml`: the sections eval does not use pass without a note (a run
    file always has them: the tutorial's evaluation printed "note: ignoring iterations ..."); the
    file's eval section (here from a second file composed on top) sets the evaluation's temperature."""
    extra = tmp_path / "eval_section.yaml"
    extra.write_text("eval: {temperature: 0.4, episodes: 2}\n")
    out = tmp_path / "ev"
    p = serl(
        "eval",
        "--config",
        GRPO_YAML,
        "--config",
        str(extra),
        "--set",
        "env.settings.catalog=synthetic",
        "--max-turns",
        "2",
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr
    notes = [ln for ln in p.stderr.splitlines() if ln.startswith("note:")]
    assert notes == [], p.stderr
    saved = yaml.safe_load((out / "eval_config.yaml").read_text())
    assert saved["temperature"] == 0.4 and saved["episodes"] == 2  # the eval section
    assert saved["max_new_tokens"] == 32 and saved["history_turns"] == 2  # the rollouts' budget and prompt
    assert saved["env"]["max_turns"] == 2 and saved["env"]["split"] != "train"  # a flag wins; not the training split
    assert yaml.safe_load((out / "eval.json").read_text())["episodes"] == 2


def test_a_run_file_maps_onto_eval_and_rollout_settings(tmp_path, capsys):
    from serl_cli.cli.common import resolve
    from serl_cli.stages.evaluate import EvalConfig
    from serl_cli.stages.rollout import RolloutConfig

    cfg = resolve(EvalConfig, config_file=[GRPO_YAML], overrides=[], flags={}, command="eval")
    assert cfg.temperature == 0.0 and cfg.episodes is None  # no eval.temperature: greedy; eval.episodes 0: all
    assert (cfg.env.name, cfg.env.split, cfg.env.max_turns) == ("webshop", None, 15)
    assert capsys.readouterr().err == ""  # the file's other sections are the loop's: no note
    resolve(EvalConfig, config_file=[GRPO_YAML], overrides=["iterations=3"], flags={}, command="eval")
    assert "note: ignoring --set iterations of the run config (not used by serl eval)" in capsys.readouterr().err
    cfg = resolve(
        EvalConfig,
        config_file=[GRPO_YAML],
        overrides=["eval.temperature=0.3", "temperature=0.2"],
        flags={},
        command="eval",
        quiet=True,
    )
    assert cfg.temperature == 0.2 and capsys.readouterr().err == ""  # eval's own --set key last; -q: no note
    cfg = resolve(EvalConfig, config_file=[GRPO_YAML], overrides=["eval.temperature=0.3"], flags={}, command="eval")
    assert cfg.temperature == 0.3  # a --set key in the run file's layout
    # serl rollout: the rollout section as an iteration runs it, with the run's env, model, seed
    old = tmp_path / "old_online.yaml"  # an online.yaml as written before: per-stage copies of env, seed, out
    old.write_text(
        yaml.safe_dump(
            dataclasses.asdict(
                OnlineConfig(env=EnvConfig(name="webshop", split="train", max_turns=15), seed=5, out="runs/x")
            )
        )
    )
    for files in ([GRPO_YAML], [str(old)]):
        r = resolve(
            RolloutConfig, config_file=files, overrides=[], flags={"out": str(tmp_path / "r")}, command="rollout"
        )
        assert (r.env.split, r.env.max_turns, r.out) == ("train", 15, str(tmp_path / "r"))
    assert r.seed == 5 and r.model is None
    r = resolve(RolloutConfig, config_file=[GRPO_YAML], overrides=["rollout.tasks=2"], flags={}, command="rollout")
    assert (r.tasks, r.group_size, r.sampling.temperature, r.sampling.max_new_tokens) == (2, 8, 1.0, 32)
    assert "ignoring" not in capsys.readouterr().err


def test_unknown_keys_in_a_run_file_still_fail_with_the_closest(tmp_path):
    from serl_cli.cli.common import resolve
    from serl_cli.stages.evaluate import EvalConfig

    with pytest.raises(SerlError, match=r"unknown setting eval\.temprature: did you mean eval\.temperature\?"):
        resolve(EvalConfig, config_file=[GRPO_YAML], overrides=["eval.temprature=0.4"], flags={}, command="eval")
    bad = tmp_path / "bad.yaml"
    bad.write_text("iterations: 2\nrollout: {sampling: {temprature: 1.0}}\n")
    with pytest.raises(SerlError, match=r"rollout\.sampling\.temprature: did you mean rollout\.sampling\.temperature"):
        resolve(EvalConfig, config_file=[str(bad)], overrides=[], flags={}, command="eval")
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("eval: {temperature: 0.4}\nmax_new_tokens: 8\n")
    assert_one_line_error(
        serl("eval", "--config", str(mixed)),
        "mixes the online loop's layout (eval)",
        "serl eval's own (max_new_tokens)",
    )
    assert_one_line_error(serl("eval", "--set", "temprature=0.4"), "did you mean temperature?")  # as before


def test_resolved_online_config_carries_each_setting_once():
    from serl_cli.cli.common import resolve
    from serl_cli.online.run_file import LOOP_SETS, run_settings

    cfg = resolve(
        OnlineConfig, config_file=[SERL_YAML], overrides=["seed=3", "out=runs/s", "train.optim.lr=1e-5"], flags={}
    )
    text = yaml.safe_dump(run_settings(cfg), sort_keys=False)
    saved = yaml.safe_load(text)
    assert "out" not in saved["rollout"] and "env" not in saved["rollout"] and "model" not in saved["rollout"]
    assert _count_keys(saved, "seed") == 1 and saved["seed"] == 3 and _count_keys(saved, "out") == 1
    assert not any(key in saved[section] for section, keys in LOOP_SETS.items() for key in keys)
    assert cfgmod.from_dict(OnlineConfig, saved) == cfg  # loading it gives the same run configuration
    assert cfg.train.optim.betas == (0.9, 0.999) and isinstance(saved["train"]["optim"]["betas"], list)


def test_online_yaml_of_a_run_is_its_config_for_resume_and_eval(tiny_model_dir, tmp_path):
    """The online.yaml a run writes: each setting once; with it as --config, --resume goes on and
    serl eval evaluates the run's checkpoint as its periodic evaluation would."""
    run = tmp_path / "run"
    p = serl(
        "train",
        "--config",
        GRPO_YAML,
        "--iterations",
        "1",
        "--model",
        str(tiny_model_dir),
        "--tasks",
        "1",
        "--group-size",
        "2",
        "--max-turns",
        "2",
        "--seed",
        "3",
        "--threads",
        "1",
        "--out",
        str(run),
        "-q",
        "--set",
        "env.settings.catalog=synthetic",
        "--set",
        "rollout.sampling.max_new_tokens=4",
    )
    assert p.returncode == 0, p.stderr
    saved = yaml.safe_load((run / "online.yaml").read_text())
    assert _count_keys(saved, "seed") == 1 and saved["seed"] == 3 and "out" not in saved["rollout"]
    assert "env" not in saved["rollout"] and saved["env"]["max_turns"] == 2
    p = serl("train", "--config", str(run / "online.yaml"), "--iterations", "2", "--resume", "-q")
    assert p.returncode == 0, p.stderr
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert yaml.safe_load((run / "online.yaml").read_text())["iterations"] == 2
    ev = tmp_path / "ev"
    p = serl(
        "eval",
        "--config",
        str(run / "online.yaml"),
        "--model",
        str(run / "checkpoint"),
        "--episodes",
        "1",
        "--out",
        str(ev),
        "--threads",
        "1",
    )
    assert p.returncode == 0, p.stderr
    assert "note:" not in p.stderr  # the run's own online.yaml: its other sections are expected
    saved = yaml.safe_load((ev / "eval_config.yaml").read_text())
    assert (saved["max_new_tokens"], saved["env"]["max_turns"], saved["seed"]) == (4, 2, 3)
