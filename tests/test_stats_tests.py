"""The ablation report's statistics, checked against scipy on fixed inputs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from serl_cli.stats.paired import paired_t_test, wilcoxon_signed_rank
from serl_cli.stats.summary import describe, t_interval

A = [0.62, 0.55, 0.71, 0.58, 0.66]
B = [0.50, 0.52, 0.60, 0.49, 0.61]


def test_describe_matches_numpy_and_scipy():
    d = describe(A)
    assert d["n"] == 5
    assert d["mean"] == pytest.approx(np.mean(A))
    assert d["std"] == pytest.approx(np.std(A, ddof=1))
    lo, hi = stats.t.interval(0.95, len(A) - 1, loc=np.mean(A), scale=stats.sem(A))
    assert d["ci95"] == pytest.approx([lo, hi])


def test_t_interval_other_confidence():
    lo, hi = stats.t.interval(0.9, len(B) - 1, loc=np.mean(B), scale=stats.sem(B))
    assert t_interval(B, 0.9) == pytest.approx([lo, hi])


def test_paired_t_test_matches_ttest_rel():
    r = paired_t_test(A, B)
    ref = stats.ttest_rel(A, B)
    assert r["t"] == pytest.approx(ref.statistic)
    assert r["p"] == pytest.approx(ref.pvalue)
    d = np.array(A) - np.array(B)
    assert r["mean_diff"] == pytest.approx(d.mean())
    lo, hi = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
    assert r["ci95"] == pytest.approx([lo, hi])


def test_wilcoxon_matches_scipy_and_needs_six_pairs():
    a = [0.1, 0.4, 0.35, 0.8, 0.5, 0.9, 0.3]
    b = [0.2, 0.1, 0.30, 0.5, 0.45, 0.4, 0.25]
    w = wilcoxon_signed_rank(a, b)
    ref = stats.wilcoxon(np.array(a) - np.array(b))
    assert w["statistic"] == pytest.approx(ref.statistic) and w["p"] == pytest.approx(ref.pvalue)
    assert wilcoxon_signed_rank(A, B) is None  # five pairs
    assert wilcoxon_signed_rank([1.0] * 6, [1.0] * 6) is None  # all differences zero


def test_degenerate_cases_give_none_not_nan():
    one = describe([0.5])
    assert one == {"n": 1, "mean": 0.5, "std": None, "ci95": None}
    assert describe([]) == {"n": 0, "mean": None, "std": None, "ci95": None}
    flat = describe([0.3, 0.3, 0.3])
    assert flat["std"] == 0.0 and flat["ci95"] == pytest.approx([0.3, 0.3])
    same = paired_t_test([0.5, 0.7, 0.9], [0.4, 0.6, 0.8])  # constant difference: t = d / 0
    assert same["mean_diff"] == pytest.approx(0.1) and same["t"] is None and same["p"] is None
    zero = paired_t_test([0.0, 0.0], [0.0, 0.0])
    assert zero["t"] is None and zero["p"] is None and zero["mean_diff"] == 0.0
    single = paired_t_test([1.0], [0.0])
    assert single["ci95"] is None and single["p"] is None
    for r in (one, flat, same, zero, single):
        text = json.dumps(r)
        assert "NaN" not in text and "Infinity" not in text
    with pytest.raises(ValueError):
        paired_t_test([1.0, 2.0], [1.0])
    assert not any(
        isinstance(v, float) and math.isnan(v)
        for v in paired_t_test(A, B).values()
        if v is not None and not isinstance(v, list)
    )


def test_holm_hand_values():
    from serl_cli.stats.paired import holm

    # m = 4 tests: sorted 0.01, 0.02, 0.03, 0.20 -> 0.04, 0.06, 0.06 (monotone: max(0.06, 0.06)), 0.20
    adjusted = holm([0.03, 0.01, None, 0.20, 0.02])
    assert adjusted[2] is None and adjusted[0] == pytest.approx(0.06) and adjusted[1] == pytest.approx(0.04)
    assert adjusted[3] == pytest.approx(0.20) and adjusted[4] == pytest.approx(0.06)
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1 and kept monotone
    assert holm([]) == []
