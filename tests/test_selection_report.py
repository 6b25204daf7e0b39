"""The selection-bias report (METHOD.md 8) on small hand-made runs."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats

from serl_cli.artifacts.records import make_annotation, make_episode
from serl_cli.errors import SerlError
from serl_cli.method.diagnostics.selection_report import selection_report


def rec(episode, turn, selected, sources=(), fired=(), advantage=0.0):
    return make_annotation(
        episode=episode, turn=turn, selected=selected, sources=list(sources), fired=list(fired), advantage=advantage
    )


EPISODES = [
    make_episode(reward=1.0, success=True),
    make_episode(reward=0.0, success=False),
    make_episode(reward=0.5, success=False),
    make_episode(reward=1.0, success=True),
]
RECORDS = [
    rec(0, 0, False, ["diff"], [], 1.0),
    rec(0, 1, True, ["error", "diff"], ["error"], 1.0),
    rec(1, 0, True, ["error"], ["error"], -1.0),
    rec(1, 1, True, ["diff"], ["diff"], -1.0),
    rec(1, 2, False, [], [], -1.0),
    rec(2, 0, False, ["diff"], [], -0.5),
    rec(3, 0, False, [], [], 0.5),
]


def roundtrip(report):
    assert json.loads(json.dumps(report, allow_nan=False)) == report
    return report


def test_counts_and_fractions_by_hand():
    r = roundtrip(selection_report(RECORDS, EPISODES))
    assert r["counts"] == {
        "turns": 7,
        "selected_turns": 3,
        "selected_fraction": pytest.approx(3 / 7),
        "turns_fired": 3,
        "episodes": 4,
        "episodes_with_selected": 2,
        "episodes_with_selected_fraction": 0.5,
    }
    assert r["selected_by_outcome"]["success"] == {"turns": 3, "selected": 1, "selected_fraction": pytest.approx(1 / 3)}
    assert r["selected_by_outcome"]["failure"] == {"turns": 4, "selected": 2, "selected_fraction": 0.5}
    assert r["sources"] == {
        "diff": {
            "produced": 4,
            "produced_fraction": pytest.approx(4 / 7),
            "fired": 1,
            "fired_fraction": pytest.approx(1 / 7),
        },
        "error": {
            "produced": 2,
            "produced_fraction": pytest.approx(2 / 7),
            "fired": 2,
            "fired_fraction": pytest.approx(2 / 7),
        },
    }


def test_distributions_by_hand():
    r = selection_report(RECORDS, EPISODES)
    sel, uns = r["episode_reward"]["selected"], r["episode_reward"]["unselected"]
    assert sel["n"] == 3 and sel["mean"] == pytest.approx(1 / 3) and sel["min"] == 0.0 and sel["max"] == 1.0
    assert sel["median"] == 0.0
    # unselected turns' rewards: 1.0, 0.0, 0.5, 1.0
    assert uns == {
        "n": 4,
        "mean": 0.625,
        "std": pytest.approx(np.sqrt(0.6875 / 4)),
        "min": 0.0,
        "q1": 0.375,
        "median": 0.75,
        "q3": 1.0,
        "max": 1.0,
    }
    assert r["advantage"]["selected"]["mean"] == pytest.approx(-1 / 3)
    assert r["advantage"]["unselected"]["mean"] == 0.0
    assert r["rollouts"]["with_selected"]["n"] == 2 and r["rollouts"]["with_selected"]["mean"] == 0.5
    assert r["rollouts"]["without_selected"]["n"] == 2 and r["rollouts"]["without_selected"]["mean"] == 0.75


def test_p_values_match_scipy():
    r = selection_report(RECORDS, EPISODES)
    mw = stats.mannwhitneyu([1.0, 0.0, 0.0], [1.0, 0.0, 0.5, 1.0], alternative="two-sided")
    assert r["tests"]["mann_whitney"] == {
        "statistic": pytest.approx(float(mw.statistic)),
        "p_value": pytest.approx(float(mw.pvalue)),
    }
    assert r["tests"]["fisher"]["table"] == [[1, 2], [2, 2]]
    odds, p = stats.fisher_exact([[1, 2], [2, 2]])
    assert r["tests"]["fisher"]["odds_ratio"] == pytest.approx(odds)
    assert r["tests"]["fisher"]["p_value"] == pytest.approx(p)
    assert r["tests"]["verdict"].startswith("no evidence that selection tracks reward at alpha 0.05")


def biased_run():
    """10 failed rollouts with one selected turn of two, 10 successes with none selected."""
    episodes = [make_episode(reward=0.0, success=False)] * 10 + [make_episode(reward=1.0, success=True)] * 10
    records = [
        rec(
            e,
            t,
            e < 10 and t == 0,
            ["error"] if e < 10 else [],
            ["error"] if e < 10 and t == 0 else [],
            -1.0 if e < 10 else 1.0,
        )
        for e in range(20)
        for t in range(2)
    ]
    return records, episodes


def test_selection_from_failed_rollouts_is_flagged():
    records, episodes = biased_run()
    r = roundtrip(selection_report(records, episodes))
    assert r["tests"]["fisher"]["table"] == [[0, 10], [20, 10]]
    _, p = stats.fisher_exact([[0, 10], [20, 10]])
    assert r["tests"]["fisher"]["p_value"] == pytest.approx(p) and p < 0.05
    assert r["tests"]["fisher"]["odds_ratio"] == 0.0
    mw = stats.mannwhitneyu([0.0] * 10, [0.0] * 10 + [1.0] * 20, alternative="two-sided")
    assert r["tests"]["mann_whitney"]["p_value"] == pytest.approx(float(mw.pvalue))
    assert r["tests"]["verdict"].startswith("selected turns come disproportionately from failed rollouts (Fisher p=")
    assert r["selected_by_outcome"]["failure"]["selected_fraction"] == 0.5
    assert r["selected_by_outcome"]["success"]["selected_fraction"] == 0.0


def test_infinite_odds_ratio_is_none():
    records, episodes = biased_run()
    for r in records:  # now select only turns of the successes
        r.selected = r.episode >= 10 and r.turn == 0
    rep = roundtrip(selection_report(records, episodes))
    assert rep["tests"]["fisher"]["table"] == [[10, 0], [10, 20]]
    assert rep["tests"]["fisher"]["odds_ratio"] is None  # inf is not JSON
    assert "successful rollouts" in rep["tests"]["verdict"]


def test_one_class_only_keeps_mann_whitney():
    """Every rollout failed, but partial scores differ: Fisher is untestable, Mann-Whitney is not."""
    episodes = [make_episode(reward=0.1, success=False)] * 8 + [make_episode(reward=0.9, success=False)] * 8
    records = [rec(e, 0, e < 8) for e in range(16)]
    r = roundtrip(selection_report(records, episodes))
    assert r["tests"]["fisher"]["p_value"] is None and r["tests"]["fisher"]["odds_ratio"] is None
    mw = stats.mannwhitneyu([0.1] * 8, [0.9] * 8, alternative="two-sided")
    assert r["tests"]["mann_whitney"]["p_value"] == pytest.approx(float(mw.pvalue)) and mw.pvalue < 0.05
    assert r["tests"]["untestable"] == "every rollout failed (one class only)"
    assert "lower-reward" in r["tests"]["verdict"] and "one class only" in r["tests"]["verdict"]
    assert r["selected_by_outcome"]["success"] == {"turns": 0, "selected": 0, "selected_fraction": None}


@pytest.mark.parametrize("selected, reason", [(False, "no turn is selected"), (True, "every turn is selected")])
def test_none_or_all_selected(selected, reason):
    records = [replace(r, selected=selected) for r in RECORDS]
    r = roundtrip(selection_report(records, EPISODES))
    assert r["tests"]["mann_whitney"] == {"statistic": None, "p_value": None}
    assert r["tests"]["fisher"]["p_value"] is None
    assert r["tests"]["verdict"] == f"no test: {reason}"
    empty = "selected" if not selected else "unselected"
    assert r["episode_reward"][empty] == {
        "n": 0,
        "mean": None,
        "std": None,
        "min": None,
        "q1": None,
        "median": None,
        "q3": None,
        "max": None,
    }


def test_empty_run():
    r = roundtrip(selection_report([], []))
    assert r["counts"]["turns"] == 0 and r["counts"]["selected_fraction"] is None
    assert r["counts"]["episodes_with_selected_fraction"] is None
    assert r["sources"] == {} and r["tests"]["verdict"] == "no test: no turn is selected"


def test_missing_advantage_values_are_skipped():
    records = [replace(r, advantage=None) if r.turn == 0 else r for r in RECORDS]
    r = roundtrip(selection_report(records, EPISODES))
    assert r["advantage"]["selected"]["n"] == 2 and r["advantage"]["unselected"]["n"] == 1  # (1, 2) only


def test_bad_input_is_a_serl_error():
    with pytest.raises(SerlError, match="episode 9"):
        selection_report([rec(9, 0, True)], EPISODES)
