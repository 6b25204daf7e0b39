"""Scoring stored turns under a model: the log-probs of each turn's reply tokens, no gradient.

One function for everything that scores (:func:`score`): the π_old recompute (the trainer's
own log-probs of the rollouts' tokens), the hindsight teacher, the teacher signal. Turns are
batched by length into micro-batches of at most ``micro_batch_tokens`` padded tokens (on a CPU at
most :data:`CPU_MICRO_BATCH_TOKENS`, where larger ones run slower), and an item equal to an earlier
one (the same prompt and reply tokens) is scored once.

Under several processes (``ranks``: the learner's backend) every process holds the same
items and makes the same micro-batches one process would; they are dealt out by size
(:func:`deal`: largest first, in a snake over the processes, so that each holds as many as
the others, give or take one, and about as many padded tokens), each process scores its own,
and the results are gathered: every process returns every item's log-probs, bit for bit those
of one process, since every item is scored in the same micro-batch. Dealing whole task groups
instead, as the online loop divides its rollouts, left one process with the 50-turn episodes
and another with the 5-turn ones. Under ZeRO-3 the forward passes gather
the weights layer by layer (ZeRO's own hooks): every process must run as many forwards as the
others, so one with fewer micro-batches runs a stand-in pass (as the backend's optimizer step
does); no process ever holds the whole model for scoring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from serl_cli.algos.batch import collate, micro_batch_groups
from serl_cli.models.device import model_device
from serl_cli.training.step import action_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CPU_MICRO_BATCH_TOKENS = 4096  # on a CPU, scoring's micro-batches are no larger (_cpu_capped)


@dataclass
class ScoreItem:
    prompt_ids: list[int]
    action_ids: list[int]


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _by_length(items: list[ScoreItem], index: list[int]) -> list[int]:
    return sorted(index, key=lambda i: len(items[i].prompt_ids) + len(items[i].action_ids))


def score_units(tokenizer: PreTrainedTokenizerBase, items: list[ScoreItem], micro_batch_tokens: int) -> list[list[int]]:
    """The micro-batches one process's :func:`score` makes for ``items``, as lists of item
    indices. Scoring one unit's items alone packs them into that same single micro-batch (on a
    CPU, a unit over :data:`CPU_MICRO_BATCH_TOKENS` is split further: the same log-probs, faster)."""
    order = _by_length(items, list(range(len(items))))
    return micro_batch_groups(items, order, micro_batch_tokens)


@torch.no_grad()
def score(
    model: Any,  # the policy or a teacher: a Hugging Face model, or its peft wrapper
    tokenizer: PreTrainedTokenizerBase,
    items: list[ScoreItem],
    temperature: float = 1.0,
    micro_batch_tokens: int = 16384,
    ranks: Any = None,  # a training Backend, or None; Any: world > 1 only where one is given
) -> list[list[float]]:
    """log-probs of each item's action tokens under ``model``, batched by length; with
    ``ranks`` (a backend of several processes) divided over them and gathered (module docstring)."""
    if not items:
        return []
    rank, world = (ranks.rank, ranks.world) if ranks is not None else (0, 1)
    groups, same = plan(model, items, micro_batch_tokens, world)
    dealt = deal([padded_tokens(items, g) for g in groups], world)
    pad = pad_id(tokenizer)
    mine = [collate(items, groups[b], pad) for b in dealt[rank]]  # only this process's batches are built
    # ZeRO-3's forward is a collective: every process runs the most any of them has
    passes = max(len(d) for d in dealt) if ranks is not None and ranks.collective_forward else len(mine)
    out: dict[int, list[float]] = {}
    was_training = model.training
    model.eval()
    for j in range(passes):
        if j >= len(mine):  # a stand-in pass: its result is dropped
            action_logprobs(model, collate(items, groups[0], pad), temperature)
            continue
        mb = mine[j]
        logp = action_logprobs(model, mb, temperature)
        k = logp.shape[1]
        for row, i in enumerate(mb.index):
            out[i] = logp[row, k - len(items[i].action_ids) :].tolist()
    model.train(was_training)
    if world > 1:
        for part in ranks.all_gather(out):
            out.update(part)
    return [list(out[same[i]]) for i in range(len(items))]


def plan(
    model: Any, items: list[ScoreItem], micro_batch_tokens: int, world: int = 1
) -> tuple[list[list[int]], list[int]]:
    """The micro-batches :func:`score` runs for ``items`` over ``world`` processes, as lists of item
    indices, and for each item the index of the item whose log-probs it takes: an item equal to an
    earlier one (the same prompt and reply tokens: a state a group's rollouts or the teacher signal
    meet again) is scored once and its log-probs copied. The batches are one process's, unless they
    would be fewer than the processes: then smaller, about a process's share of the tokens each, so
    that every one works."""
    first: dict[tuple, int] = {}
    same = [first.setdefault((tuple(it.prompt_ids), tuple(it.action_ids)), i) for i, it in enumerate(items)]
    order = _by_length(items, [i for i in range(len(items)) if same[i] == i])
    cap = _cpu_capped(model, micro_batch_tokens)
    groups = micro_batch_groups(items, order, cap)
    if world > 1 and len(groups) < world <= len(order):
        lengths = [len(items[i].prompt_ids) + len(items[i].action_ids) for i in order]
        share = max(max(lengths), -(-sum(lengths) // world))
        groups = micro_batch_groups(items, order, min(cap, share))
    return groups, same


def padded_tokens(items: list[ScoreItem], group: list[int]) -> int:
    """A micro-batch's padded tokens: its rows times its longest prompt and reply (``collate``'s width)."""
    return len(group) * max(len(items[i].prompt_ids) + len(items[i].action_ids) for i in group)


def deal(sizes: list[int], world: int) -> list[list[int]]:
    """Which micro-batches (by index into ``sizes``, their padded tokens) each of ``world``
    processes runs: largest first, in a snake (0, 1, .., W-1, W-1, .., 0, 0, ..), so that the
    counts differ by at most one and the token totals by at most the largest micro-batch."""
    order = sorted(range(len(sizes)), key=lambda b: (-sizes[b], b))
    dealt: list[list[int]] = [[] for _ in range(world)]
    for n, b in enumerate(order):
        lap, pos = divmod(n, world)
        dealt[pos if lap % 2 == 0 else world - 1 - pos].append(b)
    return dealt


def own_items(model: Any, items: list[ScoreItem], micro_batch_tokens: int, rank: int, world: int) -> int:
    """How many of ``items`` process ``rank`` of ``world`` scores itself (a copy of a duplicate not counted)."""
    groups, _ = plan(model, items, micro_batch_tokens, world)
    dealt = deal([padded_tokens(items, g) for g in groups], world)
    return sum(len(groups[b]) for b in dealt[rank])


def _cpu_capped(model: Any, micro_batch_tokens: int) -> int:
    """On a CPU, micro-batches of at most :data:`CPU_MICRO_BATCH_TOKENS`: a forward over a large
    one works through activations far bigger than the caches (1.6x slower at 16384 tokens than at
    2048-4096 for the demo's model on Sokoban), and a CPU has no parallelism for a wide batch to fill."""
    if model_device(model).type == "cpu":
        return min(micro_batch_tokens, CPU_MICRO_BATCH_TOKENS)
    return micro_batch_tokens
