"""Sokoban: generator, solver, step semantics and feedback (``envs.sokoban``)."""

from __future__ import annotations

import hashlib
import random
from collections import deque

import pytest

from envs import EnvError, make_world
from envs.sokoban.env import SokobanConfig, SokobanWorld
from envs.sokoban.rooms import generate_room, move, parse_room
from envs.sokoban.solver import Solver, dead_squares

PANEL = 500


@pytest.fixture(scope="module")
def world() -> SokobanWorld:
    return SokobanWorld()


@pytest.fixture(scope="module")
def panel(world) -> list[Solver]:
    return [world.level("test", i) for i in range(PANEL)]


def episode(text: str, max_turns: int = 15, **settings):
    """An episode on a hand-drawn room, and its first step."""
    ep = SokobanWorld(SokobanConfig(max_turns=max_turns, **settings)).new_episode("test")
    return ep, ep.play(parse_room(text))


def plain_bfs(room) -> int | None:
    """Shortest solution in moves by brute force: no dead squares, no table."""
    start, goals = (room.player, room.boxes), room.goals
    seen, queue = {start: 0}, deque([start])
    while queue:
        state = queue.popleft()
        if state[1] == goals:
            return seen[state]
        for step in room.steps.values():
            _, player, boxes = move(room, *state, step)
            if (player, boxes) not in seen:
                seen[(player, boxes)] = seen[state] + 1
                queue.append((player, boxes))
    return None


# -- generator ----------------------------------------------------------------------------------
def test_same_seed_same_room():
    rooms = [generate_room(random.Random(7), 6, 1, 20) for _ in range(2)]
    assert rooms[0] is not None and rooms[0] == rooms[1]


def test_panel_is_the_same_for_every_world_and_machine(world, panel):
    other = SokobanWorld()
    texts = [str(level.room) for level in panel]
    assert texts == [str(other.room("test", i)) for i in range(PANEL)]
    # pinned: a change to the generator (or to random.Random) changes the panel, and must be deliberate
    assert hashlib.sha1("\n\n".join(texts).encode()).hexdigest()[:16] == PANEL_SHA1


def test_panel_rooms_need_min_solution_moves(panel):
    assert min(level.distance(level.start) for level in panel) >= SokobanConfig().min_solution


def test_train_and_test_come_from_different_seeds(world):
    assert [str(world.room("train", i)) for i in range(20)] != [str(world.room("test", i)) for i in range(20)]
    assert world.num_tasks("train") == 100_000 and world.num_tasks("test") == PANEL


# -- disjoint_rooms: a train split with no room of the test panel -----------------------------------
DISJOINT_TRAIN = 300  # train tasks checked: about 70 of them hold a panel room by default


@pytest.fixture(scope="module")
def disjoint() -> SokobanWorld:
    return SokobanWorld(SokobanConfig(disjoint_rooms=True))


def test_default_train_rooms_are_pinned(world):
    # the first train rooms as they were before disjoint_rooms existed (off by default: nothing changes)
    texts = "\n\n".join(str(world.room("train", i)) for i in range(DISJOINT_TRAIN))
    assert hashlib.sha1(texts.encode()).hexdigest()[:16] == TRAIN_SHA1


def test_disjoint_rooms_keeps_every_panel_room_out_of_train(world, panel, disjoint):
    panel_rooms = {level.room for level in panel}
    assert disjoint.test_rooms == panel_rooms
    default = [world.room("train", i) for i in range(DISJOINT_TRAIN)]
    apart = [disjoint.room("train", i) for i in range(DISJOINT_TRAIN)]
    assert not panel_rooms & set(apart)
    assert any(room in panel_rooms for room in default)  # by default some are: the seeds differ, the rooms not
    # only the tasks whose room was a panel room change; every other train task keeps its room
    assert [a == d for a, d in zip(apart, default, strict=True)] == [d not in panel_rooms for d in default]
    redrawn = [disjoint.level("train", i) for i in range(DISJOINT_TRAIN) if apart[i] != default[i]]
    assert min(level.distance(level.start) for level in redrawn) >= SokobanConfig().min_solution  # still kept rooms


def test_disjoint_rooms_leaves_the_test_panel_and_the_default_as_they_are(panel, disjoint):
    assert [str(disjoint.room("test", i)) for i in range(PANEL)] == [str(level.room) for level in panel]
    assert not SokobanConfig().disjoint_rooms
    assert make_world("sokoban", disjoint_rooms=True).config.disjoint_rooms


# -- solver -------------------------------------------------------------------------------------
def test_solver_plans_replay_to_a_solve_on_every_panel_room(panel):
    for level in panel:
        room, plan = level.room, level.solve()
        player, boxes = room.player, room.boxes
        for action in plan:
            _, player, boxes = move(room, player, boxes, room.steps[action])
        assert boxes == room.goals, str(room)
        assert len(plan) == level.distance(level.start)


def test_solver_is_as_short_as_plain_bfs(panel):
    """Pruning dead squares loses no solution: every distance equals brute force's."""
    for level in panel[:200]:
        assert level.distance(level.start) == plain_bfs(level.room), str(level.room)


def test_optimal_actions_are_every_first_move_of_a_shortest_plan():
    level = Solver(
        parse_room("""
        # # # # #
        # _ G _ #
        # _ B _ #
        # _ _ _ #
        # P _ _ #
        # # # # #""")
    )
    assert level.optimal_actions(level.start) == {"up", "right"}
    assert level.expert_action(level.start) == "up"  # ties break in up/down/left/right order
    assert level.solve() == ["up", "right", "up"]


def test_dead_squares_are_corners_and_goalless_walls():
    room = parse_room("""
        # # # # # #
        # _ _ _ _ #
        # _ B _ _ #
        # _ _ P G #
        # # # # # #""")

    def cell(r, c):
        return r * room.width + c

    dead = dead_squares(room)
    assert {cell(1, 1), cell(1, 4), cell(3, 1), cell(1, 2), cell(2, 1)} <= dead  # corners, goalless top and left walls
    assert cell(3, 4) not in dead and cell(3, 2) not in dead and cell(2, 2) not in dead


def test_a_room_too_large_for_the_table_is_refused(monkeypatch):
    monkeypatch.setattr("envs.sokoban.solver.MAX_STATES", 5)
    with pytest.raises(ValueError, match="too large"):
        Solver(parse_room("# # # # # #\n# P _ _ _ #\n# _ B _ _ #\n# _ _ _ G #\n# # # # # #"))


# -- steps and feedback -------------------------------------------------------------------------
def test_moves_pushes_and_goals():
    ep, first = episode("""
        # # # # # # #
        # _ _ _ _ _ #
        # _ P B G _ #
        # _ _ _ _ _ #
        # # # # # # #""")
    assert first.admissible_actions == ["up", "down", "left", "right"] and first.expert_action == "right"
    step = ep.step("up")
    assert (step.feedback.error, step.feedback.diff) == (None, "player moved up")
    step = ep.step("down")
    step = ep.step("right")
    assert step.feedback.diff == "pushed a box right; box is now on a goal; every box is on a goal"
    assert step.done and step.reward == 1.0 and step.info["won"] and not step.info["truncated"]
    assert step.expert_action is None and step.admissible_actions == []
    with pytest.raises(EnvError, match="over"):
        ep.step("left")


def test_box_leaving_a_goal_is_said():
    ep, _ = episode("""
        # # # # # # #
        # _ _ _ _ _ #
        # _ P * _ _ #
        # _ _ B G _ #
        # _ _ _ _ _ #
        # # # # # # #""")
    assert ep.step("right").feedback.diff == "pushed a box right; box left a goal"


@pytest.mark.parametrize(
    "room, action, error",
    [
        ("# # # #\n# P _ #\n# _ B #\n# _ G #\n# # # #", "up", "you walked into a wall"),
        ("# # # # #\n# _ _ _ #\n# _ P B #\n# _ G _ #\n# # # # #", "right", "the box can't move: wall behind it"),
        (
            "# # # # # #\n# _ _ _ G #\n# P B B _ #\n# _ _ _ G #\n# # # # # #",
            "right",
            "the box can't move: another box behind it",
        ),
    ],
)
def test_blocked_moves_are_errors_and_change_nothing(room, action, error):
    ep, first = episode(room)
    step = ep.step(action)
    assert (step.feedback.error, step.feedback.diff) == (error, "no change")
    assert step.observation == first.observation and step.state_key == first.state_key
    assert step.info["invalid"] and not step.done


def test_unknown_action_is_an_error_and_case_is_forgiven():
    ep, first = episode("# # # # #\n# P _ _ #\n# _ B _ #\n# _ _ G #\n# # # # #")
    step = ep.step("jump")
    assert step.feedback.error == "unknown action 'jump': expected up, down, left or right"
    assert step.feedback.diff == "no change" and step.observation == first.observation
    assert ep.step(" Right ").feedback.diff == "player moved right"


def test_action_format_matches_the_four_moves_only(world):
    assert world.action_format.bare.fullmatch("left") and not world.action_format.bare.fullmatch("leftt")
    assert world.action_format.instruction().endswith("<action>up</action>.")


DEADLOCKS = [
    # into a corner: (1, 1) is a wall above and the border left
    (
        """# # # # # #
        # # _ _ _ #
        # _ B P _ #
        # _ _ _ _ #
        # _ _ _ G #
        # # # # # #""",
        "left",
        "deadlock: box pushed into a corner at row 2 col 1",
    ),
    # against the top wall, no goal along row 1
    (
        """# # # # # # #
        # _ _ _ _ _ #
        # _ _ B _ _ #
        # _ _ P _ _ #
        # _ _ _ _ G #
        # # # # # # #""",
        "up",
        "deadlock: box pushed against a wall with no goal along it at row 1 col 3",
    ),
    # beside a box on its goal, both against the top wall: they freeze each other
    (
        """# # # # # # #
        # _ * _ _ _ #
        # _ _ B _ _ #
        # G _ P _ _ #
        # # # # # # #""",
        "up",
        "deadlock: the level can no longer be solved",
    ),
]


@pytest.mark.parametrize("room, action, reason", DEADLOCKS)
def test_a_deadlocking_push_is_named_once(room, action, reason):
    ep, first = episode(room)
    assert first.info["solvable"] and first.expert_action is not None
    step = ep.step(action)
    assert step.feedback.error == reason and step.info["deadlock"] == reason
    assert step.feedback.diff == f"pushed a box {action}; {reason}"
    assert not step.info["solvable"] and not step.info["invalid"] and step.expert_action is None and not step.done
    for later in ("down", "up", "left", "right"):  # said once: later pushes and moves are plain
        step = ep.step(later)
        assert step.info["deadlock"] is None and not (step.feedback.error or "").startswith("deadlock")


@pytest.mark.parametrize("room, action, reason", DEADLOCKS)
def test_end_on_deadlock_ends_the_episode_at_the_deadlocking_push_and_only_there(room, action, reason):
    ep, _ = episode(room, end_on_deadlock=True)
    step = ep.step(action)
    assert step.done and step.reward == 0.0 and step.info["deadlock"] == reason
    assert not step.info["truncated"] and not step.info["won"] and step.admissible_actions == []
    # a bump (an error that is no deadlock) does not end it
    ep, _ = episode("# # # # # #\n# P _ _ _ #\n# _ _ B _ #\n# _ _ _ G #\n# # # # # #", end_on_deadlock=True)
    step = ep.step("up")
    assert step.feedback.error and not step.done


def test_end_on_deadlock_is_a_world_setting():
    assert not SokobanConfig().end_on_deadlock  # off by default: the episode runs to the turn limit
    assert make_world("sokoban", end_on_deadlock=True).config.end_on_deadlock


def test_turn_limit_ends_with_reward_zero():
    ep, _ = episode("# # # # # #\n# P _ _ _ #\n# _ _ B _ #\n# _ _ _ G #\n# # # # # #", max_turns=2)
    ep.step("right")
    step = ep.step("left")
    assert step.done and step.reward == 0.0 and step.info["truncated"] and not step.info["won"]


def test_an_episode_before_its_first_reset_has_no_room():
    ep = SokobanWorld().new_episode("test")
    assert ep.expert_action() is None and ep.solvable_actions() == []  # over until reset: nothing to read
    with pytest.raises(EnvError, match="no room yet: reset the episode first"):
        _ = ep.room


def test_observation_is_the_grid_and_state_key_its_hash(world):
    ep = world.new_episode("test")
    first = ep.reset(0)
    assert first.observation == str(world.room("test", 0))
    assert ep.reset(0).state_key == first.state_key
    assert set(first.observation.split()) <= set("#_GB*P+")


# -- policies on the panel ----------------------------------------------------------------------
def test_expert_solves_every_panel_room_in_the_fewest_moves(world, panel):
    ep = world.new_episode("test")
    for i, level in enumerate(panel):
        step, turns = ep.reset(i), 0
        while not step.done:
            step, turns = ep.step(step.expert_action), turns + 1
        assert step.info["won"] and step.reward == 1.0 and turns == level.distance(level.start)


def test_random_policy_is_far_below_the_expert(world):
    """Uniform over the four moves, seeded. Measured: 4.4 % of the panel in 15 turns (22 of 500;
    docs/ENVS.md measured 3.6 % on TextArena's rooms), and 140 deadlocking pushes."""
    rng, ep, wins = random.Random(0), world.new_episode("test"), 0
    for i in range(PANEL):
        step = ep.reset(i)
        while not step.done:
            step = ep.step(rng.choice(step.admissible_actions))
            assert step.done or (step.expert_action is None) == (not step.info["solvable"])
        wins += step.info["won"]
    assert wins / PANEL < 0.3


# -- splits and settings ------------------------------------------------------------------------
def test_bad_split_task_or_setting_is_one_clear_error(world):
    with pytest.raises(EnvError, match="unknown Sokoban split 'valid'"):
        world.new_episode("valid")
    with pytest.raises(EnvError, match="unknown Sokoban split"):
        world.num_tasks("dev")
    ep = world.new_episode("test")
    for bad in (PANEL, -1):
        with pytest.raises(EnvError, match=r"task id .* out of range: Sokoban split 'test' has tasks 0\.\.499"):
            ep.reset(bad)
    with pytest.raises(EnvError, match="size must be at least 4"):
        make_world("sokoban", size=3)
    with pytest.raises(EnvError, match="bad settings"):
        make_world("sokoban", colour="red")
    with pytest.raises(EnvError, match="lower min_solution"):
        SokobanWorld(SokobanConfig(min_solution=60)).room("test", 0)


def test_registered_with_settings():
    world = make_world("sokoban", size=7, boxes=2, max_turns=30)
    step = world.new_episode("train").reset(3)
    assert len(step.observation.splitlines()) == 7 and step.observation.count("B") + step.observation.count("*") == 2
    assert world.corpus_texts() and "deadlock: the level can no longer be solved" in world.corpus_texts()


PANEL_SHA1 = "2270974c5e2afc1f"
TRAIN_SHA1 = "57983b31549f535c"  # train rooms 0-299 at the default settings
