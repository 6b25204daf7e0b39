"""Paired comparisons of two arms over the same seeds: the paired t-test and Wilcoxon's signed-rank test."""

from __future__ import annotations

from collections.abc import Sequence

from serl_cli.stats.summary import finite_or_none, mean, scipy_stats, std, t_interval


def paired_t_test(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> dict:
    """Paired t-test of ``a - b``; ``a[i]`` and ``b[i]`` must belong together (same seed)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    d = [float(x) - float(y) for x, y in zip(a, b, strict=True)]
    n = len(d)
    out = {"n": n, "mean_diff": mean(d), "std_diff": std(d), "ci95": t_interval(d, confidence), "t": None, "p": None}
    if n < 2 or not out["std_diff"]:
        return out  # one pair, or every difference equal: t is 0/0 or +-inf, not a test
    res = scipy_stats().ttest_rel([float(x) for x in a], [float(y) for y in b])
    out["t"], out["p"] = finite_or_none(res.statistic), finite_or_none(res.pvalue)
    return out


def wilcoxon_signed_rank(a: Sequence[float], b: Sequence[float], min_n: int = 6) -> dict | None:
    """Two-sided Wilcoxon signed-rank test of ``a - b``; None below ``min_n`` pairs or all-zero differences."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    d = [float(x) - float(y) for x, y in zip(a, b, strict=True)]
    if len(d) < min_n or all(x == 0 for x in d):
        return None
    res = scipy_stats().wilcoxon(d)
    return {"n": len(d), "statistic": finite_or_none(res.statistic), "p": finite_or_none(res.pvalue)}


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of a family of p-values (None stays None, and is not counted):
    the i-th smallest of m becomes max over j <= i of min(1, (m - j + 1) p_(j)). It controls the
    family-wise error rate under any dependence between the tests (Holm 1979)."""
    ranked = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    out: list[float | None] = [None] * len(pvalues)
    m, running = len(ranked), 0.0
    for j, (p, i) in enumerate(ranked):
        running = max(running, min(1.0, (m - j) * p))
        out[i] = running
    return out
