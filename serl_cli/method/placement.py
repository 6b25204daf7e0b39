"""Placement rules: which turns form the critical set S (METHOD.md section 5).

A rule sees every turn of a run, in the run's turn order, as a ``TurnInfo`` and returns a
bool per turn (True: the turn is in S). Rules are registered by name in ``PLACEMENTS``:

    all       every turn with a hindsight block: the authors' recipe and ``--algo serl``'s
              default (their ``used_context`` mask, recipe/serl/privileged_context.py:1843-1845)
    feedback  turns whose sources fired
    gap       the top fraction ``rho`` of turns by |mean token log-ratio| of teacher and
              student; turns without a score are never selected
    random    as many SCORED turns as ``feedback`` gives, drawn uniformly without
              replacement with ``random.Random(seed)`` among the turns the teacher would
              score: the matched-budget control

``feedback``, ``gap`` and ``random`` are serl's extension (the paper's "when" question): the
authors reweight every turn with a block and let the teacher's disagreement size the change.

Choices the paper leaves open, written down here:

- ``gap`` selects ``round_half_up(rho * n_scored)`` turns (so 2.5 -> 3, not Python's
  banker's 2), at least 1 when ``rho > 0`` and any turn is scored; ties in |log-ratio|
  go to the earlier turn. A NaN score counts as no score.
- ``random``'s budget is counted on scored turns: a turn ``feedback`` selects is scored
  only if it is ``scorable`` (it has a block and, where zero-advantage turns are skipped, a
  nonzero advantage), so ``random`` draws ``#(fired and scorable)`` turns among the
  scorable ones, and both arms give the teacher the same number of turns to reweight. The
  draw depends only on the seed and which turns are scorable.
- Only ``gap`` needs the teacher before selecting (``needs_teacher_before_selection``);
  for the others the caller selects first and lets the teacher score only turns in S.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeGuard

from serl_cli.errors import SerlError


@dataclass(frozen=True)
class TurnInfo:
    """One turn as a placement rule sees it."""

    key: Hashable  # identifies the turn: its annotation record's index, or (episode, turn)
    fired: bool  # a chosen feedback source produced evidence for this turn
    log_ratio_mean: float | None  # mean over action tokens of log pi_T - log pi_old; None: not scored
    has_block: bool = True  # the sources rendered a hindsight block for it
    scorable: bool = (
        True  # selected, the teacher would score it: a block (and a nonzero advantage where A = 0 is skipped)
    )


Rule = Callable[..., list[bool]]  # rule(turns, *, rho, seed) -> one bool per turn
PLACEMENTS: dict[str, Rule] = {}
_NEEDS_TEACHER: set[str] = set()


def placement(name: str, *, needs_teacher: bool = False) -> Callable[[Rule], Rule]:
    """Register a rule under ``name``; ``needs_teacher``: it reads every turn's teacher score."""

    def wrap(fn: Rule) -> Rule:
        PLACEMENTS[name] = fn
        if needs_teacher:
            _NEEDS_TEACHER.add(name)
        return fn

    return wrap


def placement_names() -> list[str]:
    return sorted(PLACEMENTS)


def check_rule(name: str, *, rho: float | None = None) -> None:
    """Refuse an unknown rule (one line naming the known ones) and, if given, a rho outside [0, 1]."""
    if name not in PLACEMENTS:
        raise SerlError(f"unknown placement rule {name!r}: choose one of {', '.join(placement_names())}")
    if rho is not None and not (isinstance(rho, (int, float)) and 0.0 <= rho <= 1.0):
        raise SerlError(f"placement rho must be a fraction in [0, 1], got {rho!r}")


def _scored(x: float | None) -> TypeGuard[float]:
    return x is not None and not math.isnan(x)


def gap_count(n_scored: int, rho: float) -> int:
    """How many turns ``gap`` picks among ``n_scored`` scored turns."""
    if rho <= 0 or n_scored == 0:
        return 0
    # round half up; round(..., 9) first so that e.g. 0.35 * 10 = 3.4999999999999996 counts as 3.5
    k = math.floor(round(rho * n_scored, 9) + 0.5)
    return min(n_scored, max(1, k))


@placement("feedback")
def _feedback(turns: list[TurnInfo], *, rho: float, seed: int) -> list[bool]:
    return [bool(t.fired) for t in turns]


@placement("gap", needs_teacher=True)
def _gap(turns: list[TurnInfo], *, rho: float, seed: int) -> list[bool]:
    scores = {i: t.log_ratio_mean for i, t in enumerate(turns) if _scored(t.log_ratio_mean)}
    ranked = sorted(scores, key=lambda i: (-abs(scores[i]), i))
    chosen = set(ranked[: gap_count(len(scores), rho)])
    return [i in chosen for i in range(len(turns))]


@placement("all")
def _all(turns: list[TurnInfo], *, rho: float, seed: int) -> list[bool]:
    return [bool(t.has_block) for t in turns]


@placement("random")
def _random(turns: list[TurnInfo], *, rho: float, seed: int) -> list[bool]:
    pool = [i for i, t in enumerate(turns) if t.scorable]
    k = sum(1 for t in turns if t.fired and t.scorable)  # what `feedback` gets scored
    chosen = set(random.Random(seed).sample(pool, k))
    return [i in chosen for i in range(len(turns))]


def select(rule: str, turns: list[TurnInfo], *, rho: float = 0.25, seed: int = 0) -> list[bool]:
    """The critical set S under ``rule``: one bool per turn, in the order of ``turns``."""
    check_rule(rule, rho=rho)
    return PLACEMENTS[rule](list(turns), rho=float(rho), seed=seed)


def needs_teacher_before_selection(rule: str) -> bool:
    """True when the rule reads every turn's teacher score (``gap``); the others select first."""
    check_rule(rule)
    return rule in _NEEDS_TEACHER
