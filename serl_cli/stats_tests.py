"""Statistics for ablation reports: summaries over seeds, t-intervals, paired tests.

Every helper takes plain lists of floats and returns plain floats (JSON-able). Where a
quantity is undefined -- one value (no spread), zero variance (a t statistic of 0/0), no
pairs -- it is ``None``, never NaN, so reports print "n/a" and ``json.dumps`` works.

* :func:`describe`: n, mean, sample std (ddof 1), and the 95 % t-interval of the mean
  ``mean +- t_{0.975, n-1} * std / sqrt(n)`` (``scipy.stats.t``).
* :func:`paired_t_test`: the paired t-test of ``a - b`` (pairs matched by the caller, here
  by seed): mean difference, its t-interval, t statistic, two-sided p-value; agrees with
  ``scipy.stats.ttest_rel``. All differences equal (zero variance): the interval collapses
  to the difference and t / p are None.
* :func:`wilcoxon_signed_rank`: ``scipy.stats.wilcoxon`` (two-sided) where at least
  ``min_n`` (6) pairs exist and not all differences are zero; None otherwise.
"""

from __future__ import annotations

import math
from typing import Sequence

from scipy import stats as _st


def _finite(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def std(xs: Sequence[float]) -> float | None:
    """Sample standard deviation (ddof 1); None below two values."""
    n = len(xs)
    if n < 2:
        return None
    m = sum(xs) / n
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))


def t_interval(xs: Sequence[float], confidence: float = 0.95) -> list[float] | None:
    """The t-interval of the mean; None below two values. Zero variance: [mean, mean]."""
    n = len(xs)
    if n < 2:
        return None
    m, s = mean(xs), std(xs)
    half = float(_st.t.ppf(0.5 + confidence / 2, n - 1)) * s / math.sqrt(n)
    return [m - half, m + half]


def describe(xs: Sequence[float], confidence: float = 0.95) -> dict:
    xs = [float(x) for x in xs]
    return {"n": len(xs), "mean": mean(xs), "std": std(xs), "ci95": t_interval(xs, confidence)}


def paired_t_test(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> dict:
    """Paired t-test of ``a - b``; ``a[i]`` and ``b[i]`` must belong together (same seed)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    n = len(d)
    out = {"n": n, "mean_diff": mean(d), "std_diff": std(d), "ci95": t_interval(d, confidence),
           "t": None, "p": None}
    if n < 2 or not out["std_diff"]:
        return out  # one pair, or every difference equal: t is 0/0 or +-inf, not a test
    res = _st.ttest_rel([float(x) for x in a], [float(y) for y in b])
    out["t"], out["p"] = _finite(res.statistic), _finite(res.pvalue)
    return out


def wilcoxon_signed_rank(a: Sequence[float], b: Sequence[float], min_n: int = 6) -> dict | None:
    """Two-sided Wilcoxon signed-rank test of ``a - b``; None below ``min_n`` pairs or all-zero differences."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    if len(d) < min_n or all(x == 0 for x in d):
        return None
    res = _st.wilcoxon(d)
    return {"n": len(d), "statistic": _finite(res.statistic), "p": _finite(res.pvalue)}


def fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"
