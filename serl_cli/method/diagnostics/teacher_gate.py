"""The teacher-signal gate: does the teacher read its block, on states it was never trained on?

Before a study spends hours on SERL with a given teacher, check on held-out states that the
block moves the teacher the way the method needs (issue 29; docs/studies/sokoban_v4.md). The
states are a panel of the warm start's own rollouts (its turns, sampled as the online loop
samples them), annotated as an online iteration annotates them, every turn with a block
scored whatever its advantage; a turn whose state appears in the warm start's SFT data
(``seen``) is left out. Per block kind (a name and an :class:`AnnotateConfig`):

* the teacher signal (``method.teacher_signal``): ``right_direction`` (the teacher's log-ratio
  on the action taken has the sign that helps: below 0 off the expert's action, above 0 on it)
  and ``expert_prob_gain`` (pi_T(expert | prompt + block) - pi_T(expert | prompt)), with 95 %
  intervals over turns (Wilson; t) -- turns of one rollout are not independent, so the
  intervals are indicative -- and how many distinct states the turns cover.
  ``expert_logprob_change`` is the same change in log-probability (mean over turns, with a t interval).
* ``SOURCE_BLOCKS``: each feedback source alone (``error``, ``diff``, ``obs``, ``ref``) beside the aligned
  oracle and its shuffled control, for a model whose reading is the question (a real pretrained model with
  no reading SFT: docs/MODELS.md).
* ``GATE``: the thresholds the aligned oracle must meet (right direction >= 0.9, gain >= +0.3).
* the ``shuffled`` block (the oracle's block naming a random other move) is measured as the
  others, against the real expert move: a teacher that copies its block moves the wrong way on
  every turn but those whose action is neither the expert's nor the named move, so its right
  direction falls below one half and its gain below 0; a teacher blind to blocks stays near one half and 0.

The blind-copy check (:func:`blind_copy`): on turns whose state has a deadlocking move d, the
teacher is shown a block that names d as if it were good -- the aligned oracle's layout
("The expert's action from this state ...: d") and the aligned reference's ("What a successful
rollout did from this state: d") -- and, for contrast, the environment's own feedback on d
(``error,diff``: the deadlock it causes). Reported: the mean pi_T(d) without a block and with
each, so "follows" is how much of its probability the teacher moves to a deadlocking move a
block recommends. A teacher that only copies follows the false recommendations; one that
knows the game resists them; the ``error,diff`` block should lower pi_T(d).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from envs.base import ActionFormat
from serl_cli.artifacts.records import Episode
from serl_cli.method import feedback as fb
from serl_cli.method import teacher_signal as ts
from serl_cli.method.annotation import AnnotateConfig, annotate_episodes, teacher_prompts
from serl_cli.method.sft.reading import episode_at, named_context, played_turn, state_moves
from serl_cli.method.teacher import teacher_prompt
from serl_cli.stats.summary import t_interval, wilson_interval

GATE = {"right_direction": 0.9, "expert_prob_gain": 0.3}  # the aligned oracle's thresholds (issue 29)
MIN_STATES = 200  # held-out panel states the gate needs at least
# the three blocks of study v4's SERL arms: the aligned oracle and reference on every turn, the
# environment's feedback on the turns it flagged; and the oracle's control, its block naming a random
# other move (study v6): a teacher that reads moves the wrong way on it, one that ignores blocks does not
BLOCKS = {
    "expert (aligned)": {"sources": "expert", "trajectory": "aligned", "placement": "all"},
    "ref (aligned)": {"sources": "ref", "trajectory": "aligned", "placement": "all"},
    "error,diff (flagged turns)": {"sources": "error,diff", "placement": "feedback"},
    "shuffled (aligned)": {"sources": "shuffled", "trajectory": "aligned", "placement": "all"},
}
# each feedback source alone, for a model whose reading is the question (a real pretrained model, no reading
# SFT): on every turn where the source says something. ``ref`` exists only in a group with a success
SOURCE_BLOCKS = {
    "error": {"sources": "error", "placement": "all"},
    "diff": {"sources": "diff", "placement": "all"},
    "obs": {"sources": "obs", "placement": "all"},
    "ref (aligned)": BLOCKS["ref (aligned)"],
    "expert (aligned)": BLOCKS["expert (aligned)"],
    "shuffled (aligned)": BLOCKS["shuffled (aligned)"],
}
FALSE_BLOCKS = {  # the blind-copy check: a deadlocking move named as good, and its real feedback
    "expert names d": ("named", "expert"),
    "ref names d": ("named", "ref"),
    "error,diff of d": ("taken", "error,diff"),
}


def block_config(settings: dict, **extra: Any) -> AnnotateConfig:
    """An online annotation's settings for ``settings``, scoring every turn with a block (the gate's)."""
    return AnnotateConfig(skip_zero_advantage=False, teacher_signal=False, **settings, **extra)


def signal_of(
    episodes: list[Episode],
    cfg: AnnotateConfig,
    model: Any,
    tokenizer: Any,
    *,
    env_cfg: dict,
    seen: set[str],
    bare_replies: bool,
    action_format: ActionFormat | None,
    micro_batch_tokens: int = 16384,
) -> dict:
    """The teacher signal of blocks ``cfg`` over the held-out turns of ``episodes``, with intervals."""
    records, _ = annotate_episodes(episodes, cfg, model, tokenizer, env_cfg=env_cfg, bare_replies=bare_replies)
    turns = ts.signal_turns(records, episodes)
    prompts = teacher_prompts(records, [t.prompt_ids for e in episodes for t in e.turns], tokenizer, turns)
    how = ts.SpanScoring(model, tokenizer, 1.0, micro_batch_tokens, bare_replies, action_format)
    scored = ts.expert_logprobs(records, episodes, prompts, how)
    rows = ts.signal_rows(records, episodes, scored)
    key = {r["record"]: episodes[records[r["record"]].episode].turns[records[r["record"]].turn] for r in rows}
    held = [r for r in rows if key[r["record"]].state_key not in seen]
    return with_intervals(held, [key[r["record"]].state_key for r in held], len(rows))


def with_intervals(rows: list[dict], state_keys: list[str], scored_turns: int) -> dict:
    """:func:`serl_cli.method.teacher_signal.summarize` plus 95 % intervals and the states covered."""
    out = ts.summarize(rows) or {"turns": 0}
    out.update({"scored_turns": scored_turns, "held_out_turns": len(rows), "held_out_states": len(set(state_keys))})
    if rows:
        right = sum(r["right"] for r in rows)
        out["right_direction_ci95"] = wilson_interval(right, len(rows))
        out["expert_prob_gain_ci95"] = t_interval([r["p_with"] - r["p_without"] for r in rows])
        # the same change in log-probability: a model that puts little mass on the expert's reply (an untrained
        # one) moves it by orders of magnitude that its probability, near 0 either way, does not show
        changes = [log_change(r["p_with"], r["p_without"]) for r in rows]
        out["expert_logprob_change"] = sum(changes) / len(changes)
        out["expert_logprob_change_ci95"] = t_interval(changes)
    return out


def log_change(p_with: float, p_without: float) -> float:
    """log p_with - log p_without, each floored at the smallest positive double (an underflowed probability)."""
    tiny = 5e-324
    return math.log(max(p_with, tiny)) - math.log(max(p_without, tiny))


def gate_verdict(oracle: dict) -> dict:
    """Whether the aligned oracle's signal meets ``GATE`` on at least ``MIN_STATES`` states."""
    checks = {
        "held_out_states": oracle.get("held_out_states", 0) >= MIN_STATES,
        **{k: (oracle.get(k) is not None and oracle[k] >= v) for k, v in GATE.items()},
    }
    return {"met": all(checks.values()), "checks": checks, "thresholds": {**GATE, "held_out_states": MIN_STATES}}


def wrong_move_turns(
    episodes: list[Episode], world: Any, split: str, seen: set[str], seed: int = 0
) -> tuple[str, list[tuple[int, int, str]]]:
    """(what the wrong move is, [(episode, turn, wrong move)]) over the held-out turns with an expert action.
    Where the environment knows which moves lose the task (Sokoban's ``solvable_actions``) the wrong move is the
    state's first deadlocking one, and a state without one is left out; elsewhere (WebShop, ALFWorld: no
    deadlocks) it is drawn among the state's admissible actions other than the expert's, seeded."""
    import random

    rng = random.Random(seed)
    deadlocks = hasattr(world.new_episode(split), "solvable_actions")  # the environment knows losing moves
    out, kind = [], "deadlocking" if deadlocks else "admissible, not the expert's"
    for e, ep in enumerate(episodes):
        actions = [t.action for t in ep.turns]
        for t, turn in enumerate(ep.turns):
            if not turn.expert_action or turn.state_key in seen:
                continue
            if deadlocks:
                _, _, deadlocking = state_moves(episode_at(world, split, ep.task_id, actions[:t]), turn.expert_action)
                if deadlocking:
                    out.append((e, t, deadlocking[0]))
                continue
            others = [a for a in admissible_at(world, split, ep.task_id, actions[:t]) if a != turn.expert_action]
            if others:
                out.append((e, t, rng.choice(others)))
    return kind, out


def admissible_at(world: Any, split: str, task_id: int, actions: list[str]) -> list[str]:
    """The admissible actions of the state ``actions`` lead to from ``task_id``'s start, as its step says."""
    ep = world.new_episode(split)
    step = ep.reset(task_id)
    for a in actions:
        step = ep.step(a)
    return list(step.admissible_actions)


def false_block(
    episodes: list[Episode], e: int, t: int, move: str, kind: str, spec: str, world: Any, split: str, bare: bool
) -> str:
    """The block naming ``move`` at turn ``t`` of episode ``e``: as a good move (``named``), or the
    environment's own feedback on playing it (``taken``)."""
    ep = episodes[e]
    if kind == "named":
        ctx = named_context(ep, t, move, bare)
    else:
        step = episode_at(world, split, ep.task_id, [x.action for x in ep.turns[:t]]).step(move)
        turns = list(ep.turns)
        turns[t] = played_turn(ep.turns[t], step, move, bare)
        ctx = fb.TurnContext(episode=dataclasses.replace(ep, turns=turns), turn=t)
    block, _, _ = fb.hindsight_step(ctx, fb.parse_sources(spec))
    return block or ""  # a named move renders; a move's own feedback may say nothing (no error, no change)


def blind_copy(
    episodes: list[Episode],
    model: Any,
    tokenizer: Any,
    world: Any,
    split: str,
    *,
    seen: set[str],
    bare_replies: bool,
    action_format: ActionFormat | None,
    max_hindsight_tokens: int = 2048,
    micro_batch_tokens: int = 16384,
) -> dict:
    """pi_T(d) of a wrong move d (:func:`wrong_move_turns`: a deadlocking one in Sokoban, an admissible one
    other than the expert's elsewhere) without a block and under each of ``FALSE_BLOCKS``; the keys say
    ``deadlock`` for the first kind and ``wrong`` for the second."""
    wrong, found = wrong_move_turns(episodes, world, split, seen)
    cut = fb.make_cutter(tokenizer, max_hindsight_tokens)
    items = [(episodes[e].turns[t].prompt_ids, d) for e, t, d in found]
    for kind, spec in FALSE_BLOCKS.values():
        for e, t, d in found:
            block = false_block(episodes, e, t, d, kind, spec, world, split, bare_replies)
            bare_prompt = episodes[e].turns[t].prompt_ids  # a block that says nothing: the prompt as it was
            items.append((teacher_prompt(tokenizer, bare_prompt, cut(block)) if block else bare_prompt, d))
    how = ts.SpanScoring(model, tokenizer, 1.0, micro_batch_tokens, bare_replies, action_format)
    lps = ts.span_logprobs(items, how)
    probs = [math.exp(sum(lp)) if lp is not None else None for lp in lps]
    n = len(found)

    def mean(xs: list[float | None]) -> float | None:
        known = [x for x in xs if x is not None]
        return sum(known) / len(known) if known else None

    states = len({episodes[e].turns[t].state_key for e, t, _ in found})
    out: dict[str, Any] = {"turns": n, "states": states, "wrong_move": wrong}
    prefix = "p_deadlock" if wrong == "deadlocking" else "p_wrong"
    out[f"{prefix}_without_block"] = mean(probs[:n])
    for j, name in enumerate(FALSE_BLOCKS, start=1):
        out[f"{prefix}_{name.replace(' ', '_').replace(',', '+')}"] = mean(probs[j * n : (j + 1) * n])
    return out
