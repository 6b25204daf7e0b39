"""The torch training step: token log-probs of stored turns, micro-batched gradient accumulation.

Gradients accumulate over micro-batches and every loss is divided by the optimizer step's
action-token count (the learner's share of the update for one of ``train.mini_batches``), so
the step equals one full-batch step whatever the micro-batch size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

import torch

from serl_cli.algos.batch import MicroBatch
from serl_cli.models.device import autocast, model_device
from serl_cli.training.token_logprobs import token_logprobs
from serl_cli.training.train_config import OptimConfig, scheduled


# model: a Hugging Face model, its peft wrapper, or the DeepSpeed engine around one: Any
@overload
def action_logprobs(
    model: Any, mb: MicroBatch, temperature: float = ..., entropy: Literal[False] = ...
) -> torch.Tensor: ...
@overload
def action_logprobs(
    model: Any, mb: MicroBatch, temperature: float = ..., *, entropy: Literal[True]
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def action_logprobs(
    model: Any, mb: MicroBatch, temperature: float = ..., entropy: bool = ...
) -> Any: ...  # entropy not known statically: either of the above
def action_logprobs(
    model: Any, mb: MicroBatch, temperature: float = 1.0, entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log pi(a_k | prompt, a_<k) for the reply tokens of each row: [B, K] (0 where masked).

    ``entropy=True`` also gives the policy's entropy at each reply position, [B, K] (0 where
    masked, differentiable), from the same logits and temperature (the authors' entropy
    bonus, verl dp_actor.py:469-472): returns ``(logp, entropy)``. Both come from the logits a
    slice at a time (``training.token_logprobs``): no fp32 ``[B, K, V]`` copy is made or kept."""
    k = mb.reply_ids.shape[1]
    # the forward runs where the model lives, in its precision (models.device: autocast for
    # bf16/fp16, nothing for fp32); the [B, K] result comes back to the CPU, where every
    # objective's per-turn tensors are built (the copy is differentiable)
    device = model_device(model)
    # logits at position j predict token j+1: the K reply tokens need the K positions before them
    with autocast(model):
        out = model(
            input_ids=mb.input_ids.to(device),
            attention_mask=mb.attention_mask.to(device),
            position_ids=mb.position_ids.to(device),
            logits_to_keep=k + 1,
            use_cache=False,
        )
    logits, out = out.logits, None  # [B, K + 1, V]: its last position predicts past the reply
    result = token_logprobs(logits, mb.reply_ids.to(device), temperature, entropy)
    if not entropy:
        return result.cpu() * mb.reply_mask
    logp, ent = result
    return logp.cpu() * mb.reply_mask, ent.cpu() * mb.reply_mask


ADDITIVE_STATS = frozenset({"loss", "pg_loss", "kl_ref", "nll", "distill_kl", "entropy"})


LossFn = Callable[[MicroBatch, torch.Tensor, float], tuple[torch.Tensor, dict]]

T = TypeVar("T")


def made_by_wrap(part: T | None, what: str) -> T:
    """A backend's ``what`` (optimizer, engine), which its ``wrap(model)`` makes: before that, an error."""
    if part is None:
        raise RuntimeError(f"the training backend has no {what} before wrap(model)")
    return part


def forward(model: Any, mb: MicroBatch, temperature: float, entropy: bool) -> torch.Tensor:
    """The policy's log-probs of ``mb``'s reply tokens; with ``entropy`` the per-token
    entropy is put on ``mb.entropy`` for the loss to read."""
    if not entropy:
        return action_logprobs(model, mb, temperature)
    logp, mb.entropy = action_logprobs(model, mb, temperature, entropy=True)
    return logp


def accumulate_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    loss_fn: LossFn,
    num_tokens: float,
    temperature: float,
    grad_clip: float,
    entropy: bool = False,
    scaler: torch.amp.GradScaler | None = None,
) -> dict:
    """One optimizer step over ``micro_batches``; skipped (and reported) if the loss is not finite.
    ``entropy``: also compute the policy's entropy per reply token (``mb.entropy``). ``scaler``:
    fp16's ``torch.amp.GradScaler`` (the loss is scaled for backward and the gradients
    unscaled before clipping; a step whose gradients overflow is skipped and lowers the scale)."""
    optimizer.zero_grad(set_to_none=True)
    stats: dict[str, float] = {}
    total_loss = 0.0
    run_tokens = sum(mb.reply_mask.sum().item() for mb in micro_batches)  # the turns run, not the skipped ones
    for mb in micro_batches:
        logp = forward(model, mb, temperature, entropy)
        loss, s = loss_fn(mb, logp, num_tokens)
        if not torch.isfinite(loss):
            optimizer.zero_grad(set_to_none=True)
            return {"skipped": 1.0, "loss": float("nan")}
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total_loss += loss.item()
        share = mb.reply_mask.sum().item() / max(run_tokens, 1)
        for key, v in s.items():
            # loss terms are already divided by the batch's token count: they add up;
            # per-micro-batch means (clip_frac, ratio_mean, ...) are averaged by token share
            stats[key] = stats.get(key, 0.0) + (v if key in ADDITIVE_STATS else v * share)
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.requires_grad], grad_clip if grad_clip > 0 else math.inf
    )
    if not torch.isfinite(grad_norm):
        if scaler is not None:
            scaler.update()  # the overflow was recorded by unscale_: the next step runs at a lower scale
        optimizer.zero_grad(set_to_none=True)
        return {"skipped": 1.0, "loss": total_loss, "grad_norm": float("nan")}
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    stats.update(loss=total_loss, grad_norm=float(grad_norm), skipped=0.0)
    return stats


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (all of them, or only the adapters under LoRA)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, foreach=False)


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """The multiple of ``cfg.lr`` the optimizer step after ``step`` applied steps runs at:
    transformers' ``get_{constant,linear,cosine}_schedule_with_warmup`` (a linear warmup from 0,
    then constant, or down to 0 at ``total_steps``), except that cosine stays at 0 past
    ``total_steps`` rather than rising again."""
    if step < cfg.warmup_steps:
        return step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The lr schedule of ``optimizer`` (stepped once per applied optimizer step; its state is
    resume state), or None when the lr never changes: no scheduler, not a constant one."""
    if not scheduled(cfg):
        return None
    # a closure, not a callable object: LambdaLR's state_dict then holds only the step count,
    # so a resumed run follows the schedule its settings give now
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
