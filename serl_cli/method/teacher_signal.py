"""The teacher signal: is the hindsight teacher telling the student anything?

Where the environment knows the right move (a stored turn's ``expert_action``: the
expert's action from the state that turn acted in), the annotation pass can check its
teacher against it, on the turns the teacher scored:

* ``right_direction``: the fraction of turns where the teacher moves the student's action
  the right way. The turn's mean log-ratio over the action span, log pi_T - log pi_old
  (``log_ratio_mean``, what sets the SERL weight), must be below 0 where the action taken
  is not the expert's and above 0 where it is. A tie counts as wrong. pi_old is the
  behaviour policy, so with ``teacher_sync_interval > 1`` this mixes what the block says
  with how far the teacher snapshot lags the policy.
* ``expert_prob_gain``: the mean over those turns of pi_T(expert | prompt + block) -
  pi_T(expert | prompt), both under the teacher network, which isolates what the block says
  from the lag. The probability is the expert reply's, written as the expert policy writes
  it for SFT, over its action-span tokens (exp of their summed log-probs, the tags given),
  at the annotation's temperature.

Actions compare as serl's feedback sources compare them (case and whitespace ignored:
how Sokoban and ALFWorld read an action). Turns after a deadlock have no expert action
and are left out. The result also counts the turns on and off the expert's action, with
each side's ``right_direction``: a teacher that lowers every sampled action (a block that
only flattens the distribution does) scores well off the expert and badly on it.

Cost: two teacher forwards per scored turn with an expert action (the expert's reply with
the block and without it), each as long as the annotation's own forward for that turn: on
Sokoban, where the prompt dominates, about 1.7 times the annotation's teacher time
(``teacher_signal: false`` skips it). They go through the annotation's scorer
(:func:`serl_cli.training.scoring.score`'s signature: under the online loop divided over its
processes; under ``serl annotate`` journaled, its units numbered after the weights' own).
"""

from __future__ import annotations

import math

from serl_cli.method.feedback import _same
from serl_cli.method.teacher import action_span_mask, teacher_prompt
from serl_cli.rollout.prompts import reply_ids
from serl_cli.training.scoring import ScoreItem, score


def expert_reply_ids(tokenizer, action: str, bare_replies: bool = False) -> list[int]:
    """The expert's action as a reply, tokenized as ``TokenizedExpertPolicy`` records it for SFT:
    tagged, or bare where the rollouts' prompts ask for bare replies (``prompt.bare_replies``) --
    scored in the wrong form, the expert's reply has almost no probability under either prompt."""
    return reply_ids(tokenizer, action, bare_replies)


def _turn(records: list[dict], episodes: list[dict], k: int) -> dict:
    return episodes[records[k]["episode"]]["turns"][records[k]["turn"]]


def signal_turns(records: list[dict], episodes: list[dict]) -> list[int]:
    """Indices of the records the teacher scored whose turn has an expert action."""
    return [
        k
        for k, r in enumerate(records)
        if r["teacher_logprobs"] is not None and _turn(records, episodes, k).get("expert_action")
    ]


def teacher_signal(
    records: list[dict], episodes: list[dict], expert_logprobs: dict[int, tuple[list[float], list[float]]]
) -> dict | None:
    """The signal over the records in ``expert_logprobs``: record index -> log pi_T of the
    expert reply's action-span tokens (with the block, without it). None where it is empty."""
    if not expert_logprobs:
        return None
    right = {True: [], False: []}  # on the expert's action or not -> did the teacher move it the right way
    with_block, without_block = [], []
    for k, (lp_with, lp_without) in expert_logprobs.items():
        turn = _turn(records, episodes, k)
        on_expert = _same(turn["action"], turn["expert_action"])
        lr = records[k]["log_ratio_mean"]
        right[on_expert].append(lr > 0 if on_expert else lr < 0)
        with_block.append(math.exp(sum(lp_with)))
        without_block.append(math.exp(sum(lp_without)))
    n = len(expert_logprobs)

    def frac(xs: list[bool]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    return {
        "turns": n,
        "right_direction": frac(right[False] + right[True]),
        "expert_prob_gain": (sum(with_block) - sum(without_block)) / n,
        "off_expert_turns": len(right[False]),
        "off_expert_right_direction": frac(right[False]),
        "on_expert_turns": len(right[True]),
        "on_expert_right_direction": frac(right[True]),
        "expert_prob_with_block": sum(with_block) / n,
        "expert_prob_without_block": sum(without_block) / n,
    }


def measure(
    records: list[dict],
    episodes: list[dict],
    teacher_model,
    tokenizer,
    temperature: float,
    micro_batch_tokens: int,
    chat_template_kwargs: dict | None = None,
    bare_replies: bool = False,
    action_format=None,
    scorer=score,
) -> dict | None:
    """Score the expert's reply with and without each turn's block (with ``scorer``), and
    summarize (:func:`teacher_signal`)."""
    turns = signal_turns(records, episodes)
    if not turns:
        return None
    expert = [_turn(records, episodes, k)["expert_action"] for k in turns]
    reply = {a: expert_reply_ids(tokenizer, a, bare_replies) for a in set(expert)}
    # a bare reply's action is found by the environment's action format; an empty span would read as probability 1
    span = {
        a: action_span_mask(tokenizer, ids, "none", action_format if bare_replies else None) for a, ids in reply.items()
    }
    keep = [j for j, a in enumerate(expert) if any(span[a])]
    turns, expert = [turns[j] for j in keep], [expert[j] for j in keep]
    if not turns:
        return None
    items = []
    for k, a in zip(turns, expert):
        prompt = _turn(records, episodes, k)["prompt_ids"]
        with_block = teacher_prompt(tokenizer, prompt, records[k]["hindsight"], chat_template_kwargs)
        items += [ScoreItem(with_block, reply[a]), ScoreItem(prompt, reply[a])]
    scored = scorer(teacher_model, tokenizer, items, temperature, micro_batch_tokens)

    def on_span(logprobs: list[float], a: str) -> list[float]:
        return [x for x, m in zip(logprobs, span[a]) if m]

    return teacher_signal(
        records,
        episodes,
        {k: (on_span(scored[2 * j], a), on_span(scored[2 * j + 1], a)) for j, (k, a) in enumerate(zip(turns, expert))},
    )
