"""The selection-bias check of ``serl annotate`` (METHOD.md section 8).

Does the critical set S track the task reward, or amplify a spurious signal? The report
compares the selected turns with the rest: the reward of their rollouts, their advantage,
how often turns are selected in successful vs failed rollouts, which sources produced
text and which fired, the rewards of rollouts with vs without selected turns, and two
two-sample tests on turns:

- Mann-Whitney U (two-sided) of the episode reward, selected vs unselected turns;
- Fisher's exact test of the 2x2 table selected x success, rows (selected, unselected),
  columns (success, failure); an odds ratio > 1 means selected turns lean to successes.

The same two tests are repeated among the **scorable** turns alone (``scorable``): those with
a block and a nonzero advantage, the only turns a weight can change and the only ones
``random`` placement draws from. Against all turns, a rule that selects only scorable turns
looks biased toward successes merely because the unscorable turns (groups whose rollouts all
failed, advantage 0) sit in failed rollouts: study v3 (c) traced ``random``'s lean to that.

Caveat: the unit is the turn, and turns of one rollout share its reward, so the tests
treat dependent samples as independent; with long rollouts their p-values are optimistic.

Distributions give n, mean, population std, min, quartiles (numpy linear interpolation)
and max. Every number is a plain int or float; where there is none (an empty sample, an
untestable case, an infinite odds ratio) the field is None, so ``json.dumps(report,
allow_nan=False)`` always works. Degenerate inputs give a report whose test fields are
None and whose verdict says why, never an exception.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, SupportsFloat

import numpy as np

from serl_cli.artifacts.records import Annotation, Episode
from serl_cli.errors import SerlError
from serl_cli.stats.summary import scipy_stats


def _num(x: SupportsFloat | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _frac(a: int, b: int) -> float | None:
    return a / b if b else None


def distribution(values: Iterable[float | None]) -> dict:
    """n, mean, std (population), min, q1, median, q3, max of the non-None values."""
    v = np.asarray([float(x) for x in values if x is not None], dtype=float)
    if v.size == 0:
        return {"n": 0, "mean": None, "std": None, "min": None, "q1": None, "median": None, "q3": None, "max": None}
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return {
        "n": int(v.size),
        "mean": _num(v.mean()),
        "std": _num(v.std()),
        "min": _num(v.min()),
        "q1": _num(q1),
        "median": _num(med),
        "q3": _num(q3),
        "max": _num(v.max()),
    }


def _check(records: list[Annotation], episodes: list[Episode]) -> None:
    for n, r in enumerate(records):
        if not 0 <= r.episode < len(episodes):
            raise SerlError(f"annotation record {n} names episode {r.episode!r}, but the run has {len(episodes)}")


def _tests(sel_r: list[float], uns_r: list[float], table: list[list[int]], alpha: float) -> dict:
    """Mann-Whitney and Fisher results, None where untestable, plus the reason."""
    out: dict[str, Any] = {
        "alpha": alpha,
        "mann_whitney": {"statistic": None, "p_value": None},
        "fisher": {"table": table, "odds_ratio": None, "p_value": None},
        "untestable": None,
    }
    if not sel_r:
        out["untestable"] = "no turn is selected"
        return out
    if not uns_r:
        out["untestable"] = "every turn is selected"
        return out
    mw = scipy_stats().mannwhitneyu(sel_r, uns_r, alternative="two-sided")
    out["mann_whitney"] = {"statistic": _num(mw.statistic), "p_value": _num(mw.pvalue)}
    (a, b), (c, d) = table
    if a + c == 0 or b + d == 0:
        out["untestable"] = "every rollout " + ("failed" if a + c == 0 else "succeeded") + " (one class only)"
        return out
    odds, p = scipy_stats().fisher_exact(table, alternative="two-sided")
    out["fisher"].update(odds_ratio=_num(odds), p_value=_num(p))
    return out


# mean_sel, mean_uns: a float, or None for a sample with no finite mean; compared only where Mann-Whitney ran
def _verdict(t: dict, frac_success: float, frac_failure: float, mean_sel: Any, mean_uns: Any) -> str:
    mw_p, f_p, alpha = t["mann_whitney"]["p_value"], t["fisher"]["p_value"], t["alpha"]
    if mw_p is None and f_p is None:
        return f"no test: {t['untestable'] or 'the tests gave no p-value'}"
    ps = ", ".join(f"{name} p={p:.3g}" for name, p in (("Fisher", f_p), ("Mann-Whitney", mw_p)) if p is not None)
    note = f"; Fisher untestable: {t['untestable']}" if t["untestable"] else ""
    if f_p is not None and f_p < alpha:
        side = "failed" if frac_failure > frac_success else "successful"
        return f"selected turns come disproportionately from {side} rollouts ({ps})"
    if mw_p is not None and mw_p < alpha:
        side = "lower" if mean_sel < mean_uns else "higher"
        return f"selected turns come from {side}-reward rollouts than the rest ({ps}{note})"
    return f"no evidence that selection tracks reward at alpha {alpha:g} ({ps}{note})"


def selection_report(records: list[Annotation], episodes: list[Episode], *, alpha: float = 0.05) -> dict:
    """The selection-bias report of annotation ``records`` over the run's ``episodes``."""
    _check(records, episodes)
    reward = [float(ep.reward) for ep in episodes]
    success = [bool(ep.success) for ep in episodes]
    sel = [r for r in records if r.selected]
    uns = [r for r in records if not r.selected]
    n, n_sel = len(records), len(sel)
    with_sel = {int(r.episode) for r in sel}
    eps_with = sorted(with_sel)
    eps_without = [e for e in range(len(episodes)) if e not in with_sel]

    by_outcome = {}
    for name, want in (("success", True), ("failure", False)):
        rs = [r for r in records if success[r.episode] == want]
        k = sum(1 for r in rs if r.selected)
        by_outcome[name] = {"turns": len(rs), "selected": k, "selected_fraction": _frac(k, len(rs))}

    names = sorted({s for r in records for s in list(r.sources or []) + list(r.fired or [])})
    sources = {}
    for s in names:
        made = sum(1 for r in records if s in (r.sources or []))
        fired = sum(1 for r in records if s in (r.fired or []))
        sources[s] = {
            "produced": made,
            "produced_fraction": _frac(made, n),
            "fired": fired,
            "fired_fraction": _frac(fired, n),
        }

    tests = _bias_tests(records, reward, success, alpha)
    reward_dist = {
        "selected": distribution(reward[r.episode] for r in sel),
        "unselected": distribution(reward[r.episode] for r in uns),
    }
    scorable = [r for r in records if is_scorable(r)]
    return {
        "unit": "turn",
        "counts": {
            "turns": n,
            "selected_turns": n_sel,
            "selected_fraction": _frac(n_sel, n),
            "turns_fired": sum(1 for r in records if r.fired),
            "episodes": len(episodes),
            "episodes_with_selected": len(eps_with),
            "episodes_with_selected_fraction": _frac(len(eps_with), len(episodes)),
        },
        "episode_reward": reward_dist,
        "advantage": {
            "selected": distribution(r.advantage for r in sel),
            "unselected": distribution(r.advantage for r in uns),
        },
        "selected_by_outcome": by_outcome,
        "sources": sources,
        "rollouts": {
            "with_selected": distribution(reward[e] for e in eps_with),
            "without_selected": distribution(reward[e] for e in eps_without),
        },
        "tests": tests,
        "scorable": {
            "turns": len(scorable),
            "selected_turns": sum(1 for r in scorable if r.selected),
            "tests": _bias_tests(scorable, reward, success, alpha),
        },
    }


def is_scorable(record: Annotation) -> bool:
    """A turn a weight can change: it has a block (a source rendered) and a nonzero advantage."""
    return bool(record.sources) and record.advantage is not None and record.advantage != 0


def _bias_tests(records: list[Annotation], reward: list[float], success: list[bool], alpha: float) -> dict:
    """The two tests and the verdict, selected against unselected among ``records``."""
    sel = [r for r in records if r.selected]
    uns = [r for r in records if not r.selected]
    sel_r = [reward[r.episode] for r in sel]
    uns_r = [reward[r.episode] for r in uns]
    table = [
        [sum(1 for r in group if success[r.episode]), sum(1 for r in group if not success[r.episode])]
        for group in (sel, uns)
    ]
    tests = _tests(sel_r, uns_r, table, alpha)
    fraction = {}
    for want in (True, False):
        rs = [r for r in records if success[r.episode] == want]
        fraction[want] = _frac(sum(1 for r in rs if r.selected), len(rs)) or 0.0
    tests["verdict"] = _verdict(
        tests, fraction[True], fraction[False], distribution(sel_r)["mean"], distribution(uns_r)["mean"]
    )
    return tests
