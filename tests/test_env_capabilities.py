"""A world's optional capabilities: each a small protocol in ``envs.base``, asked with
``isinstance`` rather than ``hasattr``, and checked once when ``make_world`` builds the world."""

from __future__ import annotations

import re

import pytest

import envs
from envs import EnvError, make_world
from envs.base import ActionFormat, capabilities, capability_problems


class Minimal:
    name, rules, eval_split = "minimal", "", "test"

    def splits(self):
        return ["test"]

    def num_tasks(self, split):
        return 1

    def new_episode(self, split, max_turns=None):
        raise NotImplementedError  # never stepped here


class Typed(Minimal):
    action_format = ActionFormat(example="go north", bare=re.compile(r"go \w+"))
    model_preset = "micro"

    def task_type(self, split, task_id):
        return "kind"

    def info(self):
        return {"data": "here"}


def test_the_built_in_worlds_offer_what_their_code_has():
    sokoban = make_world("sokoban")
    assert capabilities(sokoban) == ["action_format", "authors_prompt", "corpus_texts", "model_preset"]
    assert capabilities(Minimal()) == []
    assert capabilities(Typed()) == ["action_format", "info", "task_type", "model_preset"]


@pytest.mark.parametrize(
    "member, value, says",
    [
        ("task_type", "pick", "task_type is not callable"),
        ("info", {"a": 1}, "info is not callable"),
        ("action_format", "go <dir>", "action_format is a str, not an envs.base.ActionFormat"),
        ("model_preset", 3, "model_preset is a int, not a preset name"),
    ],
)
def test_a_capability_of_the_wrong_kind_is_refused_in_one_line_when_the_world_is_built(
    monkeypatch, member, value, says
):
    world = Minimal()
    setattr(world, member, value)
    assert capability_problems(world) == [says]
    monkeypatch.setitem(envs._REGISTRY, "odd", lambda **settings: world)
    with pytest.raises(EnvError, match=rf"^environment 'odd': Minimal's {says} \(docs/ENVIRONMENTS.md\)$"):
        make_world("odd")


def test_the_readers_ask_for_the_capability():
    from serl_cli.rollout.prompts import DEFAULT_ACTION_FORMAT, action_format_of
    from serl_cli.rollout.worlds import world_info

    assert action_format_of(Minimal()) is DEFAULT_ACTION_FORMAT and action_format_of(Typed()) is Typed.action_format
    assert world_info(Minimal()) == {"name": "minimal"} and world_info(Typed()) == {"name": "minimal", "data": "here"}
