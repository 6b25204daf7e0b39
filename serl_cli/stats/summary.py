"""Summaries for every report: success-rate intervals, means over seeds, t-intervals.

Every helper takes plain lists of floats and returns plain floats (None where undefined).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def scipy_stats():
    """scipy.stats, imported when a test statistic is computed: a second of start-up that a
    command which never summarizes (or a config error) does not pay."""
    from scipy import stats

    return stats


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> list[float]:
    """Wilson score interval for a binomial proportion (stays inside [0, 1], sane at 0 and n)."""
    if n == 0:
        return [0.0, 1.0]
    z = float(scipy_stats().norm.ppf(0.5 + confidence / 2))
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return [max(0.0, centre - half), min(1.0, centre + half)]


def finite_or_none(x) -> float | None:
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
    assert m is not None and s is not None  # both defined from two values on
    half = float(scipy_stats().t.ppf(0.5 + confidence / 2, n - 1)) * s / math.sqrt(n)
    return [m - half, m + half]


def describe(xs: Sequence[float], confidence: float = 0.95) -> dict:
    xs = [float(x) for x in xs]
    return {"n": len(xs), "mean": mean(xs), "std": std(xs), "ci95": t_interval(xs, confidence)}


def fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def fmt_ci(lo: float | None, hi: float | None, digits: int = 3) -> str:
    return "n/a" if lo is None else f"[{lo:.{digits}f}, {hi:.{digits}f}]"


def fmt_p(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.3g}"
