"""Reading SFT (``train.hindsight_sft: "reading: SPEC; SPEC; ..."``): teach a small model to read a block.

SERL's teacher is the policy shown a hindsight block (METHOD.md 4). A pretrained LLM reads
such a block zero-shot; a model trained from scratch on CPU has never seen one. Hindsight SFT
(``method.sft.hindsight``) shows it blocks, but its target is the expert's move, which the
state alone determines: nothing rewards reading, and study v3's teacher did not read
(docs/RESULTS.md). Here every example's target depends on what the block says, in states
where the state alone does not give it away. This is a **small-scale necessity, not part of
the paper's method**: a warm-start option, so that the same network can later serve as a
teacher whose block says something.

``SPEC``s are feedback-source specs (``method.feedback``), one per kind of block the teacher
will be shown online (``"reading: expert; ref; error,diff"``: the aligned oracle, the aligned
reference, the environment's feedback); ``ref`` and ``expert`` render ``aligned``, the only
rendering a prompt without history can line up with its state. Every state of the data with
an expert action gets one example of one of the kinds, drawn uniformly (``random.Random(seed)``):

* **named** (every source ``ref`` or ``expert``): the block names a move that leads to the
  solution from this state -- one of the state's optimal moves, drawn uniformly: the target is
  that move. Where a state has several optimal moves, only the block says which one.
* **taken** (every source a turn field: ``error``, ``diff``, ``obs``): the block is what the
  environment said about a move ``m`` from this state, which is an optimal move half the time
  (a good turn: "player moved left" -- the target is ``m``, the move made) and otherwise a
  move that is not (a bump, a detour, or -- half of those where the state has one -- the push
  that deadlocks the room: the target is an optimal move, never ``m``).

Blocks come on good moves as well as bad ones and on every kind of state, so the presence of a
block says nothing; the data's own moves without a block (plain SFT) stay the examples without.
The environment is replayed to each state (``world.new_episode``, then the recorded moves) to
know its optimal moves (``optimal_actions``, else the recorded ``expert_action``) and deadlocking
moves (``solvable_actions``, where the environment has it), and to play ``m``: cheap on
Sokoban (microseconds a step), not meant for slow environments. Blocks are rendered by
:func:`serl_cli.method.feedback.hindsight_step` and spliced by
:func:`serl_cli.method.teacher.teacher_prompt`, cut to ``max_hindsight_tokens``: the
annotation's own functions, so the teacher prompts online look like the ones trained on.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from serl_cli.artifacts.records import Episode, Turn
from serl_cli.errors import SerlError
from serl_cli.method import feedback as fb
from serl_cli.method.sft.hindsight import example_episode, example_turn
from serl_cli.method.teacher import teacher_prompt
from serl_cli.rollout.prompts import format_reply

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from envs.base import Episode as EnvEpisode
    from envs.base import Step, World

READING = "reading:"  # the prefix of a reading spec in train.hindsight_sft
NAMED_SOURCES = ("ref", "expert")  # blocks that name a move someone who did well made from here
TAKEN_SOURCES = ("error", "diff", "obs")  # blocks that say what the move taken did
GOOD_SHARE = 0.5  # taken blocks: the share of examples whose move is an optimal one
DEADLOCK_SHARE = 0.5  # taken blocks on a bad move: the share that is the deadlocking push, where there is one


def is_reading(value: str | None) -> bool:
    return value is not None and value.strip().startswith(READING)


def parse_reading(value: str) -> list[tuple[str, list[list[str]]]]:
    """``"reading: expert; ref; error,diff"`` -> [(kind, parsed spec)] with kind ``named`` or ``taken``."""
    parts = [p.strip() for p in value.strip()[len(READING) :].split(";")]
    if not any(parts):
        raise SerlError(f"{value!r} names no block: write e.g. 'reading: expert; ref; error,diff'")
    out = []
    for part in parts:
        spec = fb.parse_sources(part)
        names = {n for alts in spec for n in alts}
        if names <= set(NAMED_SOURCES):
            out.append(("named", spec))
        elif names <= set(TAKEN_SOURCES):
            out.append(("taken", spec))
        else:
            raise SerlError(
                f"reading spec {part!r} mixes kinds: a block is either {' or '.join(NAMED_SOURCES)} (a move "
                f"someone who did well made) or made of {', '.join(TAKEN_SOURCES)} (what the move taken did)"
            )
    return out


def episode_at(world: World, split: str, task_id: int, actions: list[str], max_turns: int | None = None) -> EnvEpisode:
    """A fresh episode of ``task_id`` replayed through ``actions``: the state a turn acted in."""
    ep = world.new_episode(split, max_turns)
    ep.reset(task_id)
    for a in actions:
        ep.step(a)
    return ep


def state_moves(ep: Any, expert_action: str) -> tuple[list[str], list[str], list[str]]:
    """(admissible moves, optimal moves, deadlocking moves) of ``ep``'s current state."""
    moves = list(ep.admissible_actions())
    optimal = list(getattr(ep, "optimal_actions", lambda: [])()) or [expert_action]
    solvable = getattr(ep, "solvable_actions", None)
    deadlocking = [a for a in moves if a not in solvable()] if solvable else []
    return moves, optimal, deadlocking


def played_turn(turn: Turn, step: Step, action: str, bare: bool) -> Turn:
    """``turn`` as it would have been recorded had ``action`` been played (``step``: the environment's answer)."""
    return replace(
        turn,
        action=action,
        action_text=format_reply(action, bare),
        feedback=step.feedback.to_dict(),
        next_observation=step.observation,
        next_state_key=step.state_key,
    )


def named_context(episode: Episode, t: int, move: str, bare: bool) -> fb.TurnContext:
    """Turn ``t`` of ``episode`` where the expert's move and a successful rollout's move here are ``move``."""
    turns = list(episode.turns)
    turns[t] = replace(turns[t], expert_action=move)
    here = replace(episode, turns=turns, success=False, rollout_index=0)
    # a successful rollout whose one turn, in this state, played the move
    ref_turn = replace(turns[t], action=move, action_text=format_reply(move, bare))
    ref = replace(here, success=True, rollout_index=1, turns=[ref_turn])
    return fb.TurnContext(episode=here, turn=t, group=[here, ref], trajectory="aligned")


def reading_examples(
    episodes: list[Episode],
    tokenizer: PreTrainedTokenizerBase,
    kinds: list[tuple[str, list[list[str]]]],
    world: World,
    split: str,
    *,
    max_turns: int | None = None,
    max_hindsight_tokens: int = 2048,
    bare_replies: bool = False,
    chat_template_kwargs: dict | None = None,
    seed: int = 0,
) -> list[Episode]:
    """The reading examples, as episodes ``Learner.update`` reads: per episode, one teacher-prompt
    turn per state with an expert action, of a kind drawn from ``kinds`` (:func:`parse_reading`)."""
    rng = random.Random(seed)
    cut = fb.make_cutter(tokenizer, max_hindsight_tokens)
    out = []
    for episode in episodes:
        actions = [t.action for t in episode.turns]
        made = []
        for t, turn in enumerate(episode.turns):
            if not turn.expert_action:
                continue
            kind, spec = rng.choice(kinds)
            state = episode_at(world, split, episode.task_id, actions[:t], max_turns)
            moves, optimal, deadlocking = state_moves(state, turn.expert_action)
            if kind == "named":
                target = rng.choice(optimal)
                ctx = named_context(episode, t, target, bare_replies)
            else:
                good = rng.random() < GOOD_SHARE
                bad = [a for a in moves if a not in optimal]
                if not (good or bad):
                    good = True  # every move is optimal here
                if good:
                    move = target = rng.choice(optimal)
                else:
                    pool = deadlocking if deadlocking and rng.random() < DEADLOCK_SHARE else bad
                    move, target = rng.choice(pool), rng.choice(optimal)
                step = episode_at(world, split, episode.task_id, actions[:t], max_turns).step(move)
                turns = list(episode.turns)
                turns[t] = played_turn(turn, step, move, bare_replies)
                ctx = fb.TurnContext(episode=replace(episode, turns=turns), turn=t, group=[])
            block, _, _ = fb.hindsight_step(ctx, spec)
            if block is None:
                continue
            block = cut(block)
            prompt = teacher_prompt(tokenizer, turn.prompt_ids, block, chat_template_kwargs)
            made.append(example_turn(turn, prompt, tokenizer, target, block, bare_replies))
        if made:
            out.append(example_episode(episode, made))
    return out


def reading_examples_for_run(
    episodes: list[Episode],
    tokenizer: PreTrainedTokenizerBase,
    value: str,
    env_cfg: dict | None,
    bare_replies: bool = False,
    chat_template_kwargs: dict | None = None,
    seed: int = 0,
) -> list[Episode]:
    """:func:`reading_examples` of a run's episodes, in the run's environment (replayed)."""
    from serl_cli.rollout.worlds import EnvConfig, build_world, built_split

    if not env_cfg:
        raise SerlError("reading SFT replays the run's environment: the run's manifest names none")
    env = EnvConfig(**env_cfg)
    world = build_world(env)
    return reading_examples(
        episodes,
        tokenizer,
        parse_reading(value),
        world,
        built_split(env),
        max_turns=env.max_turns,
        bare_replies=bare_replies,
        chat_template_kwargs=chat_template_kwargs,
        seed=seed,
    )
