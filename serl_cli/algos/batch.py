"""The one batch type every objective sees: stored turns as padded tensors.

A turn's training sequence is exactly ``prompt_ids + action_ids`` as stored at rollout
time. Sequences are left-padded with position ids counted from each row's first real
token -- the layout ``generate`` used -- so the reply tokens sit in the last columns and
the LM head runs only there (``logits_to_keep``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serl_cli.artifacts.schema import TurnSample


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L] left-padded prompt + action
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    reply_mask: torch.Tensor  # [B, K] over the last K positions: 1 on the reply's tokens (reasoning, action, end token)
    action_targets: torch.Tensor  # [B, K] the action token ids, right-aligned
    index: list[int]  # which samples (positions in the full list)



def make_micro_batches(samples: list[TurnSample], order: list[int], max_tokens: int, pad_id: int) -> list[MicroBatch]:
    """Group samples (in ``order``) into left-padded micro-batches of at most ``max_tokens`` padded tokens."""
    batches, current = [], []
    width = 0
    for i in order:
        length = len(samples[i].prompt_ids) + len(samples[i].action_ids)
        if current and max(width, length) * (len(current) + 1) > max_tokens:
            batches.append(_collate(samples, current, pad_id))
            current, width = [], 0
        current.append(i)
        width = max(width, length)
    if current:
        batches.append(_collate(samples, current, pad_id))
    return batches



def _collate(samples: list[TurnSample], index: list[int], pad_id: int) -> MicroBatch:
    seqs = [samples[i].prompt_ids + samples[i].action_ids for i in index]
    width = max(len(s) for s in seqs)
    k = max(len(samples[i].action_ids) for i in index)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    amask = torch.zeros((len(seqs), k), dtype=torch.float32)
    targets = torch.full((len(seqs), k), pad_id, dtype=torch.long)
    for row, (i, s) in enumerate(zip(index, seqs)):
        ids[row, width - len(s):] = torch.tensor(s)
        attn[row, width - len(s):] = 1
        a = samples[i].action_ids
        amask[row, k - len(a):] = 1.0
        targets[row, k - len(a):] = torch.tensor(a)
    positions = (attn.cumsum(-1) - 1).clamp_min(0)
    return MicroBatch(ids, attn, positions, amask, targets, list(index))



def pad_right_aligned(values: list[list[float]], mb: MicroBatch) -> torch.Tensor:
    """Per-sample per-token values laid out like ``mb.action_targets``."""
    out = torch.zeros_like(mb.reply_mask)
    k = out.shape[1]
    for row, i in enumerate(mb.index):
        v = values[i]
        if v:
            out[row, k - len(v):] = torch.tensor(v, dtype=out.dtype)
    return out
