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

Cost: two teacher forwards per scored turn with an expert action, the expert's reply with the
block (as long as the annotation's own forward for that turn) and without it (the student's
prompt: on Sokoban about half as long). Where the student took the expert's action, the first is
the very item the annotation scored, and its log-probs are taken from there, not scored again
(``SpanScoring.known``; ``teacher_signal: false`` skips the signal). The teacher prompts are the annotation's own
(``method.annotation.teacher_prompts``), not rebuilt here. The forwards go through the
annotation's scorer (:func:`serl_cli.training.scoring.score`'s signature: under the online
loop divided over its processes; under ``serl annotate`` journaled, its units numbered after
the weights' own).

:func:`signal_rows` keeps the per-turn figures (for intervals, or a subset of turns: the
teacher-signal gate, ``method.diagnostics.teacher_gate``); :func:`summarize` averages them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from serl_cli.artifacts.records import Annotation, Episode, Turn
from serl_cli.method.action_mask import action_span_mask
from serl_cli.method.feedback import same_action
from serl_cli.rollout.prompts import reply_ids
from serl_cli.training.scoring import ScoreItem, score

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def expert_reply_ids(tokenizer: PreTrainedTokenizerBase, action: str, bare_replies: bool = False) -> list[int]:
    """The expert's action as a reply, tokenized as ``TokenizedExpertPolicy`` records it for SFT:
    tagged, or bare where the rollouts' prompts ask for bare replies (``prompt.bare_replies``) --
    scored in the wrong form, the expert's reply has almost no probability under either prompt."""
    return reply_ids(tokenizer, action, bare_replies)


def _turn(records: list[Annotation], episodes: list[Episode], k: int) -> Turn:
    return episodes[records[k].episode].turns[records[k].turn]


def signal_turns(records: list[Annotation], episodes: list[Episode]) -> list[int]:
    """Indices of the records the teacher scored whose turn has an expert action."""
    return [
        k for k, r in enumerate(records) if r.teacher_logprobs is not None and _turn(records, episodes, k).expert_action
    ]


def signal_rows(
    records: list[Annotation], episodes: list[Episode], expert_logprobs: dict[int, tuple[list[float], list[float]]]
) -> list[dict]:
    """One row per record in ``expert_logprobs`` (record index -> log pi_T of the expert reply's
    action-span tokens, with the block and without it): ``record``, ``on_expert`` (the action
    taken is the expert's), ``right`` (the log-ratio has the sign that helps; a tie is wrong),
    ``p_with`` and ``p_without`` (the expert reply's probability under the teacher)."""
    rows = []
    for k, (lp_with, lp_without) in expert_logprobs.items():
        turn = _turn(records, episodes, k)
        on_expert = same_action(turn.action, turn.expert_action)
        lr = records[k].log_ratio_mean
        assert lr is not None  # the teacher scored it (signal_turns)
        rows.append(
            {
                "record": k,
                "on_expert": on_expert,
                "right": lr > 0 if on_expert else lr < 0,
                "p_with": math.exp(sum(lp_with)),
                "p_without": math.exp(sum(lp_without)),
            }
        )
    return rows


def summarize(rows: list[dict]) -> dict | None:
    """The signal over ``rows`` (:func:`signal_rows`); None where there are none."""
    if not rows:
        return None
    n = len(rows)

    def frac(xs: list[bool]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    off = [r["right"] for r in rows if not r["on_expert"]]
    on = [r["right"] for r in rows if r["on_expert"]]
    with_block = sum(r["p_with"] for r in rows) / n
    without_block = sum(r["p_without"] for r in rows) / n
    return {
        "turns": n,
        "right_direction": frac(off + on),
        "expert_prob_gain": sum(r["p_with"] - r["p_without"] for r in rows) / n,
        "off_expert_turns": len(off),
        "off_expert_right_direction": frac(off),
        "on_expert_turns": len(on),
        "on_expert_right_direction": frac(on),
        "expert_prob_with_block": with_block,
        "expert_prob_without_block": without_block,
    }


def teacher_signal(
    records: list[Annotation], episodes: list[Episode], expert_logprobs: dict[int, tuple[list[float], list[float]]]
) -> dict | None:
    """The signal over the records in ``expert_logprobs`` (:func:`signal_rows`, :func:`summarize`)."""
    return summarize(signal_rows(records, episodes, expert_logprobs))


@dataclass(frozen=True)
class SpanScoring:
    """How the teacher scores a reply's action span: the teacher network and tokenizer, the
    annotation's temperature and micro-batch, the replies' form (bare where the rollouts' prompts
    ask for it, its action then found by the environment's ``action_format``), and the scorer
    (:func:`serl_cli.training.scoring.score`'s signature). ``known``: log-probs the same teacher
    already gave, by (prompt ids, reply ids), at the same temperature; those items are not scored
    again (the annotation's own: where the student took the expert's action, the expert reply with
    the block is the very item the annotation scored)."""

    teacher_model: Any
    tokenizer: Any
    temperature: float
    micro_batch_tokens: int
    bare_replies: bool = False
    action_format: Any = None
    scorer: Callable = score
    known: dict[tuple[tuple[int, ...], tuple[int, ...]], list[float]] = field(default_factory=dict)


def span_logprobs(items: list[tuple[list[int], str]], how: SpanScoring) -> list[list[float] | None]:
    """log pi_T of each action's reply on its action span, one (prompt ids, action) pair per item;
    None where the reply has no action span (an empty span would read as probability 1)."""
    tokenizer = how.tokenizer
    reply = {a: expert_reply_ids(tokenizer, a, how.bare_replies) for _, a in items}
    # a bare reply's action is found by the environment's action format
    fmt = how.action_format if how.bare_replies else None
    span = {a: action_span_mask(tokenizer, ids, "none", fmt) for a, ids in reply.items()}
    keep = [j for j, (_, a) in enumerate(items) if any(span[a])]
    out: list[list[float] | None] = [None] * len(items)
    key = {j: (tuple(items[j][0]), tuple(reply[items[j][1]])) for j in keep}
    new = [j for j in keep if key[j] not in how.known]
    scored = (
        how.scorer(
            how.teacher_model,
            tokenizer,
            [ScoreItem(items[j][0], reply[items[j][1]]) for j in new],
            how.temperature,
            how.micro_batch_tokens,
        )
        if new
        else []
    )
    fresh = {key[j]: lp for j, lp in zip(new, scored, strict=True)}
    for j in keep:
        lp = fresh[key[j]] if key[j] in fresh else how.known[key[j]]
        out[j] = [x for x, m in zip(lp, span[items[j][1]], strict=True) if m]
    return out


def expert_logprobs(
    records: list[Annotation], episodes: list[Episode], prompts: dict[int, list[int]], how: SpanScoring
) -> dict[int, tuple[list[float], list[float]]]:
    """Record index -> the expert reply's action-span log-probs with the block (the teacher
    prompt in ``prompts``, as the annotation built it) and without it, on :func:`signal_turns`."""
    turns = signal_turns(records, episodes)
    items: list[tuple[list[int], str]] = []
    for k in turns:
        turn = _turn(records, episodes, k)
        assert turn.expert_action is not None  # signal_turns keeps the turns with an expert action
        items += [(prompts[k], turn.expert_action), (turn.prompt_ids, turn.expert_action)]
    lps = span_logprobs(items, how)
    # both items of a turn score the same reply, so both have its action span or neither has
    return {
        k: (with_block, without)
        for k, with_block, without in zip(turns, lps[::2], lps[1::2], strict=True)
        if with_block is not None and without is not None
    }


def measure(
    records: list[Annotation], episodes: list[Episode], prompts: dict[int, list[int]], how: SpanScoring
) -> dict | None:
    """Score the expert's reply with and without each turn's block (``how``), and summarize
    (:func:`teacher_signal`). ``prompts``: record index -> its teacher prompt
    (``method.annotation.teacher_prompts``)."""
    if not signal_turns(records, episodes):
        return None
    return teacher_signal(records, episodes, expert_logprobs(records, episodes, prompts, how))
