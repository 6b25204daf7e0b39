"""Hindsight SFT (``train.hindsight_sft``): show a small model hindsight blocks (study v3's recipe).

Its target is the expert's move whatever the block says, so it cannot teach reading: the state
alone gives the target away (study v3's teacher did not read its blocks, docs/RESULTS.md).
Reading SFT (``method.sft.reading``, ``train.hindsight_sft: "reading: ..."``) does; this module
stays as the recipe study v3 ran.

SERL's teacher is the policy itself, shown a hindsight block (METHOD.md 4). The paper's
7B model reads such a block zero-shot; a model trained from scratch has never seen one,
so its teacher scores exactly like the student, every weight is about 1, and SERL is GRPO
by construction. This is a **small-scale necessity, not part of the paper's method**: a
warm-start option that adds SFT examples rendered exactly as the annotation renders
teacher prompts, so that the same network can later serve as a teacher that says
something.

Where the examples come from: the turns of the data where a noisy expert
(``serl rollout --policy expert --set expert_noise=...``) moved off the expert
(``off_expert``) from a state that still had an expert action. The block built for such a
turn says what that mistake led to -- the environment's error, a reference trajectory --
which is what the teacher will be shown about the student's mistakes online. The target is
the expert's action from the same state, written as the expert writes it for SFT.

Each example comes twice, with the block and without it. Without the second copy the
block would only mark "an unusual state", and the model would learn to move away from
whatever it would otherwise do whenever a block is present, whatever the block says;
with it, the block is worth reading only for what it says (docs/ENVS.md, Sokoban: a line
naming a deadlocking action lowers that action, a line naming another does not).

Blocks are built at step granularity with :func:`serl_cli.method.feedback.hindsight_step`
and spliced with :func:`serl_cli.method.teacher.teacher_prompt`, the whole block cut to
``max_hindsight_tokens`` tokens: the annotation's own functions and budget, so the teacher
prompts online look like the ones trained on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serl_cli.artifacts.records import Episode, Turn
from serl_cli.method import feedback as fb
from serl_cli.method.annotation import expert_trajectories
from serl_cli.method.teacher import teacher_prompt
from serl_cli.rollout.prompts import format_reply, reply_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def examples_for_run(
    episodes: list[Episode],
    tokenizer: PreTrainedTokenizerBase,
    sources: str,
    env_cfg: dict | None,
    bare_replies: bool = False,
    chat_template_kwargs: dict | None = None,
) -> list[Episode]:
    """:func:`hindsight_examples` of a run's episodes, with the environment's expert
    trajectories for ``expert`` where the sources use it (as the annotation has them)."""
    uses_expert = any("expert" in alts for alts in fb.parse_sources(sources))
    experts = expert_trajectories(env_cfg, episodes) if uses_expert and env_cfg else None
    return hindsight_examples(
        episodes,
        tokenizer,
        sources,
        experts=experts,
        bare_replies=bare_replies,
        chat_template_kwargs=chat_template_kwargs,
    )


def hindsight_turns(episodes: list[Episode]) -> list[tuple[int, int]]:
    """(episode, turn) of every off-expert move made from a state that had an expert action."""
    return [
        (e, t)
        for e, ep in enumerate(episodes)
        for t, turn in enumerate(ep.turns)
        if turn.off_expert and turn.expert_action
    ]


def hindsight_examples(
    episodes: list[Episode],
    tokenizer: PreTrainedTokenizerBase,
    sources: str,
    *,
    experts: dict[int, list[dict]] | None = None,
    max_hindsight_tokens: int = 2048,
    bare_replies: bool = False,
    chat_template_kwargs: dict | None = None,
) -> list[Episode]:
    """The SFT examples, as episodes ``Learner.update`` reads: one per episode that has any,
    holding two turns per hindsight turn whose ``sources`` render a block (with the block,
    then without). ``experts``: the expert's trajectory per task, for the ``expert`` source
    (``method.annotation.expert_trajectories``). ``bare_replies``: write the targets as the
    data's demonstrations are written (``PromptConfig.bare_replies``); ``chat_template_kwargs``: the data's
    ``PromptConfig.chat_template_kwargs``, for the teacher prompts."""
    spec = fb.parse_sources(sources)
    groups: dict[tuple, list[Episode]] = {}
    for ep in episodes:
        groups.setdefault(ep.group_key, []).append(ep)
    cut = fb.make_cutter(tokenizer, max_hindsight_tokens)  # the whole block, as the annotation cuts it
    by_episode: dict[int, list[Turn]] = {}
    for e, t in hindsight_turns(episodes):
        ep = episodes[e]
        ctx = fb.TurnContext(episode=ep, turn=t, group=groups[ep.group_key], expert=(experts or {}).get(ep.task_id))
        block, _, _ = fb.hindsight_step(ctx, spec)
        if block is None:
            continue
        block = cut(block)
        turn = ep.turns[t]
        teacher = teacher_prompt(tokenizer, turn.prompt_ids, block, chat_template_kwargs)
        expert = turn.expert_action
        assert expert is not None  # hindsight_turns keeps the turns with an expert action
        by_episode.setdefault(e, []).extend(
            [
                example_turn(turn, teacher, tokenizer, expert, block, bare_replies),
                example_turn(turn, turn.prompt_ids, tokenizer, expert, None, bare_replies),
            ]
        )
    return [example_episode(episodes[e], turns) for e, turns in by_episode.items()]


def example_turn(
    turn: Turn,
    prompt_ids: list[int],
    tokenizer: PreTrainedTokenizerBase,
    action: str,
    hindsight: str | None,
    bare: bool,
) -> Turn:
    """An SFT turn record from ``turn``'s state: ``prompt_ids`` (the student's prompt, or a teacher
    prompt holding the block ``hindsight``) with ``action`` as the reply, written as the expert writes it."""
    return Turn(
        turn=turn.turn,
        prompt_ids=prompt_ids,
        action_ids=reply_ids(tokenizer, action, bare),
        action_text=format_reply(action, bare),
        action=action,
        behaviour_logprobs=[],
        state_key=turn.state_key,
        feedback=turn.feedback,
        reward=0.0,
        done=False,
        hindsight=hindsight,
    )


def example_episode(episode: Episode, turns: list[Turn]) -> Episode:
    """An episode of SFT example turns, in ``episode``'s place (its task, group, index, reward, success)."""
    return Episode(
        task_id=episode.task_id,
        group_id=episode.group_id,
        rollout_index=episode.rollout_index,
        reward=episode.reward,
        success=episode.success,
        turns=turns,
    )
