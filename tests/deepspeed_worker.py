"""A fixed GRPO batch trained for a few updates on a chosen backend: the body of the
DeepSpeed equivalence tests, run in-process (one process) or under torchrun (several).

    torchrun --nproc_per_node 2 tests/deepspeed_worker.py MODEL_DIR OUT.pt --backend deepspeed --zero-stage 2

Writes (on rank 0) the per-update losses and the parameters after the last update.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serl_cli.training.deepspeed_config import DeepSpeedConfig
from serl_cli.training.learner import Learner
from serl_cli.training.lora import LoraConfig
from serl_cli.training.scoring import ScoreItem, score
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig


def make_episodes(model_dir: str, seed: int = 0, groups: int = 2, group_size: int = 4) -> list[dict]:
    """Random prompts and replies over the tokenizer's ids, scored by the model itself for
    the behaviour log-probs; in each group the first half succeeds. Lengths vary, so the
    micro-batches of a small token budget differ in count and width."""
    from serl_cli.artifacts.records import make_episode, make_turn
    from serl_cli.models.loading import load_model

    model, tokenizer = load_model(model_dir)
    model.eval()
    rng = random.Random(seed)
    vocab = len(tokenizer)
    episodes = []
    for g in range(groups):
        for r in range(group_size):
            turns = []
            for t in range(1 + (r + g) % 2):
                prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(12, 30))]
                action = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
                turns.append(make_turn(turn=t, prompt_ids=prompt, action_ids=action, state_key=f"{g}-{t}"))
            win = r < group_size // 2
            episodes.append(make_episode(turns, task_id=g, group_id=g, rollout_index=r, reward=float(win), success=win))
    items = [ScoreItem(t.prompt_ids, t.action_ids) for e in episodes for t in e.turns]
    logps = iter(score(model, tokenizer, items))
    for e in episodes:
        for t in e.turns:
            t.behaviour_logprobs = next(logps)
    return episodes


def train_config(
    backend: str = "torch",
    zero_stage: int | None = None,
    lora_rank: int = 0,
    kl_coef: float = 0.0,
    micro_batch_tokens: int = 80,
) -> TrainConfig:
    return TrainConfig(
        algo="grpo",
        backend=backend,
        seed=0,
        threads=1,
        kl_coef=kl_coef,
        deepspeed=DeepSpeedConfig(zero_stage=zero_stage),
        lora=LoraConfig(rank=lora_rank, alpha=16.0),
        optim=OptimConfig(lr=1e-5, micro_batch_tokens=micro_batch_tokens),
    )


def full_parameters(learner: Learner) -> dict[str, torch.Tensor]:
    with learner.full_model() as module:
        return {n: p.detach().clone().float() for n, p in module.named_parameters()}


def run(model_dir: str, cfg: TrainConfig, updates: int = 3) -> dict:
    episodes = make_episodes(model_dir)
    learner = Learner(model_dir, cfg)
    losses = [learner.update(episodes, 1.0)["loss"] for _ in range(updates)]
    return {"losses": losses, "params": full_parameters(learner), "is_main": learner.is_main}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--backend", default="deepspeed")
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--updates", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = run(args.model_dir, train_config(args.backend, args.zero_stage), args.updates)
    if result.pop("is_main"):
        torch.save(result, args.out)


if __name__ == "__main__":
    main()
