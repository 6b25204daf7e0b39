"""Scoring stored turns under a model: the log-probs of each turn's reply tokens, no gradient.

One function for everything that scores (:func:`score`): the π_old recompute (the trainer's
own log-probs of the rollouts' tokens), the hindsight teacher, the teacher signal. Turns are
batched by length into micro-batches of at most ``micro_batch_tokens`` padded tokens (on a CPU at
most :data:`CPU_MICRO_BATCH_TOKENS`, where larger ones run slower), and an item equal to an earlier
one (the same prompt and reply tokens) is scored once.

Under several processes (``ranks``: the learner's backend) every process holds the same
items; each scores its own share -- the items of its task groups (``ScoreItem.group``,
group g belongs to process ``g % W``, as the online loop divides its rollouts), or, for
an item with no group, item i belongs to ``i % W`` -- and the results are gathered, so every
process returns every item's log-probs, as one process would. Under ZeRO-3 the forward
passes gather the weights layer by layer (ZeRO's own hooks): every process must run as many
forwards as the others, so one with fewer micro-batches runs stand-in passes (as the
backend's optimizer step does); no process ever holds the whole model for scoring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serl_cli.algos.batch import make_micro_batches
from serl_cli.models.device import model_device
from serl_cli.training.step import action_logprobs

CPU_MICRO_BATCH_TOKENS = 4096  # on a CPU, scoring's micro-batches are no larger (_cpu_capped)


@dataclass
class ScoreItem:
    prompt_ids: list[int]
    action_ids: list[int]
    group: int | None = None  # the turn's task group: whose share it is under several processes


def owner(item: ScoreItem, index: int, world: int) -> int:
    """The process that scores ``item`` (the ``index``-th) out of ``world``."""
    return (item.group if item.group is not None else index) % world


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _by_length(items: list[ScoreItem], index: list[int]) -> list[int]:
    return sorted(index, key=lambda i: len(items[i].prompt_ids) + len(items[i].action_ids))


def score_units(tokenizer, items: list[ScoreItem], micro_batch_tokens: int) -> list[list[int]]:
    """The micro-batches one process's :func:`score` makes for ``items``, as lists of item
    indices. Scoring one unit's items alone packs them into that same single micro-batch (on a
    CPU, a unit over :data:`CPU_MICRO_BATCH_TOKENS` is split further: the same log-probs, faster)."""
    order = _by_length(items, list(range(len(items))))
    return [mb.index for mb in make_micro_batches(items, order, micro_batch_tokens, pad_id(tokenizer))]


@torch.no_grad()
def score(
    model,
    tokenizer,
    items: list[ScoreItem],
    temperature: float = 1.0,
    micro_batch_tokens: int = 16384,
    ranks=None,
) -> list[list[float]]:
    """log-probs of each item's action tokens under ``model``, batched by length; with
    ``ranks`` (a backend of several processes) divided over them and gathered (module docstring)."""
    if not items:
        return []
    pad = pad_id(tokenizer)
    rank, world = (ranks.rank, ranks.world) if ranks is not None else (0, 1)
    micro_batch_tokens = _cpu_capped(model, micro_batch_tokens)
    shares: list[list[int]] = [[] for _ in range(world)]
    for i, item in enumerate(items):
        shares[owner(item, i, world)].append(i)
    # an item equal to one before it in its share (a state a group's rollouts or the teacher signal
    # meet again) is scored once and its log-probs copied
    same: dict[int, int] = {}
    for share in shares:
        first: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        for i in share:
            same[i] = first.setdefault((tuple(items[i].prompt_ids), tuple(items[i].action_ids)), i)
    shares = [[i for i in s if same[i] == i] for s in shares]
    batches = [make_micro_batches(items, _by_length(items, s), micro_batch_tokens, pad) for s in shares]
    mine = batches[rank]
    # ZeRO-3's forward is a collective: every process runs the most any of them has
    passes = max(len(b) for b in batches) if ranks is not None and ranks.collective_forward else len(mine)
    out: dict[int, list[float]] = {}
    was_training = model.training
    model.eval()
    for j in range(passes):
        if j >= len(mine):  # a stand-in pass: its result is dropped
            action_logprobs(model, next(b for b in batches if b)[0], temperature)
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


def _cpu_capped(model, micro_batch_tokens: int) -> int:
    """On a CPU, micro-batches of at most :data:`CPU_MICRO_BATCH_TOKENS`: a forward over a large
    one works through activations far bigger than the caches (1.6x slower at 16384 tokens than at
    2048-4096 for the demo's model on Sokoban), and a CPU has no parallelism for a wide batch to fill."""
    if model_device(model).type == "cpu":
        return min(micro_batch_tokens, CPU_MICRO_BATCH_TOKENS)
    return micro_batch_tokens
