"""Feedback sources and the hindsight block (METHOD.md sections 3-4). Pure functions over
rollout records (``serl_cli.artifacts.records``); no model.

The block follows the layout of the authors' default teacher prompt (github.com/OliverLeeXZ/SERL
at 5a2a85b, ``recipe/serl/privileged_context.py``, "PC" below): every source renders one
named section, its title on one line and its stripped text below (PC:161-171, PC:442-446),
and the block is the sections joined by a blank line (PC:449-452). ``method.teacher`` wraps
the block in the authors' template, closing instruction included, and splices it into the
student prompt as tokens.

Sources (``SOURCES``, one small class each; ``render`` gives the section or None, ``fires``
says whether the evidence counts for placement ``feedback``, serl's turn-selection axis):

    obs     "Immediate feedback from the current step:" and the environment's raw answer to
            the action (the next raw observation) -- the authors' default mode
            ``immediate_feedback`` (PC:1634-1637, PC:1679-1682; the raw answer:
            agent_system/multi_turn_rollout/rollout_loop.py:110-136). Never fires: it is
            shown whatever happened, so alone it says nothing about whether the turn went wrong.
    error   serl's: the raw answer only where it flags a problem (invalid action, a button
            that does not exist, "Nothing happens."). Fires when present.
    diff    serl's: what changed on screen, "no change" included. Fires only on "no change".
    future  "Observed future trajectory of the current step:" and the turns AFTER turn t of
            this rollout, each ``Step k`` / ``Response:`` / the reply with its reasoning
            removed (PC:384-404, PC:407-426): never turn t's own reply, and no outcome line.
            Nothing at the last turn. Never fires.
    ref     "Successful trajectory in the same task, if any:" and the whole trajectory of the
            first successful rollout of the group by rollout index other than this rollout
            (``dont_reprompt_on_self_success``: PC:633-659, recipe/serl/config/serl_trainer.yaml:58),
            in the same step format; nothing when no other rollout of the group succeeded.
            Never the expert. Fires when its action at the matching point (its last visit of
            this turn's state, else the same turn index) differs from the action taken.
    expert  the environment's expert demonstration for the task, labelled as privileged
            oracle information: the paper never uses it. Same step format; fires as ``ref``.
    shuffled  serl's: the ``expert`` block naming random other moves -- its control (below).

Trajectory rendering (``TurnContext.trajectory``, ``annotate.trajectory``) for ``ref`` and
``expert`` (``shuffled`` as ``expert``): ``full`` (above) shows the whole trajectory as "Step k"
lines, which a prompt without history or step index cannot align with "now". ``aligned`` shows
only what applies to this very state, as the authors' prompt does by saying "you are now at step N":

    ref     "What a successful rollout did from this state:" and the reference rollout's
            reply at its last visit of this turn's state; nothing when it never visited it
            (no fallback to the same turn index: that would be another state). Fires when
            that action differs from the action taken.
    expert  "The expert's action from this state (privileged oracle information):" and the
            expert's action from this turn's state (the turn record's ``expert_action``: on
            Sokoban the solver's move); nothing where there is none (a lost task). Fires when
            it differs from the action taken. Still privileged oracle information.

``shuffled`` is the oracle's control: does what the block says matter, or only that there is one?
Its block is the ``expert`` block, title and layout the same, on the same turns (nothing where the
expert has nothing), but each move it names is drawn uniformly among the moves other than the
expert's (``SHUFFLED_MOVES``: Sokoban's four). The draw is a hash of the annotate seed and the turn's
ids (task, group, rollout, turn; in the full rendering the rollout and the step instead of the turn,
so the trajectory is the same at every turn, as the expert's is), so one run gives the same blocks on
every machine and in every process. It fires as ``expert`` does, on the moves it names. The title
still says oracle: a teacher told otherwise would read another block. At anchor granularity it is
not pooled: each turn gets its own block, as at step granularity.

Choices written down here: steps are numbered from 1, as serl's student prompt numbers its
turns (the authors number env steps from 0, rollout_loop.py:502); reasoning is removed with
the authors' ``<think>...</think>`` rule (recipe/serl/serl_ray_trainer.py:186-188). Actions
compare case- and whitespace-insensitively. Blocks are not cut here: the annotation cuts the
whole block to ``max_hindsight_tokens`` (the authors cap the whole teacher prompt,
``max_reprompt_len``, serl_ray_trainer.py:562) with the cutters of ``serl_cli.method.cutting``
(``make_cutter``, ``cut_all``, ``char_cutter``: re-exported here, where their callers import them).

The ``anchor`` granularity's pooled block lives in ``serl_cli.method.anchors``.

Spec strings: ``,`` combines (every part that renders gets its own section), ``|`` falls
back (the first alternative that renders): ``"ref|obs"`` is the authors'
``successful_sample_or_immediate_feedback`` (PC:1689-1695).
"""

from __future__ import annotations

import abc
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from envs.base import state_key as hash_observation
from envs.sokoban.rooms import DIRECTIONS
from serl_cli.artifacts.records import Episode, Turn
from serl_cli.errors import SerlError

# re-exported: the cutters' callers import them from here
from serl_cli.method.cutting import TAIL_CHARS as TAIL_CHARS
from serl_cli.method.cutting import char_cutter
from serl_cli.method.cutting import cut_all as cut_all
from serl_cli.method.cutting import make_cutter as make_cutter
from serl_cli.rollout.prompts import format_action

EFFECT_CHARS = 100  # one line of pooled anchor evidence: a glimpse
TRAJECTORIES = ("full", "aligned")  # how ref, expert, shuffled render: the whole trajectory | this state's action
SECTION_SEPARATOR = "\n\n"  # between sections (PC:452)
THINK_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)  # reasoning, removed from shown replies
# the moves ``shuffled`` draws from: a turn record does not keep the admissible actions, so the source
# knows one environment's fixed set, Sokoban's, where every move is admissible in every state
SHUFFLED_MOVES = DIRECTIONS


def _norm(action: str | None) -> str:
    """Actions compare case- and whitespace-insensitively: ``Click[B1]`` is ``click[b1]``."""
    return " ".join((action or "").lower().split())


def same_action(a: str | None, b: str | None) -> bool:
    """Whether two actions are the same action (case and whitespace ignored)."""
    return _norm(a) == _norm(b)


@dataclass
class TurnContext:
    episode: Episode  # the rollout record
    turn: int  # index into episode.turns
    group: list[Episode] = field(default_factory=list)  # episodes of this (task_id, group_id), this one included
    expert: list[dict] | None = None  # the expert's steps {"observation", "action"[, "state_key"]} from the start
    trajectory: str = "full"  # ref, expert and shuffled: full | aligned (TRAJECTORIES)
    seed: int = 0  # the annotate seed: shuffled's draws

    def __post_init__(self) -> None:
        self.group = self.group or [self.episode]

    @property
    def aligned(self) -> bool:
        return self.trajectory == "aligned"

    @property
    def step(self) -> Turn:
        return self.episode.turns[self.turn]


def _action(turn: Turn) -> str:
    return turn.action or turn.action_text or ""


def _reply(turn: Turn) -> str:
    """What the policy wrote, reasoning removed (the authors' ``remove_thinking_from_demonstration``)."""
    return THINK_RE.sub("", turn.action_text or format_action(_action(turn))).strip()


def _short(text: str) -> str:
    return char_cutter(EFFECT_CHARS)(text)


def section(title: str, body: str | None) -> str | None:
    """``title`` over the stripped ``body``; None when the body is empty (PC:442-446)."""
    body = (body or "").strip()
    return f"{title}\n{body}" if body else None


def trajectory_text(replies: list[tuple[int, str]]) -> str:
    """``Step k`` / ``Response:`` / reply per step (k 1-based), a blank line between steps (PC:384-404)."""
    return SECTION_SEPARATOR.join(f"Step {k + 1}\nResponse:\n{r}" for k, r in replies)


class Source(abc.ABC):
    """``render``: a titled section, or None (nothing to say); ``fires``: counts for placement."""

    name = ""

    @abc.abstractmethod
    def render(self, ctx: TurnContext) -> str | None: ...

    def fires(self, ctx: TurnContext) -> bool:
        return False


SOURCES: dict[str, Source] = {}
SourceClass = TypeVar("SourceClass", bound=type[Source])


def register(cls: SourceClass) -> SourceClass:
    SOURCES[cls.name] = cls()
    return cls


class TurnField(Source):
    """A source read off one turn: ``value`` its text, ``bad`` whether it flags the action.
    At anchor granularity it is pooled over the other turns of the anchor state."""

    title = pooled_title = ""

    @abc.abstractmethod
    def value(self, turn: Turn) -> str | None: ...

    def bad(self, turn: Turn) -> bool:
        return False

    def render(self, ctx: TurnContext) -> str | None:
        return section(self.title, self.value(ctx.step))

    def fires(self, ctx: TurnContext) -> bool:
        return self.bad(ctx.step)


@register
class Error(TurnField):
    name, title, pooled_title = "error", "Environment error at the current step:", "Errors other attempts got here:"

    def value(self, turn: Turn) -> str | None:
        return turn.feedback.get("error")

    def bad(self, turn: Turn) -> bool:
        return bool(self.value(turn))


@register
class Diff(TurnField):
    name, title, pooled_title = "diff", "What changed after the current step:", "What other attempts changed here:"

    def value(self, turn: Turn) -> str | None:
        return turn.feedback.get("diff")

    def bad(self, turn: Turn) -> bool:
        return same_action(self.value(turn), "no change")


@register
class Obs(TurnField):  # never fires: shown whatever happened, it flags nothing by itself
    # the authors' title for their default mode, immediate_feedback (PC:1634-1637)
    name, title, pooled_title = "obs", "Immediate feedback from the current step:", "What other attempts saw next:"

    def value(self, turn: Turn) -> str | None:
        return turn.next_observation


@register
class Future(Source):
    """The turns after turn t only, no outcome (PC:407-426): the teacher must not see turn t's
    own action (it would score the very tokens it is shown) nor the reward (the sign's business)."""

    name, title = "future", "Observed future trajectory of the current step:"  # PC:1642-1652

    def render(self, ctx: TurnContext) -> str | None:
        later = [(k, _reply(t)) for k, t in enumerate(ctx.episode.turns) if k > ctx.turn]
        return section(self.title, trajectory_text(later)) if later else None


def reference_rollout(ctx: TurnContext) -> Episode | None:
    """The first successful rollout of the group by rollout index, other than this one; None if none."""
    wins = [e for e in ctx.group if e.success and e is not ctx.episode]
    return min(wins, key=lambda e: e.rollout_index) if wins else None


def _matching_action(ctx: TurnContext, steps: Sequence[tuple[str, str | None]]) -> str | None:
    """The reference's action at this turn's state (its last visit: earlier ones came back
    here, so their actions did not lead on), else -- in the full rendering only -- at the
    same turn index, else None."""
    visits = [j for j, (_, key) in enumerate(steps) if key == ctx.step.state_key]
    if visits:
        return steps[visits[-1]][0]
    return steps[ctx.turn][0] if ctx.turn < len(steps) and not ctx.aligned else None


def _disagrees(ctx: TurnContext, steps: Sequence[tuple[str, str | None]]) -> bool:
    other = _matching_action(ctx, steps)
    return other is not None and not same_action(other, _action(ctx.step))


@register
class Ref(Source):
    name, title = "ref", "Successful trajectory in the same task, if any:"  # PC:1630-1633
    aligned_title = "What a successful rollout did from this state:"

    def render(self, ctx: TurnContext) -> str | None:
        ref = reference_rollout(ctx)
        if ref is None:
            return None
        if ctx.aligned:  # its reply at its last visit of this state, nothing if it never came here
            replies = [(_reply(t), t.state_key) for t in ref.turns]
            return section(self.aligned_title, _matching_action(ctx, replies))
        return section(self.title, trajectory_text([(k, _reply(t)) for k, t in enumerate(ref.turns)]))

    def fires(self, ctx: TurnContext) -> bool:
        ref = reference_rollout(ctx)
        return ref is not None and _disagrees(ctx, [(_action(t), t.state_key) for t in ref.turns])


def expert_steps(ctx: TurnContext) -> list[tuple[str, str]]:
    """(action, state key) of the expert's demonstration from the start; a key is computed
    from the observation where the record has none."""
    return [(s["action"], s.get("state_key") or hash_observation(s["observation"])) for s in ctx.expert or []]


@register
class Expert(Source):
    """Privileged oracle information the paper never uses: a separate source, never a fallback of ``ref``."""

    name, title = "expert", "Expert demonstration for this task (privileged oracle information):"
    aligned_title = "The expert's action from this state (privileged oracle information):"

    def render(self, ctx: TurnContext) -> str | None:
        if ctx.aligned:
            move = ctx.step.expert_action
            return section(self.aligned_title, format_action(move)) if move else None
        if not ctx.expert:
            return None
        return section(self.title, trajectory_text([(k, format_action(s["action"])) for k, s in enumerate(ctx.expert)]))

    def fires(self, ctx: TurnContext) -> bool:
        if ctx.aligned:
            move = ctx.step.expert_action
            return bool(move) and not same_action(move, _action(ctx.step))
        return bool(ctx.expert) and _disagrees(ctx, expert_steps(ctx))


def other_move(expert_move: str, key: Sequence[object]) -> str:
    """A move of ``SHUFFLED_MOVES`` other than ``expert_move``, uniform over them, drawn from a hash of
    ``key``: the same on every machine and in every process (Python's ``hash`` of a string is salted per
    process, and a shared random stream would depend on the order turns are rendered in)."""
    others = [m for m in SHUFFLED_MOVES if not same_action(m, expert_move)]
    if len(others) == len(SHUFFLED_MOVES):
        raise SerlError(
            f"the shuffled source draws among {', '.join(SHUFFLED_MOVES)} (Sokoban's moves), and the expert's "
            f"action {expert_move!r} is none of them: use it on --env sokoban"
        )
    digest = hashlib.sha256(":".join(str(k) for k in key).encode()).digest()
    return others[int.from_bytes(digest[:8], "big") % len(others)]


def shuffled_move(ctx: TurnContext) -> str | None:
    """The move the aligned ``shuffled`` block names at this turn; None where the expert has no action."""
    move = ctx.step.expert_action
    if not move:
        return None
    ep = ctx.episode
    return other_move(move, ("shuffled", ctx.seed, ep.task_id, ep.group_id, ep.rollout_index, ctx.turn))


def shuffled_steps(ctx: TurnContext) -> list[tuple[str, str]]:
    """The expert's demonstration (:func:`expert_steps`) with every move replaced by another: drawn per
    rollout, not per turn, so that, like the expert's, the block is the same at every turn of a rollout."""
    ep = ctx.episode
    ids = ("shuffled", ctx.seed, ep.task_id, ep.group_id, ep.rollout_index)
    return [(other_move(action, (*ids, "step", k)), key) for k, (action, key) in enumerate(expert_steps(ctx))]


@register
class Shuffled(Source):
    """The oracle's block naming random moves other than the expert's: the control that asks whether
    the information in the block matters. Rendered and fired as ``expert`` is."""

    name = "shuffled"

    def render(self, ctx: TurnContext) -> str | None:
        if ctx.aligned:
            move = shuffled_move(ctx)
            return section(Expert.aligned_title, format_action(move)) if move else None
        if not ctx.expert:
            return None
        steps = [(k, format_action(action)) for k, (action, _) in enumerate(shuffled_steps(ctx))]
        return section(Expert.title, trajectory_text(steps))

    def fires(self, ctx: TurnContext) -> bool:
        if ctx.aligned:
            move = shuffled_move(ctx)
            return move is not None and not same_action(move, _action(ctx.step))
        return bool(ctx.expert) and _disagrees(ctx, shuffled_steps(ctx))


EXPERT_SOURCES = ("expert", "shuffled")  # the sources that read the environment's expert trajectory in full


def uses_expert_trajectory(spec: str | list[list[str]], trajectory: str) -> bool:
    """Whether the blocks need the environment's expert trajectories (``expert`` or ``shuffled``, rendered in
    full)."""
    return trajectory == "full" and any(name in EXPERT_SOURCES for alts in _spec(spec) for name in alts)


def parse_sources(spec: str) -> list[list[str]]:
    """``"error,ref"`` -> [["error"], ["ref"]]; ``"ref|error"`` -> [["ref", "error"]]."""
    known = f"known sources: {', '.join(SOURCES)}"
    if not spec or not spec.strip():
        raise SerlError(
            f"no feedback sources given: name one or more, joined by ',' (combine) or '|' (fall back); {known}"
        )
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


def _spec(spec: str | list[list[str]]) -> list[list[str]]:
    return parse_sources(spec) if isinstance(spec, str) else spec


def _block(sections: list[str], used: list[str], fired: list[str]) -> tuple[str | None, list[str], list[str]]:
    return (SECTION_SEPARATOR.join(sections) if sections else None), used, fired


def hindsight_step(ctx: TurnContext, spec: str | list[list[str]]) -> tuple[str | None, list[str], list[str]]:
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
    return _block(pieces, used, fired)
