"""The rollout records (serl_cli.artifacts.records): one definition for rollouts.jsonl and the code.

A record read and written back is the same JSON, keys in the same order, unknown keys kept;
every malformed record is refused in one line naming its file and line, as read_rollouts
always refused it; the required keys are the dataclasses' fields without a default.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, fields

import pytest

from serl_cli.artifacts import io
from serl_cli.artifacts.records import (
    ANNOTATION_KEYS,
    ANNOTATION_TYPES,
    EPISODE_TYPES,
    ROLLOUT_KEYS,
    TURN_KEYS,
    TURN_TYPES,
    Annotation,
    Episode,
    Turn,
    make_annotation,
    make_episode,
    make_turn,
)
from serl_cli.artifacts.schema import read_rollouts, write_rollouts
from serl_cli.errors import SerlError


def turn_record(**over) -> dict:
    """A turn as the rollout runner writes it, keys in its order (a model's turn: log-probs, no off_expert)."""
    return {
        "turn": 0,
        "observation": "# # #\n# P #",
        "state_key": "ee2896929929f460",
        "expert_action": "down",
        "prompt_ids": [1, 302, 269],
        "action_ids": [378, 2],
        "action_text": "down",
        "action": "down",
        "behaviour_logprobs": [-0.25, -1.5],
        "next_observation": "# # #\n# _ #",
        "next_state_key": "4b7647f716493148",
        "feedback": {"error": None, "diff": "pushed a box down"},
        "reward": 0.0,
        "done": False,
        "info": {"turn": 1, "won": False, "deadlock": None},
    } | over


def episode_record(turns=None, **over) -> dict:
    """An episode as the rollout runner writes it, keys in its order."""
    turns = [turn_record(), turn_record(turn=1, reward=1.0, done=True)] if turns is None else turns
    return {
        "task_id": 50494,
        "group_id": 0,
        "rollout_index": 3,
        "instruction": "Push every box onto a goal.",
        "initial_observation": "# # #\n# P #",
        "turns": turns,
        "reward": 1.0,
        "success": True,
        "num_turns": len(turns),
        "invalid_actions": 0,
        "truncated": False,
        "error": None,
    } | over


def dumped(record: dict) -> str:
    return json.dumps(record, separators=(",", ":"))  # as io.write_jsonl writes a line


# -- the round trip ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "record",
    [
        episode_record(),
        # a noisy expert's turn (off_expert, no log-probs) and an authors'-style judged reply (invalid)
        episode_record([turn_record(behaviour_logprobs=[], off_expert=True), turn_record(turn=1, invalid=True)]),
        # an episode the environment ended at reset: no turns, an error, an integer reward
        episode_record([], reward=0, success=False, truncated=True, error="environment timed out"),
    ],
)
def test_a_record_round_trips_to_the_same_json(record):
    ep = Episode.from_dict(record, "rollouts.jsonl:1")
    assert ep.to_dict() == record
    assert dumped(ep.to_dict()) == dumped(record)  # the same keys in the same order: the same bytes
    assert list(ep.to_dict()) == list(record)
    assert [list(t) for t in ep.to_dict()["turns"]] == [list(t) for t in record["turns"]]


def test_unknown_keys_are_kept_and_written_back_after_the_known_ones():
    record = episode_record([turn_record(later_field={"a": 1}), turn_record(turn=1)], seed_note="x", extra=[1, 2])
    ep = Episode.from_dict(record, "rollouts.jsonl:1")
    assert ep.extra == {"seed_note": "x", "extra": [1, 2]}  # a key named "extra" is data like any other
    assert ep.turns[0].extra == {"later_field": {"a": 1}} and ep.turns[1].extra == {}
    assert ep.to_dict() == record and dumped(ep.to_dict()) == dumped(record)


def test_the_fields_read_as_attributes():
    ep = Episode.from_dict(episode_record(), "rollouts.jsonl:1")
    assert (ep.task_id, ep.group_key, ep.success, ep.num_turns, ep.error) == (50494, (50494, 0), True, 2, None)
    t = ep.turns[0]
    assert isinstance(t, Turn) and t.action_ids == [378, 2] and t.expert_action == "down" and not t.off_expert
    assert t.feedback["diff"] == "pushed a box down" and t.info["won"] is False and t.invalid is None


def test_optional_fields_take_their_defaults_and_counts_come_from_the_turns():
    bare_turn = {k: turn_record()[k] for k in TURN_KEYS} | {"feedback": {"error": "no such button", "diff": ""}}
    bare = {k: episode_record([bare_turn])[k] for k in ROLLOUT_KEYS}
    ep = Episode.from_dict(bare, "rollouts.jsonl:1")
    t = ep.turns[0]
    assert (t.turn, t.observation, t.action, t.next_state_key, t.info, t.off_expert) == (0, "", "", None, {}, False)
    assert (ep.instruction, ep.truncated, ep.error, ep.num_turns, ep.invalid_actions) == ("", False, None, 1, 1)
    # written back it holds every key the runner writes, at the defaults
    assert list(ep.to_dict()) == list(episode_record())


def test_null_counts_are_counted_from_the_turns_and_stated_ones_kept():
    turns = [turn_record(), turn_record(turn=1, invalid=True)]
    counted = Episode.from_dict(episode_record(turns, num_turns=None, invalid_actions=None))
    assert (counted.num_turns, counted.invalid_actions) == (2, 1)
    stated = Episode.from_dict(episode_record(turns, num_turns=5, invalid_actions=0))  # as the file says
    assert (stated.num_turns, stated.invalid_actions) == (5, 0)
    assert (make_episode(turns=[]).num_turns, make_episode(turns=[]).invalid_actions) == (0, 0)


def test_written_only_when_set():
    t = make_turn()
    assert not {"off_expert", "invalid", "engine_logprobs", "hindsight"} & set(t.to_dict())
    t.off_expert, t.invalid = True, False
    assert t.to_dict()["off_expert"] is True and t.to_dict()["invalid"] is False


def test_invalid_action_follows_the_authors_rule_where_recorded():
    assert make_turn(feedback={"error": "bad", "diff": ""}).invalid_action
    assert not make_turn().invalid_action
    assert not make_turn(feedback={"error": "refused", "diff": ""}, invalid=False).invalid_action
    assert make_turn(invalid=True).invalid_action
    ep = make_episode([make_turn(invalid=True), make_turn(), make_turn(feedback={"error": "x", "diff": ""})])
    assert ep.invalid_actions == 2 and ep.num_turns == 3


def test_read_rollouts_returns_records_and_write_rollouts_writes_the_same_bytes(tmp_path):
    records = [
        episode_record(),
        episode_record([turn_record(behaviour_logprobs=[], off_expert=True)], rollout_index=4, unknown_key=7),
    ]
    run = tmp_path / "run"
    io.write_json(run / "manifest.json", io.new_manifest("rollout", {}, 0))
    io.write_jsonl(run / "rollouts.jsonl", records)
    before = (run / "rollouts.jsonl").read_bytes()
    episodes = read_rollouts(run)
    assert [type(e) for e in episodes] == [Episode, Episode] and episodes[1].extra == {"unknown_key": 7}
    write_rollouts(run, episodes)
    assert (run / "rollouts.jsonl").read_bytes() == before


# -- one definition ------------------------------------------------------------------------------
def test_the_key_tuples_are_the_dataclasses_required_fields():
    def required(cls):
        return {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}

    assert (
        set(ROLLOUT_KEYS) == required(Episode) == {"task_id", "group_id", "rollout_index", "reward", "success", "turns"}
    )
    assert set(TURN_KEYS) == required(Turn)
    assert set(TURN_KEYS) == {
        "prompt_ids",
        "action_ids",
        "action_text",
        "behaviour_logprobs",
        "feedback",
        "reward",
        "done",
        "state_key",
    }
    # the type checks are on fields of the record, and cover its required scalars and token lists
    assert set(EPISODE_TYPES) <= {f.name for f in fields(Episode)} and set(EPISODE_TYPES) == set(ROLLOUT_KEYS) - {
        "turns"
    }
    assert set(TURN_TYPES) <= {f.name for f in fields(Turn)} and set(TURN_TYPES) == set(TURN_KEYS) - {"feedback"}


def test_field_order_is_the_runners_key_order():
    # to_dict writes in field order: the dataclasses list the fields as the runner has always written them
    assert [f.name for f in fields(Episode) if f.name != "extra"] == list(episode_record())
    turn_fields = [f.name for f in fields(Turn) if f.name != "extra"]
    assert turn_fields[: len(turn_record())] == list(turn_record())
    assert turn_fields[len(turn_record()) :] == [
        "off_expert",
        "invalid",
        "engine_logprobs",
        "hindsight",
        "policy_version",
    ]


# -- refused in one line, as read_rollouts always refused ------------------------------------------
WHERE = "run/rollouts.jsonl:3"


def refused(record: dict, need_tokens: bool = True) -> str:
    with pytest.raises(SerlError) as e:
        Episode.from_dict(record, WHERE, need_tokens=need_tokens)
    message = str(e.value)
    assert "\n" not in message and message.startswith(WHERE + ":")
    return message


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.pop("reward"), f"{WHERE}: record lacks reward"),
        (lambda r: (r.pop("success"), r.pop("task_id")), f"{WHERE}: record lacks task_id, success"),
        (lambda r: r.update(turns={"0": {}}), f"{WHERE}: 'turns' must be a list"),
        (lambda r: r.update(task_id="50494"), f'{WHERE}: task_id must be an integer, got "50494"'),
        (lambda r: r.update(group_id=0.0), f"{WHERE}: group_id must be an integer, got 0.0"),
        (lambda r: r.update(rollout_index=True), f"{WHERE}: rollout_index must be an integer, got true"),
        (lambda r: r.update(reward="high"), f'{WHERE}: reward must be a finite number, got "high"'),
        (lambda r: r.update(success=1), f"{WHERE}: success must be true or false, got 1"),
        (lambda r: r.update(turns=[5]), f"{WHERE}: a turn must be a JSON object, got int"),
        (lambda r: r["turns"][0].pop("feedback"), f"{WHERE}: a turn lacks feedback (rollouts without feedback"),
        (
            lambda r: (r["turns"][0].pop("prompt_ids"), r["turns"][0].pop("done")),
            f"{WHERE}: a turn lacks prompt_ids, done (rollouts",
        ),
        (
            lambda r: r["turns"][0].update(action_ids="12 13"),
            f'{WHERE}: a turn\'s action_ids must be a list of token ids (integers from 0), got "12 13"',
        ),
        (
            lambda r: r["turns"][1].update(prompt_ids=[1, 2.0]),
            f"{WHERE}: a turn's prompt_ids must be a list of token ids (integers from 0), got [1, 2.0]",
        ),
        (
            lambda r: r["turns"][0].update(behaviour_logprobs=[-1, "x"]),
            f'{WHERE}: a turn\'s behaviour_logprobs must be a list of numbers, got [-1, "x"]',
        ),
        (lambda r: r["turns"][0].update(action_text=None), f"{WHERE}: a turn's action_text must be a string, got null"),
        (lambda r: r["turns"][0].update(reward=None), f"{WHERE}: a turn's reward must be a finite number, got null"),
        (lambda r: r["turns"][0].update(done="no"), f'{WHERE}: a turn\'s done must be true or false, got "no"'),
        (lambda r: r["turns"][0].update(state_key=7), f"{WHERE}: a turn's state_key must be a string, got 7"),
        (
            lambda r: r["turns"][0].update(action_ids=[]),
            f"{WHERE}: a turn has no token ids: these rollouts were not recorded with a model tokenizer",
        ),
        (
            lambda r: r["turns"][0].update(behaviour_logprobs=[-1.0]),
            f"{WHERE}: behaviour_logprobs and action_ids differ in length",
        ),
        (
            lambda r: r["turns"][0].update(feedback={"diff": ""}),
            f"{WHERE}: a turn's feedback lacks the environment's fields (error, diff)",
        ),
        (
            lambda r: r["turns"][0].update(feedback="fine"),
            f"{WHERE}: a turn's feedback lacks the environment's fields (error, diff)",
        ),
    ],
)
def test_each_malformed_record_is_refused_in_one_line(edit, message):
    record = episode_record()
    edit(record)
    assert refused(record).startswith(message)


def test_without_need_tokens_a_turn_may_lack_token_ids():
    record = episode_record([turn_record(prompt_ids=[], action_ids=[], behaviour_logprobs=[-1.0])])
    assert Episode.from_dict(record, WHERE, need_tokens=False).turns[0].action_ids == []
    assert "has no token ids" in refused(record)
    # the type checks hold either way
    record["turns"][0]["action_ids"] = "12"
    assert "action_ids must be a list of token ids" in refused(record, need_tokens=False)


def test_read_rollouts_names_the_file_and_line(tmp_path):
    run = tmp_path / "run"
    io.write_json(run / "manifest.json", io.new_manifest("rollout", {}, 0))
    io.write_jsonl(run / "rollouts.jsonl", [episode_record(), episode_record(reward="high")])
    with pytest.raises(SerlError, match=r"rollouts\.jsonl:2: reward must be a finite number"):
        read_rollouts(run)
    io.write_jsonl(run / "rollouts.jsonl", [episode_record(), {k: 1 for k in ("task_id", "group_id")}])
    with pytest.raises(SerlError, match=r"rollouts\.jsonl:2: record lacks rollout_index, turns, reward, success"):
        read_rollouts(run)


# -- annotation records (serl annotate) ------------------------------------------------------------
def annotation_record(**over) -> dict:
    """An annotation as serl annotate writes it, keys in its order (a selected, scored turn)."""
    return {
        "episode": 3,
        "task_id": 50494,
        "group_id": 0,
        "rollout_index": 3,
        "turn": 1,
        "selected": True,
        "sources": ["error"],
        "fired": ["error"],
        "hindsight": "[error] no such button",
        "action_mask": [0, 1, 1],
        "teacher_logprobs": [-0.5, -0.25, -2.0],
        "weights": [1.0, 1.15, 0.85],
        "advantage": -0.7071067690849304,
        "log_ratio_mean": 0.1234,
        "distill": True,
    } | over


@pytest.mark.parametrize(
    "record",
    [
        annotation_record(),
        annotation_record(selected=False, hindsight=None, teacher_logprobs=None, weights=None, log_ratio_mean=None),
        annotation_record(later_field={"a": 1}),
    ],
)
def test_an_annotation_round_trips_to_the_same_json(record):
    a = Annotation.from_dict(record, "annotations.jsonl:1")
    assert dumped(a.to_dict()) == dumped(record)
    assert list(a.to_dict()) == list(record) and a.extra == {k: record[k] for k in record if k not in ANNOTATION_KEYS}


def test_the_annotation_keys_are_its_fields_in_the_order_annotate_writes_them():
    assert (
        list(ANNOTATION_KEYS) == [f.name for f in fields(Annotation) if f.name != "extra"] == list(annotation_record())
    )
    assert set(ANNOTATION_TYPES) == set(ANNOTATION_KEYS)
    assert make_annotation(turn=2).to_dict() | {"turn": 1} == make_annotation(turn=1).to_dict()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.pop("weights"), f"{WHERE}: record lacks weights"),
        (lambda r: r.update(episode="3"), f'{WHERE}: episode must be an integer, got "3"'),
        (lambda r: r.update(selected=1), f"{WHERE}: selected must be true or false, got 1"),
        (lambda r: r.update(sources="error"), f'{WHERE}: sources must be a list of source names, got "error"'),
        (lambda r: r.update(hindsight=5), f"{WHERE}: hindsight must be a string or null, got 5"),
        (lambda r: r.update(action_mask=None), f"{WHERE}: action_mask must be a list of 0s and 1s, got null"),
        (
            lambda r: r.update(weights=[1.0, "x", 1.0]),
            f'{WHERE}: weights must be a list of numbers or null, got [1.0, "x"',
        ),
        (lambda r: r.update(advantage=None), f"{WHERE}: advantage must be a number, got null"),
        (lambda r: r.update(teacher_logprobs=[-1.0]), f"{WHERE}: teacher_logprobs and action_mask differ in length"),
        (lambda r: r.update(weights=[1.0]), f"{WHERE}: weights and action_mask differ in length"),
    ],
)
def test_each_malformed_annotation_is_refused_in_one_line(edit, message):
    record = annotation_record()
    edit(record)
    with pytest.raises(SerlError) as e:
        Annotation.from_dict(record, WHERE)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
