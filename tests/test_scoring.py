"""Scoring (training.scoring.score): an item equal to an earlier one is scored once, and on a CPU
no forward is wider than CPU_MICRO_BATCH_TOKENS padded tokens -- with the log-probs of each item
scored on its own."""

from __future__ import annotations

import random

import pytest
import torch

from serl_cli.models.loading import load_model
from serl_cli.training.scoring import CPU_MICRO_BATCH_TOKENS, ScoreItem, deal, own_items, plan, score


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


def test_micro_batches_are_dealt_largest_first_in_a_snake():
    # sizes by rank of size: 50 (b4), 40 (b1), 30 (b2), 20 (b3), 10 (b0); laps 0, 1, 2 go 0-1, 1-0, 0-
    assert deal([10, 40, 30, 20, 50], 2) == [[4, 3, 0], [1, 2]]
    assert deal([5, 5, 5], 4) == [[0], [1], [2], []]  # ties in index order; a process may have none
    assert deal([], 3) == [[], [], []]


def test_dealt_counts_differ_by_one_and_tokens_by_the_largest_batch():
    rng = random.Random(1)
    for world in (2, 3, 6):
        sizes = [rng.choice([64, 512, 4096]) * rng.randint(1, 4) for _ in range(rng.randint(world, 40))]
        dealt = deal(sizes, world)
        assert sorted(b for d in dealt for b in d) == list(range(len(sizes)))
        counts = [len(d) for d in dealt]
        tokens = [sum(sizes[b] for b in d) for d in dealt]
        assert max(counts) - min(counts) <= 1
        assert max(tokens) - min(tokens) <= max(sizes)


class ProcessGroup:
    """The backend's process-group face (rank, world, all_gather) for ``world`` processes run one
    after the other in this test: each publishes its part on ``board``; a process whose all_gather
    comes before every part is published stops there (``Unpublished``)."""

    collective_forward = False

    def __init__(self, rank: int, world: int, board: dict):
        self.rank, self.world, self.board = rank, world, board

    def all_gather(self, obj) -> list:
        self.board[self.rank] = dict(obj)  # as sent: the gatherer's later updates are its own
        if len(self.board) < self.world:
            raise Unpublished
        return [self.board[r] for r in range(self.world)]


class Unpublished(Exception):
    pass


def test_processes_score_disjoint_shares_and_return_one_process_bit_for_bit(model_and_tokenizer):
    model, tok = model_and_tokenizer
    batch = items(90, len(tok), seed=3)  # 90 distinct items and 30 repeats
    alone = score(model, tok, batch, 1.0, 1024)
    for world in (2, 3):
        board: dict = {}
        rows = []
        for rank in range(world):
            forwards = Forwards(model)
            try:
                got = score(model, tok, batch, 1.0, 1024, ranks=ProcessGroup(rank, world, board))
            except Unpublished:
                got = None
            finally:
                forwards.handle.remove()
            rows.append(sum(r for r, _ in forwards.shapes))
            assert rows[-1] == own_items(model, batch, 1024, rank, world) > 0
        assert sum(rows) == 90  # each distinct item scored once, by one process
        keys = [i for part in board.values() for i in part]
        assert len(keys) == len(set(keys)) == 90  # disjoint shares
        assert got == alone  # the last process, every part gathered: one process's log-probs, bit for bit


def test_a_batch_too_few_for_the_processes_is_split_so_that_each_works(model_and_tokenizer):
    model, tok = model_and_tokenizer
    batch = items(6, len(tok), seed=5)[:6]  # 6 items, one CPU micro-batch for one process
    assert len(plan(model, batch, 16384)[0]) == 1
    alone = score(model, tok, batch, 1.0, 16384)
    board: dict = {}
    for rank in range(2):
        assert own_items(model, batch, 16384, rank, 2) > 0
        try:
            got = score(model, tok, batch, 1.0, 16384, ranks=ProcessGroup(rank, 2, board))
        except Unpublished:
            pass
    for a, b in zip(got, alone, strict=True):  # other batches: the same log-probs up to float noise
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
