"""The weights an engine with its own copy (vLLM) is sent after an update: streamed one at a
time (``Learner.stream_weights``) -- under ZeRO-3 each gathered alone, under LoRA merged one
layer at a time -- and equal to what a checkpoint of the policy holds."""

from __future__ import annotations

import pytest
import torch
from deepspeed_worker import full_parameters, make_episodes, train_config

from serl_cli.training.learner import Learner

needs_deepspeed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
)


def streamed(learner: Learner) -> dict[str, torch.Tensor]:
    # each tensor is valid until the next is asked for: copy it, as the engine's transport does
    return {name: t.detach().clone().float() for name, t in learner.stream_weights()}


@pytest.mark.parametrize("backend, stage", [("torch", None), pytest.param("deepspeed", 3, marks=needs_deepspeed)])
def test_the_stream_is_the_policy_one_weight_at_a_time(tiny_model_dir, backend, stage):
    learner = Learner(str(tiny_model_dir), train_config(backend, stage))
    learner.update(make_episodes(str(tiny_model_dir)), 1.0)
    sent = streamed(learner)
    whole = full_parameters(learner)
    assert sent.keys() == whole.keys() and "lm_head.weight" not in sent  # a tied head is the embedding's
    assert all(torch.equal(sent[k], whole[k]) for k in whole)
    assert learner.largest_weight() == max(t.numel() for t in whole.values())


def test_lora_streams_the_merged_weights_layer_by_layer(tiny_model_dir):
    pytest.importorskip("peft")
    from serl_cli.training.lora import merged_state_dict

    cfg = train_config("torch", lora_rank=4)
    cfg.optim.lr = 1e-2  # B moves off 0: the merge changes the weights
    learner = Learner(str(tiny_model_dir), cfg)
    learner.update(make_episodes(str(tiny_model_dir)), 1.0)
    merged = merged_state_dict(learner.model)
    sent = streamed(learner)
    assert set(sent) == set(merged) - {"lm_head.weight"}
    assert all(torch.equal(sent[k], merged[k].float()) for k in sent)
    base = dict(learner.model.get_base_model().named_parameters())
    assert not torch.equal(
        sent["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.base_layer.weight"]
    )
