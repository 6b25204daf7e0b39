"""Scoring (training.scoring.score): an item equal to an earlier one is scored once, and on a CPU
no forward is wider than CPU_MICRO_BATCH_TOKENS padded tokens -- with the log-probs of each item
scored on its own."""

from __future__ import annotations

import random

import pytest
import torch

from serl_cli.models.loading import load_model
from serl_cli.training.scoring import CPU_MICRO_BATCH_TOKENS, ScoreItem, score


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    return model.eval(), tok


def items(n: int, vocab: int, seed: int = 0) -> list[ScoreItem]:
    rng = random.Random(seed)
    out = [
        ScoreItem(
            [rng.randrange(3, vocab) for _ in range(rng.randint(20, 90))], [rng.randrange(3, vocab) for _ in range(3)]
        )
        for _ in range(n)
    ]
    return out + [ScoreItem(list(it.prompt_ids), list(it.action_ids)) for it in out[::3]]  # equal items, later


class Forwards:
    """Counts the rows and padded tokens of each forward the model runs."""

    def __init__(self, model):
        self.shapes = []
        self.handle = model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        self.shapes.append(tuple(kwargs["input_ids"].shape))


def test_equal_items_are_scored_once_in_cpu_sized_micro_batches(model_and_tokenizer):
    model, tok = model_and_tokenizer
    batch = items(150, len(tok))
    forwards = Forwards(model)
    try:
        got = score(model, tok, batch, 1.0, 16384)
    finally:
        forwards.handle.remove()
    assert sum(rows for rows, _ in forwards.shapes) == 150  # the 50 repeats were not run again
    assert max(rows * width for rows, width in forwards.shapes) <= CPU_MICRO_BATCH_TOKENS
    assert len(forwards.shapes) > 1
    for it, lp in zip(batch, got, strict=True):
        alone = score(model, tok, [it], 1.0, 16384)[0]
        assert len(lp) == len(it.action_ids)
        assert torch.allclose(torch.tensor(lp), torch.tensor(alone), atol=1e-5)
    assert got[150:] == got[0:150:3]
    got[150][0] = 0.0
    assert got[0][0] != 0.0  # each item has its own list
