"""Feedback sources and the hindsight block (METHOD.md sections 3-4). Pure functions over
rollout records (``serl_cli.artifacts.schema``); no model.

Sources (``SOURCES``, one small class each; ``render`` gives a labelled section or None,
``fires`` says whether the evidence counts for placement ``feedback``):

    error   the environment's answer when it flags a problem; fires when present
    diff    what changed ("no change" included); fires only on "no change"
    obs     the next observation; never fires: it is shown whatever happened, so alone it
            says nothing about whether this turn went wrong
    future  this rollout from turn t to its end (``turn k: action -> effect``) and its
            outcome; never fires (the outcome is the reward's business, not placement's)
    ref     a reference trajectory: the successful sibling with the lowest rollout_index,
            else the expert (``ref_mode="expert"``: always the expert); None for a rollout
            that succeeded. Rendered from the reference's last visit of this turn's state
            (its last visit: earlier ones came back here, so their actions did not lead on);
            where it never visits the state, from the same turn index, or in full when it
            is shorter. Fires when its action at the matching point (the state visit, else
            the same index; none when shown in full) differs from the action taken.

Actions compare case- and whitespace-insensitively. Turns are shown 1-based, as the
student prompt numbers them. Each section's body is cut to the per-source budget
(``TurnContext.cut``); labels are not cut, so outcomes written there survive.

The ``anchor`` granularity's pooled block lives in ``serl_cli.method.anchors``.

Spec strings: ``,`` combines (every part gets its own section), ``|`` falls back (the
first alternative that renders): ``"ref|error,diff"`` -> ``[["ref", "error"], ["diff"]]``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable

from envs.base import state_key as hash_observation
from serl_cli.errors import SerlError

REF_MODES = ("group", "expert")
STEP_HEADER = "[Hindsight: what the environment revealed about this step]"
TAIL_CHARS = 16  # a cut drops a partial word up to max(20 % of the text, this many characters)
EFFECT_CHARS = 100  # one line of `future`/`ref`/pooled evidence: a glimpse, the budget cuts the rest


def _norm(action: str | None) -> str:
    """Actions compare case- and whitespace-insensitively: ``Click[B1]`` is ``click[b1]``."""
    return " ".join((action or "").lower().split())


def _same(a: str | None, b: str | None) -> bool:
    return _norm(a) == _norm(b)


def _trim(head: str, full: str) -> str:
    """``head`` (a prefix of ``full``) ended cleanly: no partial word, then " ..."."""
    head = head.rstrip("\ufffd")  # a split UTF-8 character decodes to U+FFFD: drop it
    if not full[len(head):len(head) + 1].isspace():  # the cut fell inside a word
        space = max(head.rfind(" "), head.rfind("\n"))
        if space >= 0 and len(head) - space <= max(0.2 * len(head), TAIL_CHARS):
            head = head[:space]  # drop the partial word; a long unbroken run (a URL, an id) stays cut
    return head.rstrip() + " ..."


def char_cutter(max_chars: int) -> Callable[[str], str]:
    """Cut to at most ``max_chars`` characters, cleanly (for tests and tokenizer-less use)."""
    def cut(text: str) -> str:
        if len(text) <= max_chars:
            return text
        return _trim(text[:max_chars - 4], text) if max_chars >= 4 else ""  # room for " ..." or nothing
    return cut


def make_cutter(tokenizer, max_tokens: int) -> Callable[[str], str]:
    """Cut to at most ``max_tokens`` tokens of ``tokenizer``, cleanly; short texts unchanged."""
    def cut(text: str) -> str:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= max_tokens:
            return text
        n = max_tokens - len(tokenizer.encode(" ...", add_special_tokens=False))
        while n > 0:  # re-encoding a cut text may merge differently: shrink until it fits
            out = _trim(tokenizer.decode(ids[:n]), text)
            if len(tokenizer.encode(out, add_special_tokens=False)) <= max_tokens:
                return out
            n -= 1
        return ""  # the budget cannot hold even the marker
    return cut


@dataclass
class TurnContext:
    episode: dict  # the rollout record
    turn: int  # index into episode["turns"]
    group: list[dict] = field(default_factory=list)  # episodes of this (task_id, group_id), this one included
    expert: list[dict] | None = None  # the expert's steps {"observation", "action"[, "state_key"]} from the start
    cut: Callable[[str], str] = lambda text: text  # per-source budget
    ref_mode: str = "group"  # group: a successful sibling, else the expert | expert: always the expert

    def __post_init__(self):
        if self.ref_mode not in REF_MODES:
            raise SerlError(f"unknown ref_mode {self.ref_mode!r}: choose one of {', '.join(REF_MODES)}")
        self.group = self.group or [self.episode]

    @property
    def step(self) -> dict:
        return self.episode["turns"][self.turn]


def _action(turn: dict) -> str:
    return turn.get("action") or turn.get("action_text") or ""


def _short(text: str) -> str:
    return char_cutter(EFFECT_CHARS)(text)


def _effect(turn: dict) -> str:
    fb = turn.get("feedback") or {}
    return _short(f"error: {fb['error']}" if fb.get("error") else fb.get("diff") or "")


def _lines(steps: list[tuple[int, str, str]]) -> str:
    """``turn k: action -> effect`` lines, k 1-based as in the student prompt."""
    return "\n".join(f"  turn {k + 1}: {_short(a)}" + (f" -> {e}" if e else "") for k, a, e in steps)


class Source(abc.ABC):
    """``render``: a labelled section, or None (nothing to say); ``fires``: counts for placement."""

    name = ""

    @abc.abstractmethod
    def render(self, ctx: TurnContext) -> str | None: ...

    def fires(self, ctx: TurnContext) -> bool:
        return False


SOURCES: dict[str, Source] = {}


def register(cls):
    SOURCES[cls.name] = cls()
    return cls


class TurnField(Source):
    """A source read off one turn: ``value`` its text, ``bad`` whether it flags the action.
    At anchor granularity it is pooled over the other turns of the anchor state."""

    label = pooled_label = ""

    @abc.abstractmethod
    def value(self, turn: dict) -> str | None: ...

    def bad(self, turn: dict) -> bool:
        return False

    def render(self, ctx):
        v = self.value(ctx.step)
        return f"{self.label}: {ctx.cut(v)}" if v else None

    def fires(self, ctx):
        return self.bad(ctx.step)


@register
class Error(TurnField):
    name, label, pooled_label = "error", "Environment error", "Errors other attempts got here"

    def value(self, turn):
        return (turn.get("feedback") or {}).get("error")

    def bad(self, turn):
        return bool(self.value(turn))


@register
class Diff(TurnField):
    name, label, pooled_label = "diff", "What changed", "What other attempts changed here"

    def value(self, turn):
        return (turn.get("feedback") or {}).get("diff")

    def bad(self, turn):
        return _same(self.value(turn), "no change")


@register
class Obs(TurnField):  # never fires: shown whatever happened, it flags nothing by itself
    name, label, pooled_label = "obs", "Next observation", "What other attempts saw next"

    def value(self, turn):
        return turn.get("next_observation")


@register
class Future(Source):
    name = "future"

    def render(self, ctx):
        ep = ctx.episode
        outcome = f"{'succeeded' if ep.get('success') else 'failed'}, reward {float(ep.get('reward', 0)):.2f}"
        steps = [(k, _action(t), _effect(t)) for k, t in enumerate(ep["turns"]) if k >= ctx.turn]
        return f"What happened next (this attempt {outcome}):\n" + ctx.cut(_lines(steps))


def _ref_point(ctx: TurnContext):
    """(title, steps, start, matching index or None), or None when there is no reference.
    ``steps``: (action, state_key, effect) of the reference, from its start."""
    if ctx.episode.get("success"):
        return None  # a rollout that succeeded gets no ref (METHOD.md 3)
    wins = [e for e in ctx.group if e.get("success") and e is not ctx.episode]
    if ctx.ref_mode == "group" and wins:
        best = min(wins, key=lambda e: e.get("rollout_index", 0))
        who = f"A successful attempt (rollout {best.get('rollout_index', 0)})"
        steps = [(_action(t), t.get("state_key"), _effect(t)) for t in best["turns"]]
    elif ctx.expert:
        who = "The expert's demonstration"
        steps = [(s["action"], s.get("state_key") or hash_observation(s["observation"]), "") for s in ctx.expert]
    else:
        return None
    visits = [j for j, s in enumerate(steps) if s[1] == ctx.step.get("state_key")]
    if visits:
        return f"{who}, from this same state on", steps, visits[-1], visits[-1]
    if ctx.turn < len(steps):
        return f"{who}, from its turn {ctx.turn + 1} on (it never saw this state)", steps, ctx.turn, ctx.turn
    return f"{who}, in full (it never saw this state)", steps, 0, None


@register
class Ref(Source):
    name = "ref"

    def render(self, ctx):
        point = _ref_point(ctx)
        if point is None:
            return None
        title, steps, start, _ = point
        return f"{title}:\n" + ctx.cut(_lines([(j, a, e) for j, (a, _, e) in enumerate(steps) if j >= start]))

    def fires(self, ctx):
        point = _ref_point(ctx)
        return point is not None and point[3] is not None and not _same(point[1][point[3]][0], _action(ctx.step))


def parse_sources(spec: str) -> list[list[str]]:
    """``"error,ref"`` -> [["error"], ["ref"]]; ``"ref|error"`` -> [["ref", "error"]]."""
    known = f"known sources: {', '.join(SOURCES)}"
    if not spec or not spec.strip():
        raise SerlError(f"no feedback sources given: name one or more, joined by ',' (combine) or '|' (fall back);"
                        f" {known}")
    out, seen = [], set()
    for part in spec.split(","):
        alts = [a.strip() for a in part.split("|")]
        for a in alts:
            if not a:
                raise SerlError(f"empty source name in {spec!r}: ',' and '|' must sit between names; {known}")
            if a not in SOURCES:
                raise SerlError(f"unknown feedback source {a!r} in {spec!r}; {known}")
            if a in seen:
                raise SerlError(f"feedback source {a!r} is named twice in {spec!r}")
            seen.add(a)
        out.append(alts)
    return out


def _spec(spec) -> list[list[str]]:
    return parse_sources(spec) if isinstance(spec, str) else spec


def _block(header: str, pieces: list[str], used: list[str], fired: list[str]):
    return ("\n".join([header, *pieces]) if pieces else None), used, fired


def hindsight_step(ctx: TurnContext, spec) -> tuple[str | None, list[str], list[str]]:
    """(block, sources used, sources fired): per combined part, the first alternative that renders."""
    pieces, used, fired = [], [], []
    for alts in _spec(spec):
        for name in alts:
            text = SOURCES[name].render(ctx)
            if text:
                pieces.append(text)
                used.append(name)
                if SOURCES[name].fires(ctx):
                    fired.append(name)
                break
    return _block(STEP_HEADER, pieces, used, fired)
