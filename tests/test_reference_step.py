"""The executable spec (method/reference_step.py) equals what the pipeline trains on.

The pipeline path is the one ``serl train --algo serl`` runs: ``annotate_episodes`` (teacher
scores of left-padded micro-batches), the ``serl`` objective's prepare, ``make_micro_batches``
and ``accumulate_step``. The reference recomputes everything turn by turn, unpadded. Loss
and gradient must agree to float32 round-off.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from support import rollout_config

from serl_cli.algos.batch import make_micro_batches
from serl_cli.algos.objectives import UpdateInputs, get_objective
from serl_cli.artifacts import io
from serl_cli.artifacts.schema import read_rollouts, turn_samples
from serl_cli.method.annotation import AnnotateConfig, annotate_episodes
from serl_cli.method.reference_step import reference_step
from serl_cli.models.loading import load_model
from serl_cli.stages.rollout import run_rollout
from serl_cli.training.step import OptimConfig, accumulate_step
from serl_cli.training.train_config import TrainConfig


@pytest.fixture(scope="module")
def group(stopping_model_dir, tmp_path_factory):
    """One task x 4 rollouts of the tiny model; rollouts 0 and 2 are marked successful."""
    run = tmp_path_factory.mktemp("refstep") / "run"
    run_rollout(rollout_config(stopping_model_dir, run, tasks=1, group_size=4, max_new_tokens=12))
    episodes = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    for ep in episodes:
        if ep["rollout_index"] % 2 == 0:
            ep["reward"], ep["success"] = 1.0, True
    io.write_jsonl(run / "rollouts.jsonl", episodes)
    return read_rollouts(run)


def pipeline_loss_and_grads(policy, teacher, tokenizer, episodes, acfg):
    records, stats = annotate_episodes(episodes, acfg, teacher, tokenizer, env_cfg=None)
    tcfg = TrainConfig(algo="serl", optim=OptimConfig(lr=0.0, micro_batch_tokens=400))
    objective = get_objective("serl")
    samples = turn_samples(episodes)
    prepared = objective.prepare(samples, UpdateInputs(episodes, records, io.to_plain(acfg), stats), tcfg)
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids) + len(samples[i].action_ids))
    micro_batches = make_micro_batches(samples, order, tcfg.optim.micro_batch_tokens, tokenizer.pad_token_id, prepared)
    num_tokens = float(sum(len(s.action_ids) for s in samples))
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)  # lr 0: the step leaves the weights alone

    def loss_fn(mb, logp, n_tokens):
        return objective.loss(mb, logp, tcfg, num_tokens=n_tokens)

    stats = accumulate_step(policy, optimizer, micro_batches, loss_fn, num_tokens, temperature=1.0, grad_clip=0.0)
    reweighted = sum(1 for r in records if r.weights and any(abs(w - 1) > 1e-9 for w in r.weights))
    return stats["loss"], [p.grad.clone() for p in policy.parameters()], len(micro_batches), reweighted


# the random model's replies hold no action: unparsed=whole weights them whole, so the teacher is in play;
# the defaults (none) leave them at 1; update_step 50 is lambda 0 (no teacher at all)
@pytest.mark.parametrize(
    "sources, placement, unparsed, update_step",
    [
        ("obs", "all", "whole", 0),
        ("error", "feedback", "whole", 0),
        ("diff", "random", "whole", 0),
        ("obs", "all", "none", 0),
        ("obs", "all", "whole", 50),
    ],
)
def test_reference_step_equals_the_pipeline(group, stopping_model_dir, sources, placement, unparsed, update_step):
    teacher, tokenizer = load_model(str(stopping_model_dir))
    teacher.eval()
    policy = copy.deepcopy(teacher)
    torch.manual_seed(0)
    with torch.no_grad():  # a policy one update away from the behaviour policy: ratios differ from 1
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    acfg = AnnotateConfig(
        sources=sources, placement=placement, seed=3, unparsed=unparsed, update_step=update_step, teacher_signal=False
    )

    loss, grads, n_micro, reweighted = pipeline_loss_and_grads(policy, teacher, tokenizer, group, acfg)
    assert n_micro > 1  # the pipeline really accumulated over several padded micro-batches
    if placement == "all" and unparsed == "whole" and update_step == 0:
        assert reweighted > 0  # the teacher's weights are in play, not all 1

    policy.zero_grad(set_to_none=True)
    ref = reference_step(policy, teacher, tokenizer, group, acfg)
    ref.backward()
    assert ref.item() == pytest.approx(loss, rel=1e-4, abs=1e-6)
    for g_pipe, p in zip(grads, policy.parameters(), strict=True):
        torch.testing.assert_close(p.grad, g_pipe, rtol=1e-3, atol=1e-6)
