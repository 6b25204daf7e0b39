"""Settings typed and documented in one place: Literal words checked at load, each field's doc in
``--help``, ``serl config show --defaults`` and docs/CONFIG.md, and a config error that costs no
torch start-up."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from support import assert_one_line_error, serl

from serl_cli import config as cfgmod
from serl_cli.cli.config import COMMANDS, config_class, reference, settings_classes
from serl_cli.errors import SerlError
from serl_cli.online.config import OnlineConfig
from serl_cli.training.train_config import TrainConfig, check_train_config

ROOT = Path(__file__).resolve().parent.parent


def test_a_literal_setting_takes_one_of_its_words_at_load():
    with pytest.raises(SerlError, match=r"^unknown train\.group_norm 'turn': choose one of episode, cross_steps$"):
        cfgmod.resolve(OnlineConfig, config_file=None, flags={}, overrides=["train.group_norm=turn"])
    with pytest.raises(SerlError, match=r"unknown rollout\.vllm\.weight_sync 'ram': choose one of memory, disk"):
        cfgmod.resolve(OnlineConfig, config_file=None, flags={}, overrides=["rollout.vllm.weight_sync=ram"])
    cfg = cfgmod.resolve(OnlineConfig, config_file=None, flags={}, overrides=["train.gigpo_mode=mean_norm"])
    assert cfg.train.gigpo_mode == "mean_norm"
    # a config built in code gets the same check
    with pytest.raises(SerlError, match=r"unknown train\.lora\.save 'both'"):
        check_train_config(
            dataclasses.replace(TrainConfig(), lora=dataclasses.replace(TrainConfig().lora, save="both"))
        )


def test_the_literal_words_are_the_registries_names():
    from serl_cli.models.choices import DTYPE_NAMES
    from serl_cli.models.device import DTYPES
    from serl_cli.stages.evaluate import PANELS, Panel
    from serl_cli.training.backends import BACKENDS
    from serl_cli.training.train_config import BACKENDS as BACKEND_NAMES

    assert set(BACKEND_NAMES) == set(BACKENDS) and set(DTYPE_NAMES) == set(DTYPES)
    assert set(typing.get_args(Panel)) == set(PANELS)


def test_every_setting_is_documented():
    undocumented = [
        f"{cls.__name__}.{f.name}"
        for cls in settings_classes()
        for f in dataclasses.fields(cls)
        if not f.metadata.get("doc")
    ]
    assert not undocumented


def test_config_reference_is_current():
    """docs/CONFIG.md is generated from the fields' docs: regenerate it with
    `serl config reference > docs/CONFIG.md` after changing a setting."""
    assert (ROOT / "docs" / "CONFIG.md").read_text(encoding="utf-8") == reference()


def _github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_config_reference_links_land_on_headings():
    """Each in-page link of docs/CONFIG.md (a section's type: [`TrainConfig`](#trainconfig))
    names a heading's anchor: the headings once carried the command after the class name, so
    no link found its table."""
    page = reference()
    anchors = {_github_anchor(h) for h in re.findall(r"^#+ (.+)$", page, flags=re.M)}
    links = set(re.findall(r"\]\(#([^)]+)\)", page))
    assert links and links <= anchors, sorted(links - anchors)


@pytest.mark.parametrize("command", COMMANDS)
def test_show_defaults_comments_every_key_and_stays_the_defaults(command):
    p = serl("config", "show", command, "--defaults")
    assert p.returncode == 0, p.stderr
    cls = config_class(command)
    shown = yaml.safe_load(p.stdout)
    if command == "train":
        from serl_cli.online.run_file import run_settings

        assert shown == yaml.safe_load(yaml.safe_dump(run_settings(cls())))
    else:
        assert shown == yaml.safe_load(yaml.safe_dump(dataclasses.asdict(cls())))
    lines = p.stdout.splitlines()
    keys = [i for i, ln in enumerate(lines) if not ln.lstrip().startswith("#")]
    assert all(lines[i - 1].lstrip().startswith("# ") for i in keys)  # each key under its doc


def test_help_prints_the_fields_docs():
    p = serl("train", "--help", env={"COLUMNS": "250"})
    line = next(ln for ln in p.stdout.splitlines() if "--zero-stage" in ln)
    assert cfgmod.doc_of(OnlineConfig, "train.deepspeed.zero_stage")[:60] in line
    p = serl("annotate", "--help", env={"COLUMNS": "250"})
    assert "--algo" in p.stdout and "placement all" in p.stdout


# a command run to its error, then whether torch was imported on the way
NO_TORCH = """
import sys
from serl_cli.cli import main
sys.argv = ["serl", *sys.argv[1:]]
try:
    main()
finally:
    print("torch imported" if "torch" in sys.modules else "no torch", file=sys.stderr)
"""


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train", "--set", "train.algo=nope"], "unknown algorithm 'nope'"),
        (["train", "--set", "train.optim.lr=oops"], "train.optim.lr must be a number"),
        (["train", "--set", "train.group_norm=turn"], "unknown train.group_norm 'turn'"),
        (["train", "no_such_run", "--algo", "nope"], "unknown algorithm 'nope'"),
        (["annotate", "no_such_run", "--algo", "nope"], "unknown algorithm 'nope'"),
        (["annotate", "no_such_run", "--set", "tokens=all"], "unknown tokens 'all'"),
        (["annotate", "no_such_run", "--algo", "grpo"], "--algo grpo learns from no annotations"),
        (["eval", "--set", "dtype=fp8"], "unknown dtype 'fp8'"),
        (["rollout", "--set", "engine=sglang"], "unknown engine 'sglang'"),
        (["ablate", "--algo", "nope", "--out", "no_such_dir"], "unknown algorithm 'nope'"),
        (["demo", "--set", "online.train.group_norm=turn"], "unknown online.train.group_norm 'turn'"),
        (["config", "show", "train", "--set", "train.gigpo_mode=std"], "unknown train.gigpo_mode 'std'"),
    ],
)
def test_a_config_error_exits_2_without_importing_torch(args, needle, tmp_path):
    p = subprocess.run(
        [sys.executable, "-c", NO_TORCH, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines()[-1] == "no torch", p.stderr
    assert_one_line_error(
        subprocess.CompletedProcess(p.args, 2, p.stdout, "\n".join(p.stderr.splitlines()[:-1])), needle
    )
