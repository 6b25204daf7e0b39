"""The torch training step: token log-probs of stored turns, micro-batched gradient accumulation.

Gradients accumulate over micro-batches and every loss is divided by the whole batch's
action-token count, so the update equals one full-batch step whatever the micro-batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from serl_cli.algos.batch import MicroBatch


@dataclass
class OptimConfig:
    lr: float = 1e-6  # the paper's setting for 7B models; tiny-model configs raise it
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    grad_clip: float = 1.0
    micro_batch_tokens: int = 16384  # padded tokens per forward pass: bounds memory



def action_logprobs(model, mb: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """log pi(a_k | prompt, a_<k) for the reply tokens of each row: [B, K] (0 where masked)."""
    k = mb.reply_ids.shape[1]
    # the forward runs where the model lives; the [B, K] result comes back to the CPU, where
    # every objective's per-turn tensors are built (the copy is differentiable)
    device = getattr(model, "device", None) or torch.device("cpu")
    # logits at position j predict token j+1: the K reply tokens need the K positions before them
    out = model(input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device),
                position_ids=mb.position_ids.to(device), logits_to_keep=k + 1, use_cache=False)
    logits = out.logits[:, :-1, :].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, mb.reply_ids.to(device).unsqueeze(-1)).squeeze(-1)
    return logp.cpu() * mb.reply_mask



ADDITIVE_STATS = frozenset({"loss", "pg_loss", "kl_ref", "nll", "distill_kl"})



LossFn = Callable[[MicroBatch, torch.Tensor, float], tuple[torch.Tensor, dict]]



def accumulate_step(model, optimizer, micro_batches: list[MicroBatch], loss_fn: LossFn, num_tokens: float,
                    temperature: float, grad_clip: float) -> dict:
    """One optimizer step over ``micro_batches``; skipped (and reported) if the loss is not finite."""
    optimizer.zero_grad(set_to_none=True)
    stats: dict[str, float] = {}
    total_loss = 0.0
    run_tokens = sum(mb.reply_mask.sum().item() for mb in micro_batches)  # the turns run, not the skipped ones
    for mb in micro_batches:
        logp = action_logprobs(model, mb, temperature)
        loss, s = loss_fn(mb, logp, num_tokens)
        if not torch.isfinite(loss):
            optimizer.zero_grad(set_to_none=True)
            return {"skipped": 1.0, "loss": float("nan")}
        loss.backward()
        total_loss += loss.item()
        share = mb.reply_mask.sum().item() / max(run_tokens, 1)
        for key, v in s.items():
            # loss terms are already divided by the batch's token count: they add up;
            # per-micro-batch means (clip_frac, ratio_mean, ...) are averaged by token share
            stats[key] = stats.get(key, 0.0) + (v if key in ADDITIVE_STATS else v * share)
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                               grad_clip if grad_clip > 0 else math.inf)
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return {"skipped": 1.0, "loss": total_loss, "grad_norm": float("nan")}
    optimizer.step()
    stats.update(loss=total_loss, grad_norm=float(grad_norm), skipped=0.0)
    return stats



def make_optimizer(model, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (all of them, or only the adapters under LoRA)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, foreach=False)
