"""ALFWorld on the real engine: the panel, feedback on hand-picked steps, command parsing,
separate state per episode, the cached plans and the off-plan reference, `serl data
prepare`, eval by task type, and the missing-data / missing-extra messages.

Pure functions (parsing, the diff) are tested on hand-written facts; everything else runs
the real engine on a few games of ``$SERL_DATA_DIR/alfworld`` and is skipped, with the
reason, where the extra is not installed or the data is absent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import assert_one_line_error, requires_alfworld, serl

from envs.alfworld import feedback as fb
from envs.alfworld.expert import to_211, to_212
from envs.base import EnvError
from serl_cli.artifacts import io

UNSEEN_FIRST = "json_2.1.1/valid_unseen/look_at_obj_in_light-AlarmClock-None-DeskLamp-308/trial_T20190908_222917_366542"
UNSEEN_HEAT = 95  # pick_heat_then_place_in_recep-Apple-None-Fridge-10/trial_T20190906_182353_418140
UNSEEN_HEAT_PLAN = [
    "go to garbagecan 1",
    "take apple 3 from garbagecan 1",
    "go to microwave 1",
    "heat apple 3 with microwave 1",
    "go to fridge 1",
    "open fridge 1",
    "put apple 3 in/on fridge 1",
]


@pytest.fixture(scope="module")
def world():
    requires_alfworld()
    from envs import make_world

    return make_world("alfworld")


# -- pure functions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command, verb, args",
    [
        ("go to desk 1", "go to", {"r": "desk 1"}),
        ("  Go  To   Desk 1 ", "go to", {"r": "desk 1"}),
        ("take alarmclock 1 from desk 2", "take", {"o": "alarmclock 1", "r": "desk 2"}),
        ("put apple 3 in/on fridge 1", "put", {"o": "apple 3", "r": "fridge 1"}),
        ("heat apple 3 with microwave 1", "heat", {"o": "apple 3", "r": "microwave 1"}),
        ("look", "look", {}),
    ],
)
def test_parse_well_formed_commands(command, verb, args):
    assert fb.parse_command(command) == (verb, args, None)


@pytest.mark.parametrize(
    "command, needle",
    [
        ("", "empty command"),
        ("   ", "empty command"),
        ("fly to the moon", "unparseable command 'fly to the moon': expected one of go to X"),
        ("put apple 3 in fridge 1", "ALFWorld writes it 'put X in/on Y'"),
        ("take apple 3", "unparseable command 'take apple 3'"),
        ("look around", "unparseable command 'look around'"),
        ("fly" + " x" * 60, "...'"),  # a long command is cut in the message
    ],
)
def test_parse_malformed_commands(command, needle):
    verb, args, error = fb.parse_command(command)
    assert verb is None and args == {}
    assert needle in error


# Hand-written states: the agent at the start (loc 0), desk 1 at loc 1, fridge 1 (closed) at loc 2.
BASE = frozenset(
    {
        ("atlocation", "agent1", "loc 0"),
        ("receptacleatlocation", "desk 1", "loc 1"),
        ("receptacleatlocation", "fridge 1", "loc 2"),
        ("receptacletype", "desk 1", "desktype"),
        ("receptacletype", "fridge 1", "fridgetype"),
        ("openable", "fridge 1"),
        ("objecttype", "apple 1", "appletype"),
        ("inreceptacle", "apple 1", "desk 1"),
        ("objectatlocation", "apple 1", "loc 1"),
    }
)


def moved(facts, **changes):
    out = set(facts)
    for old, new in changes.values():
        if old:
            out.discard(old)
        if new:
            out.add(new)
    return frozenset(out)


def test_describe_change_hand_worked():
    at_desk = moved(BASE, a=(("atlocation", "agent1", "loc 0"), ("atlocation", "agent1", "loc 1")))
    assert fb.describe_change(BASE, BASE) == "no change"
    assert fb.describe_change(BASE, at_desk) == "location: the middle of the room -> desk 1"
    holding = moved(at_desk, a=(("inreceptacle", "apple 1", "desk 1"), ("holds", "agent1", "apple 1")))
    assert fb.describe_change(at_desk, holding) == "picked up apple 1; apple 1 left desk 1"
    hot = holding | {("ishot", "apple 1")}
    assert fb.describe_change(holding, hot) == "apple 1 is now hot"
    at_fridge = moved(hot, a=(("atlocation", "agent1", "loc 1"), ("atlocation", "agent1", "loc 2")))
    opened = at_fridge | {("opened", "fridge 1")}
    assert fb.describe_change(at_fridge, opened) == "fridge 1 opened"
    put = moved(opened, a=(("holds", "agent1", "apple 1"), ("inreceptacle", "apple 1", "fridge 1")))
    assert fb.describe_change(opened, put) == "no longer holding apple 1; apple 1 now in/on fridge 1"
    assert fb.describe_change(opened, at_fridge) == "fridge 1 closed"


def test_why_inadmissible_hand_worked():
    at_desk = moved(BASE, a=(("atlocation", "agent1", "loc 0"), ("atlocation", "agent1", "loc 1")))
    assert fb.why_inadmissible("take", {"o": "apple 1", "r": "desk 1"}, BASE) == "you are not at desk 1"
    assert fb.why_inadmissible("take", {"o": "apple 1", "r": "fridge 1"}, at_desk) == "apple 1 is not in/on fridge 1"
    assert fb.why_inadmissible("open", {"r": "fridge 1"}, at_desk) == "you are not at fridge 1"
    assert fb.why_inadmissible("open", {"r": "desk 1"}, at_desk) == "desk 1 cannot be opened or closed"
    assert fb.why_inadmissible("go to", {"r": "desk 1"}, at_desk) == "you are already at desk 1"
    assert fb.why_inadmissible("put", {"o": "apple 1", "r": "fridge 1"}, at_desk) == "you are not holding apple 1"
    assert fb.why_inadmissible("go to", {"r": "sofa 9"}, BASE) == "there is no 'sofa 9' here"


def test_state_key_ignores_order_and_sees_every_fact():
    assert fb.state_key(BASE) == fb.state_key(frozenset(sorted(BASE)))
    assert fb.state_key(BASE) != fb.state_key(BASE | {("opened", "fridge 1")})


def test_put_is_rewritten_between_versions():
    assert to_212("put apple 3 in/on fridge 1") == "move apple 3 to fridge 1"
    assert to_211("move apple 3 to fridge 1") == "put apple 3 in/on fridge 1"
    assert to_211("go to fridge 1") == "go to fridge 1" == to_212("go to fridge 1")


# -- the real engine ------------------------------------------------------------------------


def test_panel_order_is_the_sorted_playable_games(world):
    root = requires_alfworld()
    rows = [ln.split("\t") for ln in (root / "games.tsv").read_text().splitlines()[1:]]
    for split, count in (("train", 180), ("valid_seen", 140), ("valid_unseen", 134)):
        games = world.games(split)
        assert len(games) == world.num_tasks(split) == count
        assert [g.rel for g in games] == sorted(f"{r[2]}/game.tw-pddl" for r in rows if r[0] == split)
    assert world.game("valid_unseen", 0).rel == f"{UNSEEN_FIRST}/game.tw-pddl"
    assert world.game("valid_unseen", UNSEEN_HEAT).task_type == "pick_heat_then_place_in_recep"
    assert world.task_type("valid_unseen", 133) == "pick two"
    with pytest.raises(EnvError, match="out of range"):
        world.game("valid_unseen", 134)
    with pytest.raises(EnvError, match="unknown alfworld split"):
        world.new_episode("test")


def test_feedback_on_hand_picked_steps(world):
    ep = world.new_episode("valid_unseen")
    start = ep.reset(0)
    assert start.observation.startswith("-= Welcome to TextWorld, ALFRED! =-")
    assert ep.instruction == "examine the alarmclock with the desklamp."
    assert "go to desk 2" in start.admissible_actions and start.expert_action == "go to desk 2"

    failed_take = ep.step("take alarmclock 1 from desk 2")  # not there yet
    assert failed_take.observation == "Nothing happens."
    assert failed_take.feedback.error == "Nothing happens: you are not at desk 2"
    assert failed_take.feedback.diff == "no change" and failed_take.state_key == start.state_key
    assert failed_take.admissible_actions == start.admissible_actions and failed_take.info["invalid"]

    garbled = ep.step("pick up the clock")
    assert garbled.feedback.error.startswith("unparseable command 'pick up the clock'")

    went = ep.step("go to desk 2")
    assert went.observation == "You arrive at loc 24. On the desk 2, you see a alarmclock 1."
    assert went.feedback.error is None and went.feedback.diff == "location: the middle of the room -> desk 2"
    assert went.state_key != start.state_key and went.expert_action == "take alarmclock 1 from desk 2"

    took = ep.step("take alarmclock 1 from desk 2")
    assert took.feedback.diff == "picked up alarmclock 1; alarmclock 1 left desk 2"
    ep.close()

    heat = world.new_episode("valid_unseen")
    step = heat.reset(UNSEEN_HEAT)
    for command in UNSEEN_HEAT_PLAN[:5]:
        assert step.expert_action == command
        step = heat.step(command)
    assert "The fridge 1 is closed." in step.observation
    opened = heat.step("open fridge 1")
    assert opened.observation.startswith("You open the fridge 1. The fridge 1 is open. In it, you see")
    assert opened.feedback.diff == "fridge 1 opened" and opened.feedback.error is None
    won = heat.step(opened.expert_action)
    assert won.done and won.reward == 1.0 and won.info["won"] and not won.info["truncated"]
    assert won.feedback.diff == "no longer holding apple 3; apple 3 now in/on fridge 1"
    assert won.expert_action is None and won.admissible_actions == []


def test_two_episodes_of_one_game_do_not_share_state(world):
    a, b = world.new_episode("valid_unseen"), world.new_episode("valid_unseen")
    sa, sb = a.reset(0), b.reset(0)
    assert sa.state_key == sb.state_key
    a.step("go to desk 2")
    took = a.step("take alarmclock 1 from desk 2")
    assert took.feedback.error is None
    not_b = b.step("take alarmclock 1 from desk 2")  # b never went to desk 2
    assert not_b.feedback.error == "Nothing happens: you are not at desk 2"
    b_went = b.step("go to desk 2")
    assert "you see a alarmclock 1" in b_went.observation  # a's take did not empty b's desk
    a_lamp = a.step("go to desk 1")
    assert a_lamp.expert_action == "use desklamp 1" and b_went.expert_action == "take alarmclock 1 from desk 2"
    assert a.step("use desklamp 1").done
    # a gave its engine back; a new episode of the game starts from the game's start on it
    c = world.new_episode("valid_unseen")
    assert c.reset(0).state_key == sa.state_key
    assert c.step("take alarmclock 1 from desk 2").feedback.error == "Nothing happens: you are not at desk 2"
    b.close(), c.close()


def test_turn_limit_truncates(world):
    ep = world.new_episode("valid_unseen", max_turns=2)
    ep.reset(0)
    assert not ep.step("look").done
    last = ep.step("inventory")
    assert last.done and last.info["truncated"] and not last.info["won"] and last.reward == 0.0
    with pytest.raises(EnvError, match="episode is over"):
        ep.step("look")


def test_off_plan_reference_is_the_handcoded_expert(world):
    ep = world.new_episode("valid_unseen")
    ep.reset(0)
    strayed = ep.step("go to drawer 1")  # off the plan (the plan goes to desk 2)
    assert not strayed.info["on_plan"]
    assert strayed.expert_action in strayed.admissible_actions
    step, turns = strayed, 1
    while not step.done and step.expert_action is not None:
        step = ep.step(step.expert_action)
        turns += 1
    assert step.info["won"], f"the hand-coded reference did not win from a stray (turn {turns})"


def test_returning_to_a_plan_state_resumes_the_plan(world):
    ep = world.new_episode("valid_unseen")
    ep.reset(0)
    ep.step("go to desk 2")
    away = ep.step("go to desk 1")
    assert not away.info["on_plan"]
    back = ep.step("go to desk 2")  # the state the plan passed through after its first step
    assert back.info["on_plan"] and back.expert_action == "take alarmclock 1 from desk 2"
    ep.close()


def test_cli_eval_expert_reports_success_by_task_type(tmp_path, world):
    out = tmp_path / "eval"
    p = serl(
        "eval",
        "--env",
        "alfworld",
        "--policy",
        "expert",
        "--split",
        "valid_unseen",
        "--episodes",
        "2",
        "--out",
        str(out),
        "-q",
    )
    assert p.returncode == 0, p.stderr
    summary = json.loads((out / "eval.json").read_text())
    assert summary["episodes"] == 2 and summary["success_rate"] == 1.0
    plans = [world.plan(world.game("valid_unseen", i)) for i in (0, 1)]
    assert summary["by_task_type"]["look"]["episodes"] == 2 and summary["mean_turns"] == sum(map(len, plans)) / 2
    rows = [json.loads(ln) for ln in (out / "episodes.jsonl").read_text().splitlines()]
    assert rows[0]["task_type"] == "look" and rows[0]["actions"][0] == "go to desk 2"


def test_cli_env_play_script():
    requires_alfworld()
    p = serl(
        "env",
        "play",
        "--env",
        "alfworld",
        "--split",
        "valid_unseen",
        "--task",
        "0",
        "--json",
        "--actions",
        "go to desk 2;take alarmclock 1 from desk 2;go to desk 1;use desklamp 1",
    )
    assert p.returncode == 0, p.stderr
    assert '"done": true' in p.stdout and '"reward": 1.0' in p.stdout


# -- serl data prepare ------------------------------------------------------------------------


def test_data_prepare_plans_resumes_and_is_read(tmp_path, world):
    from envs.alfworld.plans import load_plans, prepare_plans, read_records

    out = tmp_path / "plans.jsonl"
    p = serl(
        "data",
        "prepare",
        "--env",
        "alfworld",
        "--split",
        "train",
        "--games",
        "2",
        "--out",
        str(out),
        env={"SERL_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert p.returncode == 0, p.stderr
    assert "2 / 2" in p.stdout  # games with a plan
    records = read_records(out)
    assert [r["game"] for r in records] == [g.rel for g in world.games("train")[:2]]
    assert all(r["plan"] and r["task_type"] == "look_at_obj_in_light" and len(r["sha256"]) == 64 for r in records)

    games = world.games("train")[:3]
    resumed = prepare_plans(games[:2], out, known=load_plans([out]), append=io.append_jsonl, timeout_s=60)
    assert (resumed.planned, resumed.skipped) == (0, 2) and len(read_records(out)) == 2
    # a game that runs past its timeout is recorded, and skipped by a rerun with the same timeout
    timed_out = prepare_plans(games, out, known=load_plans([out]), append=io.append_jsonl, timeout_s=0.01)
    assert (timed_out.failed, timed_out.skipped) == (1, 2)
    last = read_records(out)[-1]
    assert last["game"] == games[2].rel and "timeout" in last["error"] and "plan" not in last
    assert prepare_plans(games, out, known=load_plans([out]), append=io.append_jsonl, timeout_s=0.01).skipped == 3

    # the environment follows a prepared plan file
    from envs import make_world

    with_plans = make_world("alfworld", plans=[str(out)])
    ep = with_plans.new_episode("train")
    step = ep.reset(0)
    assert step.info["on_plan"] and step.expert_action == records[0]["plan"][0]
    for command in records[0]["plan"]:
        step = ep.step(command)
    assert step.info["won"]


def test_data_prepare_bad_input(tmp_path, world):
    from serl_cli.cli.data import PrepareConfig, prepare_alfworld
    from serl_cli.errors import SerlError
    from serl_cli.rollout.worlds import EnvConfig

    cfg = PrepareConfig(env=EnvConfig(name="alfworld", split="train"), games=999, out=str(tmp_path / "p.jsonl"))
    with pytest.raises(SerlError, match="--games 999 out of range: the alfworld train split has 180 games"):
        prepare_alfworld(cfg, world)
    cfg.games, cfg.workers = 1, 0
    with pytest.raises(SerlError, match="--workers must be at least 1"):
        prepare_alfworld(cfg, world)
    p = serl("data", "prepare", "--env", "webshop")
    assert_one_line_error(p, "needs no preparation")
    assert not (tmp_path / "p.jsonl").exists()


# -- missing data, missing extra ----------------------------------------------------------------


def test_missing_data_is_one_line(tmp_path):
    requires_alfworld()
    p = serl(
        "env",
        "play",
        "--env",
        "alfworld",
        "--split",
        "valid_unseen",
        "--actions",
        "look",
        env={"SERL_DATA_DIR": str(tmp_path), "ALFWORLD_DATA": ""},
    )
    assert_one_line_error(p, f"no ALFWorld data at {tmp_path}/alfworld", "alfworld-download")


def test_missing_extra_is_one_line(monkeypatch):
    from envs.alfworld import games

    # only textworld missing, whether or not this venv has the extra: the line names just that one
    monkeypatch.setattr(games.importlib.util, "find_spec", lambda name: None if name == "textworld" else object())
    with pytest.raises(EnvError, match=r"needs the textworld package\(s\): pip install 'serl\[alfworld\]'"):
        games.require_engine()


# -- training through the same pipeline -------------------------------------------------------


@pytest.mark.slow
def test_tiny_model_trains_on_alfworld(tmp_path, world):
    from serl_cli.models.tiny import init_model

    model = init_model("tiny", tmp_path / "model", world.corpus_texts(), seed=0)
    config = Path(__file__).parents[1] / "experiments" / "alfworld" / "grpo.yaml"
    run = tmp_path / "run"
    p = serl(
        "train",
        "--config",
        str(config),
        "--iterations",
        "2",
        "--model",
        str(model),
        "--tasks",
        "2",
        "--group-size",
        "2",
        "--max-turns",
        "3",
        "--out",
        str(run),
        "--set",
        "rollout.sampling.max_new_tokens=12",
        "--set",
        "rollout.threads=1",
    )
    assert p.returncode == 0, p.stderr
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [0, 1]
    records = [json.loads(ln) for ln in (run / "iter_0001" / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["num_turns"] <= 3 and r["truncated"] != r["success"] for r in records)
    turn = records[0]["turns"][0]
    assert turn["feedback"]["diff"] and turn["state_key"] and turn["expert_action"]
    assert (run / "checkpoint" / "config.json").is_file()
