"""Anchor granularity (METHOD.md 4): turns of one group that share a state pool their evidence.

Anchor states are turns of different rollouts of one task in one group whose raw
observation is the same (same ``state_key``) or, with a similarity threshold, whose
observations' word-set Jaccard similarity reaches it (groups made transitive with
union-find). A turn's hindsight block then pools what the other turns in its anchor state
did and what that led to, and what the successful rollouts did from there. The block is
laid out as at step granularity: titled sections, a blank line between them.
"""

from __future__ import annotations

from serl_cli.artifacts.records import Episode, Turn
from serl_cli.errors import SerlError
from serl_cli.method.feedback import (
    SOURCES,
    TurnContext,
    TurnField,
    _action,
    _block,
    _norm,
    _short,
    _spec,
    expert_steps,
    hindsight_step,
    same_action,
    section,
)


def anchor_groups(group: list[Episode], similarity: float | None = None) -> dict[tuple[int, int], int]:
    """Anchor id of every turn ``(position in group, turn index)``; singletons get their own id.

    Same ``state_key`` (the same raw observation) -> same anchor, whichever rollouts the turns
    are in (a rollout revisiting a state joins it too). With ``similarity`` in (0, 1], also
    observations whose token-set Jaccard similarity (lower-cased, whitespace-split) is at
    least that; groups are closed transitively (union-find). Ids: 0, 1, ... by first turn.
    """
    if len({e.group_key for e in group}) > 1:
        raise ValueError("anchor_groups: the episodes must share one (task_id, group_id)")
    if similarity is not None and not 0 < similarity <= 1:
        raise SerlError(f"anchor similarity must lie in (0, 1], got {similarity}")
    keys = [(p, t) for p, e in enumerate(group) for t in range(len(e.turns))]
    parent = {k: k for k in keys}

    def find(k: tuple[int, int]) -> tuple[int, int]:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def union(a: tuple[int, int], b: tuple[int, int]) -> None:
        ra, rb = find(a), find(b)
        parent[max(ra, rb)] = min(ra, rb)

    first: dict[str, tuple[int, int]] = {}  # one representative turn per distinct state
    for p, t in keys:
        sk = group[p].turns[t].state_key
        union((p, t), first.setdefault(sk, (p, t)))
    if similarity is not None:
        reps = list(first.values())
        words = [set(group[p].turns[t].observation.lower().split()) for p, t in reps]
        for i in range(len(reps)):
            for j in range(i + 1, len(reps)):
                both = words[i] | words[j]
                if both and len(words[i] & words[j]) / len(both) >= similarity:
                    union(reps[i], reps[j])
    ids: dict[tuple[int, int], int] = {}
    return {k: ids.setdefault(find(k), len(ids)) for k in keys}


def _pool_field(src: TurnField, ctx: TurnContext, others: list[Turn]) -> tuple[str | None, bool]:
    """The other turns' values of ``src``, one line per distinct action (first value, count)."""
    lines: dict[str, list] = {}
    for turn in others:
        v = src.value(turn)
        if v:
            lines.setdefault(_norm(_action(turn)), [_action(turn), v, 0])[2] += 1
    if not lines:
        return None, False
    body = "\n".join(f"{_short(a)} ({n} attempt{'s' * (n > 1)}): {_short(v)}" for a, v, n in lines.values())
    fired = any(same_action(_action(t), _action(ctx.step)) and src.bad(t) for t in others)
    return section(src.pooled_title, body), fired


def _pool_ref(ctx: TurnContext, members: list[tuple[int, int]]) -> tuple[str | None, bool]:
    """What the group's other successful rollouts did here (each one's last visit), by rollout index."""
    last: dict[int, int] = {}
    for p, t in members:
        if ctx.group[p].success and ctx.group[p] is not ctx.episode:
            last[p] = max(t, last.get(p, t))
    order = sorted(last, key=lambda p: ctx.group[p].rollout_index)
    by_action: dict[str, list] = {}
    for p in order:
        a = _action(ctx.group[p].turns[last[p]])
        by_action.setdefault(_norm(a), [a, []])[1].append(f"rollout {ctx.group[p].rollout_index}")
    if not by_action:
        return None, False
    body = "\n".join(f"{_short(a)} ({', '.join(who)})" for a, who in by_action.values())
    fired = any(not same_action(a, _action(ctx.step)) for a, _ in by_action.values())
    return section("What successful attempts did from this state:", body), fired


def _pool_expert(ctx: TurnContext, members: list[tuple[int, int]]) -> tuple[str | None, bool]:
    """The expert's action from this anchor state (its last visit): privileged oracle information."""
    keys = {ctx.group[p].turns[t].state_key for p, t in members}
    here = [a for a, key in expert_steps(ctx) if key in keys]
    if not here:
        return None, False
    return (
        section("The expert's action from this state (privileged oracle information):", _short(here[-1])),
        not same_action(here[-1], _action(ctx.step)),
    )


def hindsight_anchor(
    ctx: TurnContext, spec: str | list[list[str]], anchors: dict[tuple[int, int], int]
) -> tuple[str | None, list[str], list[str]]:
    """(block, used, fired) pooling the anchor state's evidence; a singleton falls back to step.

    Pooled, per source named in the spec (fallback chains as in step), one titled section
    each, laid out as the step block (``method.feedback``): ``error``/``diff``/``obs``: the
    OTHER turns of this anchor state, one line per distinct action with its first value and
    how many attempts took it; fires when another turn took this turn's action and got an
    error (``error``) or "no change" (``diff``). ``ref``: the actions the group's other
    successful rollouts took here (their last visit), never the expert's; fires when one
    differs from this action. ``expert``: the expert's action here (privileged oracle
    information); fires when it differs. Sources with nothing to pool (``future``) render as
    at step granularity. This turn's own error/diff/obs are not shown: the block speaks for
    the state, not the attempt (use step granularity for that). Other turns with nothing to
    say give no block (None). The pooled layout is serl's own: the authors' ``anchor_*`` modes
    (PC:713-840) list every action tried with its success count and returns instead.
    """
    pos = next((p for p, e in enumerate(ctx.group) if e is ctx.episode), None)
    if pos is None:
        raise ValueError("hindsight_anchor: the episode is not in ctx.group")
    aid = anchors[(pos, ctx.turn)]
    members = [k for k, a in anchors.items() if a == aid]
    if len(members) == 1:
        return hindsight_step(ctx, spec)
    others = [ctx.group[p].turns[t] for p, t in members if (p, t) != (pos, ctx.turn)]
    pieces, used, fired = [], [], []
    for alts in _spec(spec):
        for name in alts:
            src = SOURCES[name]
            if isinstance(src, TurnField):
                text, fire = _pool_field(src, ctx, others)
            elif name == "ref":
                text, fire = _pool_ref(ctx, members)
            elif name == "expert":
                text, fire = _pool_expert(ctx, members)
            else:
                text = src.render(ctx)
                fire = bool(text) and src.fires(ctx)
            if text:
                pieces.append(text)
                used.append(name)
                fired += [name] if fire else []
                break
    return _block(pieces, used, fired)
