"""A NaN or inf loss: that optimizer step is skipped (parameters untouched) and counted in
the update's metrics; the other steps apply. Injected through a real objective wrapped to
return a non-finite loss on chosen steps."""

from __future__ import annotations

import math

import pytest
import torch
from support import rollout_config, synthetic_env

from serl_cli.algos import objectives, registry
from serl_cli.artifacts.schema import read_rollouts
from serl_cli.stages.rollout import run_rollout
from serl_cli.training.learner import Learner
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig

POISON = {1: float("nan"), 3: float("inf")}  # optimizer step -> what its loss becomes


@pytest.fixture(scope="module")
def episodes(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "expert"
    run_rollout(
        rollout_config(tiny_model_dir, out, policy="expert", tasks=2, group_size=1, env=synthetic_env(max_turns=4))
    )
    return read_rollouts(out)


def test_nonfinite_steps_are_skipped_and_logged(tiny_model_dir, episodes, monkeypatch):
    cfg = TrainConfig(algo="sft-poisoned", optim=OptimConfig(lr=1e-3), mini_batches=4, threads=1)
    learner = Learner(str(tiny_model_dir), TrainConfig(algo="sft", optim=cfg.optim, threads=1))
    learner.cfg = cfg
    sft = objectives.get_objective("sft")
    before_step: list[dict[str, torch.Tensor]] = []  # parameters as each optimizer step starts

    def poisoned_loss(mb, logp, cfg_, **norms):
        # one micro-batch per step here, so the k-th call is the k-th optimizer step
        before_step.append({k: v.detach().clone() for k, v in learner.model.named_parameters()})
        loss, stats = sft.loss(mb, logp, cfg_, **norms)
        step = len(before_step) - 1
        return (loss * POISON[step] if step in POISON else loss), stats

    monkeypatch.setitem(
        registry.OBJECTIVES,
        cfg.algo,
        registry.Objective(cfg.algo, sft.prepare, poisoned_loss, uses_behaviour_logprobs=False),
    )
    metrics = learner.update(episodes, 1.0)
    after = {k: v.detach().clone() for k, v in learner.model.named_parameters()}
    snapshots = before_step + [after]
    assert len(before_step) == 4 == metrics["optimizer_steps"]
    changed = [any(not torch.equal(snapshots[i][k], snapshots[i + 1][k]) for k in after) for i in range(4)]
    assert changed == [True, False, True, False]  # steps 1 (NaN) and 3 (inf) left every parameter as it was
    assert metrics["skipped_steps"] == 2
    assert all(math.isfinite(p.abs().sum().item()) for p in learner.model.parameters())
