"""Small statistics used in every report: intervals for success rates."""

from __future__ import annotations

import math

from scipy import stats as _st


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> list[float]:
    """Wilson score interval for a binomial proportion (stays inside [0, 1], sane at 0 and n)."""
    if n == 0:
        return [0.0, 1.0]
    z = float(_st.norm.ppf(0.5 + confidence / 2))
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return [max(0.0, centre - half), min(1.0, centre + half)]
