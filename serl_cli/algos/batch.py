"""The one batch type every objective sees: stored turns as padded tensors.

A turn's training sequence is exactly ``prompt_ids + action_ids`` as stored at rollout
time. Sequences are left-padded with position ids counted from each row's first real
token -- the layout ``generate`` used -- so the reply tokens sit in the last columns and
the LM head runs only there (``logits_to_keep``). Every per-token quantity an objective
reads (behaviour log-probs, SERL weights, teacher log-probs) is laid out the same way,
right-aligned in ``[B, K]``, so a loss is a function of tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PerTurn:
    """What an objective fixes for the whole update, one entry per turn (its ``prepare``)."""

    advantages: torch.Tensor  # [N] the direction and size of each turn's update
    token_weights: list[list[float]] | None = None  # per reply token: SERL weights (1 off the action span)
    teacher_logprobs: list[list[float]] | None = None  # per reply token: log pi_T, for the distillation term
    distill: list[bool] | None = None  # turns whose tokens carry the distillation term
    is_weights: list[list[float]] | None = None  # per reply token: the off-policy correction's weight (train.offpolicy)
    stats: dict = field(default_factory=dict)  # per-update metrics


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L] left-padded prompt + reply
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    reply_mask: torch.Tensor  # [B, K] over the last K positions: 1 on the reply's tokens (reasoning, action, end token)
    reply_ids: torch.Tensor  # [B, K] the reply's token ids, right-aligned
    index: list[int]  # which turns (positions in the update's list)
    logp_old: torch.Tensor | None = None  # [B, K] behaviour log-probs (None: the turns have none, e.g. expert data)
    advantages: torch.Tensor | None = None  # [B]
    weights: torch.Tensor | None = None  # [B, K] token weights, 1 on padding; None: all 1 (GRPO)
    logp_teacher: torch.Tensor | None = None  # [B, K]
    distill: torch.Tensor | None = None  # [B] bool: the row carries the distillation term
    is_weights: torch.Tensor | None = None  # [B, K] off-policy correction weights, 1 on padding; None: no correction
    entropy: torch.Tensor | None = None  # [B, K] the current policy's entropy per reply token, set by the
    #                                      forward pass only when train.entropy_coef > 0 (training.step.forward)


def make_micro_batches(
    samples: list, order: list[int], max_tokens: int, pad_id: int, per_turn: PerTurn | None = None
) -> list[MicroBatch]:
    """Group ``samples`` (turns, or anything with ``prompt_ids`` and ``action_ids``), in
    ``order``, into left-padded micro-batches of at most ``max_tokens`` padded tokens,
    carrying what ``per_turn`` fixed for each of them."""
    return [collate(samples, group, pad_id, per_turn) for group in micro_batch_groups(samples, order, max_tokens)]


def micro_batch_groups(samples: list, order: list[int], max_tokens: int) -> list[list[int]]:
    """The sample indices of each micro-batch :func:`make_micro_batches` makes (without building them)."""
    groups: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        length = len(samples[i].prompt_ids) + len(samples[i].action_ids)
        if current and max(width, length) * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, length)
    if current:
        groups.append(current)
    return groups


def collate(samples: list, index: list[int], pad_id: int, per_turn: PerTurn | None = None) -> MicroBatch:
    seqs = [samples[i].prompt_ids + samples[i].action_ids for i in index]
    width = max(len(s) for s in seqs)
    k = max(len(samples[i].action_ids) for i in index)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    reply_mask = torch.zeros((len(seqs), k), dtype=torch.float32)
    reply_ids = torch.full((len(seqs), k), pad_id, dtype=torch.long)
    for row, (i, s) in enumerate(zip(index, seqs, strict=True)):
        ids[row, width - len(s) :] = torch.tensor(s)
        attn[row, width - len(s) :] = 1
        a = samples[i].action_ids
        reply_mask[row, k - len(a) :] = 1.0
        reply_ids[row, k - len(a) :] = torch.tensor(a)
    positions = (attn.cumsum(-1) - 1).clamp_min(0)
    mb = MicroBatch(ids, attn, positions, reply_mask, reply_ids, list(index))
    behaviour = [getattr(samples[i], "behaviour_logprobs", None) for i in index]
    complete = [
        b for b, i in zip(behaviour, index, strict=True) if b is not None and len(b) == len(samples[i].action_ids)
    ]
    if len(complete) == len(index):  # every turn has its behaviour log-probs, one per reply token
        mb.logp_old = right_aligned(complete, k)
    if per_turn is not None:
        mb.advantages = per_turn.advantages[index]
        if per_turn.token_weights is not None:
            mb.weights = right_aligned([per_turn.token_weights[i] for i in index], k, pad=1.0)
        if per_turn.teacher_logprobs is not None:
            mb.logp_teacher = right_aligned([per_turn.teacher_logprobs[i] for i in index], k)
        if per_turn.is_weights is not None:
            mb.is_weights = right_aligned([per_turn.is_weights[i] for i in index], k, pad=1.0)
        if per_turn.distill is not None:
            mb.distill = torch.tensor([per_turn.distill[i] for i in index], dtype=torch.bool)
    return mb


def right_aligned(rows: list[list[float]], k: int, pad: float = 0.0) -> torch.Tensor:
    """Per-token values of each row, right-aligned in ``[B, k]`` like ``reply_ids``."""
    out = torch.full((len(rows), k), pad, dtype=torch.float32)
    for r, v in enumerate(rows):
        if v:
            out[r, k - len(v) :] = torch.tensor(v, dtype=torch.float32)
    return out
