"""Placement rules (METHOD.md 5): hand-worked selections for every rule."""

from __future__ import annotations

import math
import random

import pytest

from serl_cli.errors import SerlError
from serl_cli.method.placement import (
    PLACEMENTS,
    TurnInfo,
    check_rule,
    gap_count,
    needs_teacher_before_selection,
    select,
)

# fired:  T     F     T     F     F     T
# score:  0.5  -2.0  None  2.0   0.1   NaN
TURNS = [
    TurnInfo((0, 0), True, 0.5),
    TurnInfo((0, 1), False, -2.0),
    TurnInfo((1, 0), True, None),
    TurnInfo((1, 1), False, 2.0),
    TurnInfo((1, 2), False, 0.1),
    TurnInfo((2, 0), True, math.nan),
]


def idx(mask):
    return [i for i, s in enumerate(mask) if s]


def test_registry_names():
    assert sorted(PLACEMENTS) == ["all", "feedback", "gap", "random"]


def test_feedback_selects_fired_turns():
    assert select("feedback", TURNS) == [True, False, True, False, False, True]


def test_all_selects_every_turn_with_a_block():
    assert select("all", TURNS) == [True] * 6
    assert select("all", []) == []
    # the authors' used_context mask (PC:1843-1845): a turn without a block is not reweighted
    blocks = [TurnInfo((0, i), False, None, has_block=i != 1) for i in range(3)]
    assert select("all", blocks) == [True, False, True]


@pytest.mark.parametrize(
    "rho, expected",
    [
        (0.25, [1]),  # 4 scored -> 1 turn; |-2.0| and |2.0| tie, the earlier turn wins
        (0.5, [1, 3]),
        (0.75, [0, 1, 3]),
        (1.0, [0, 1, 3, 4]),  # the unscored turns (None, NaN) are never selected
        (0.01, [1]),  # at least one when rho > 0 and a turn is scored
        (0.0, []),
    ],
)
def test_gap_top_rho(rho, expected):
    assert idx(select("gap", TURNS, rho=rho)) == expected


def test_gap_without_scores_selects_nothing():
    turns = [TurnInfo((0, i), True, None) for i in range(4)]
    assert select("gap", turns, rho=1.0) == [False] * 4


def test_gap_count_rounds_half_up():
    assert gap_count(10, 0.25) == 3  # 2.5 -> 3
    assert gap_count(10, 0.35) == 4  # 3.4999999999999996 in floats, still 3.5 -> 4
    assert gap_count(10, 0.24) == 2
    assert gap_count(3, 0.1) == 1
    assert gap_count(0, 0.5) == 0
    assert gap_count(5, 0.0) == 0


def test_gap_tie_break_by_turn_order():
    turns = [TurnInfo((0, i), False, s) for i, s in enumerate([1.0, -3.0, 3.0, 0.0, -3.0])]
    assert idx(select("gap", turns, rho=0.4)) == [1, 2]  # 2 of 5: the first two of three |3.0|
    assert idx(select("gap", turns, rho=0.6)) == [1, 2, 4]


def test_random_matches_feedback_budget_and_is_seeded():
    turns = [TurnInfo((0, i), i % 5 == 0, None) for i in range(50)]  # 10 fired
    a = select("random", turns, seed=3)
    assert sum(a) == sum(select("feedback", turns)) == 10
    assert select("random", turns, seed=3) == a
    assert select("random", turns, seed=4) != a
    assert idx(a) == sorted(random.Random(3).sample(range(50), 10))


def test_random_never_exceeds_n():
    every = [TurnInfo((0, i), True, None) for i in range(5)]
    assert select("random", every, seed=1) == [True] * 5
    none = [TurnInfo((0, i), False, None) for i in range(5)]
    assert select("random", none, seed=1) == [False] * 5
    assert select("random", [], seed=1) == []


def test_random_matches_feedback_on_scored_turns():
    # 20 turns: every 4th fired; turns 8-19 have no block or a zero advantage (not scorable), so of
    # feedback's 5 fired turns only 0 and 4 are scored; random must score 2 as well, among scorable turns
    turns = [TurnInfo((0, i), i % 4 == 0, None, has_block=i < 14, scorable=i < 8) for i in range(20)]
    fb = select("feedback", turns)
    scored_fb = sum(1 for t, s in zip(turns, fb, strict=True) if s and t.scorable)
    assert scored_fb == 2
    for seed in range(50):
        rnd = select("random", turns, seed=seed)
        assert sum(rnd) == scored_fb  # every turn random selects is scored
        assert all(turns[i].scorable for i in idx(rnd))


def test_random_is_uniform_over_turns():
    turns = [TurnInfo((0, i), i < 3, None) for i in range(10)]
    counts = [0] * 10
    for seed in range(2000):
        for i in idx(select("random", turns, seed=seed)):
            counts[i] += 1
    assert all(abs(c / 2000 - 0.3) < 0.05 for c in counts)


def test_needs_teacher_before_selection():
    assert needs_teacher_before_selection("gap") is True
    for rule in ("feedback", "all", "random"):
        assert needs_teacher_before_selection(rule) is False


def test_unknown_rule_lists_known_rules():
    for call in (
        lambda: select("dense", TURNS),
        lambda: check_rule("dense"),
        lambda: needs_teacher_before_selection("dense"),
    ):
        with pytest.raises(SerlError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and "'dense'" in msg
        assert "all, feedback, gap, random" in msg


@pytest.mark.parametrize("rho", [-0.1, 1.5, math.nan])
def test_bad_rho(rho):
    with pytest.raises(SerlError, match="rho"):
        select("gap", TURNS, rho=rho)
    with pytest.raises(SerlError, match="rho"):
        check_rule("feedback", rho=rho)
    check_rule("feedback")  # no rho given: only the name is checked
