"""The hindsight teacher is never a second model: a snapshot of what an update changes, copied
into the live network while it scores and copied back after (method.teacher.TeacherSnapshot).

On the torch backend (the snapshot in CPU memory) and under ZeRO-3 (each process's own
partitions; one process here, the ZeRO-3 gathers on): scoring with the teacher after two
updates gives the starting policy's log-probs, the live weights come back bit for bit, and a
saved snapshot loads into a fresh learner exactly.
"""

from __future__ import annotations

import pytest
import torch
from deepspeed_worker import full_parameters, make_episodes, train_config

from serl_cli.method.teacher import TeacherSnapshot
from serl_cli.models.loading import load_model
from serl_cli.training.learner import Learner
from serl_cli.training.scoring import ScoreItem, score

BACKENDS = [
    ("torch", None),
    pytest.param(
        "deepspeed",
        3,
        marks=pytest.mark.skipif(
            __import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
        ),
    ),
]


def logprobs(model, tokenizer, episodes, ranks=None) -> torch.Tensor:
    items = [ScoreItem(t.prompt_ids, t.action_ids) for e in episodes for t in e.turns]
    return torch.tensor([x for row in score(model, tokenizer, items, ranks=ranks) for x in row])


@pytest.mark.parametrize("backend, stage", BACKENDS)
def test_the_teacher_scores_as_the_synced_policy_and_puts_the_live_one_back(tiny_model_dir, tmp_path, backend, stage):
    episodes = make_episodes(str(tiny_model_dir))
    cfg = train_config(backend, stage)
    cfg.optim.lr = 1e-3  # the policy moves plainly away from the snapshot
    learner = Learner(str(tiny_model_dir), cfg)
    teacher = TeacherSnapshot(learner)
    assert all(t.device.type == "cpu" for t in teacher.saved.values())
    if stage == 3:  # sharded like the policy: this process's partitions, not whole weights
        partitions = sum(p.ds_tensor.numel() for p in learner.model.parameters())
        assert sum(t.numel() for t in teacher.saved.values()) == partitions
    for _ in range(2):
        learner.update(episodes, 1.0)
    start, tokenizer = load_model(str(tiny_model_dir))
    expected = logprobs(start, tokenizer, episodes)
    live_weights = full_parameters(learner)
    live = logprobs(learner.model, tokenizer, episodes, learner.backend)
    assert (live - expected).abs().max() > 1e-3  # the updates moved the policy
    with teacher.scoring() as model:
        assert torch.allclose(logprobs(model, tokenizer, episodes, learner.backend), expected, atol=1e-5)
    after = full_parameters(learner)
    assert all(torch.equal(after[n], p) for n, p in live_weights.items())  # bit for bit
    assert torch.equal(logprobs(learner.model, tokenizer, episodes, learner.backend), live)

    # resume: a saved snapshot loads into a fresh learner and scores the same
    teacher.save(tmp_path)
    again = Learner(str(tiny_model_dir), cfg)
    restored = TeacherSnapshot(again)
    again.update(episodes, 1.0)
    assert restored.load(tmp_path)
    with restored.scoring() as model:
        assert torch.allclose(logprobs(model, tokenizer, episodes, again.backend), expected, atol=1e-5)
