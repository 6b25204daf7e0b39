"""LoRA via peft: only adapter weights train (torch and DeepSpeed backends), saved adapters
and merged checkpoints reload and reproduce the policy's log-probs, the KL reference is the
start (adapters off), the teacher snapshot scores with the adapter as it was at the sync."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from deepspeed_worker import make_episodes, train_config

from serl_cli.errors import SerlError
from serl_cli.method.teacher import TeacherSnapshot
from serl_cli.models.loading import load_model
from serl_cli.training.learner import Learner
from serl_cli.training.scoring import ScoreItem, score

BACKENDS = [
    "torch",
    pytest.param(
        "deepspeed",
        marks=pytest.mark.skipif(
            __import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
        ),
    ),
]


def lora_config(backend="torch", save="merged", kl_coef=0.0):
    cfg = train_config(backend, 2 if backend == "deepspeed" else None, lora_rank=4, kl_coef=kl_coef)
    cfg.optim.lr = 1e-3  # adapters start at B = 0: a larger step makes the change plain
    cfg.lora.save = save
    return cfg


def items(episodes):
    return [ScoreItem(t.prompt_ids, t.action_ids) for e in episodes for t in e.turns]


def logprobs(model, tokenizer, episodes):
    return torch.tensor([x for row in score(model, tokenizer, items(episodes)) for x in row])


@pytest.fixture(scope="module")
def episodes(tiny_model_dir):
    return make_episodes(str(tiny_model_dir))


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_adapter_weights_change(tiny_model_dir, episodes, backend):
    learner = Learner(str(tiny_model_dir), lora_config(backend))
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    trainable = {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    metrics = learner.update(episodes, 1.0)
    assert metrics["optimizer_steps"] == 1 and metrics["skipped_steps"] == 0
    after = dict(learner.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed and changed <= trainable
    assert any(".lora_B." in n for n in changed)  # B left zero: the policy itself moved


@pytest.mark.parametrize("save", ["adapter", "merged"])
def test_saved_checkpoint_reproduces_logprobs(tiny_model_dir, episodes, tmp_path, save):
    learner = Learner(str(tiny_model_dir), lora_config(save=save))
    learner.update(episodes, 1.0)
    expected = logprobs(learner.model, learner.tokenizer, episodes)
    start, _ = load_model(str(tiny_model_dir))
    assert (expected - logprobs(start, learner.tokenizer, episodes)).abs().max() > 1e-3  # training changed them
    ckpt = learner.save(tmp_path / "ckpt")
    assert (ckpt / ("adapter_config.json" if save == "adapter" else "adapter/adapter_config.json")).is_file()
    assert (ckpt / "config.json").is_file() == (save == "merged")
    reloaded, tokenizer = load_model(str(ckpt))  # what serl eval / serl rollout do
    assert type(reloaded).__name__ == "Qwen2ForCausalLM"
    assert torch.allclose(logprobs(reloaded, tokenizer, episodes), expected, atol=1e-5)
    # resuming puts the same adapter back, trainable, on the same base
    resumed = Learner(str(ckpt), lora_config(save=save), state_file=ckpt / "trainer_state.pt")
    assert resumed.updates == 1
    assert torch.allclose(logprobs(resumed.model, resumed.tokenizer, episodes), expected, atol=1e-6)


def test_reference_is_the_start_and_teacher_is_the_synced_adapter(tiny_model_dir, episodes):
    learner = Learner(str(tiny_model_dir), lora_config(kl_coef=0.1))
    assert learner.reference is None  # no second copy: the adapters are switched off instead
    start, tokenizer = load_model(str(tiny_model_dir))
    start_lp = logprobs(start, tokenizer, episodes)
    teacher = TeacherSnapshot(learner)
    metrics = learner.update(episodes, 1.0)
    assert metrics["kl_ref"] == 0.0  # the first step starts at the reference
    second = learner.update(episodes, 1.0)
    assert second["kl_ref"] > 0.0
    live = logprobs(learner.model, tokenizer, episodes)
    from serl_cli.training.lora import reference_view

    with reference_view(learner.model) as base:
        assert torch.allclose(logprobs(base, tokenizer, episodes), start_lp, atol=1e-6)
    with teacher.scoring() as t:
        assert torch.allclose(logprobs(t, tokenizer, episodes), start_lp, atol=1e-6)  # synced before the updates
    assert torch.equal(logprobs(learner.model, tokenizer, episodes), live)  # the live adapter is back


def test_bad_lora_settings(tiny_model_dir):
    cfg = lora_config()
    cfg.lora.save = "both"
    with pytest.raises(SerlError, match="unknown train.lora.save 'both'"):
        Learner(str(tiny_model_dir), cfg)
    cfg = lora_config()
    cfg.lora.targets = "no_such_proj"
    with pytest.raises(SerlError, match="train.lora.targets 'no_such_proj'"):
        Learner(str(tiny_model_dir), cfg)
