"""The torch training backend: token log-probs of stored turns, micro-batched updates.

A turn's training sequence is exactly ``prompt_ids + action_ids`` as stored at rollout
time. Sequences are left-padded with position ids counted from each row's first real
token -- the layout ``generate`` used -- so the action tokens sit in the last columns and
the LM head runs only there (``logits_to_keep``). Gradients accumulate over micro-batches
and every loss is divided by the whole batch's action-token count, so the update equals
one full-batch step whatever the micro-batch size.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from serl_cli.schema import TurnSample


@dataclass
class OptimConfig:
    lr: float = 1e-6  # the paper's setting for 7B models; tiny-model configs raise it
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    grad_clip: float = 1.0
    micro_batch_tokens: int = 16384  # padded tokens per forward pass: bounds memory


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L] left-padded prompt + action
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    action_mask: torch.Tensor  # [B, K] over the last K positions: 1 on action tokens
    action_targets: torch.Tensor  # [B, K] the action token ids, right-aligned
    index: list[int]  # which samples (positions in the full list)


def make_micro_batches(samples: list[TurnSample], order: list[int], max_tokens: int, pad_id: int) -> list[MicroBatch]:
    """Group samples (in ``order``) into left-padded micro-batches of at most ``max_tokens`` padded tokens."""
    batches, current = [], []
    width = 0
    for i in order:
        length = len(samples[i].prompt_ids) + len(samples[i].action_ids)
        if current and max(width, length) * (len(current) + 1) > max_tokens:
            batches.append(_collate(samples, current, pad_id))
            current, width = [], 0
        current.append(i)
        width = max(width, length)
    if current:
        batches.append(_collate(samples, current, pad_id))
    return batches


def _collate(samples: list[TurnSample], index: list[int], pad_id: int) -> MicroBatch:
    seqs = [samples[i].prompt_ids + samples[i].action_ids for i in index]
    width = max(len(s) for s in seqs)
    k = max(len(samples[i].action_ids) for i in index)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    amask = torch.zeros((len(seqs), k), dtype=torch.float32)
    targets = torch.full((len(seqs), k), pad_id, dtype=torch.long)
    for row, (i, s) in enumerate(zip(index, seqs)):
        ids[row, width - len(s):] = torch.tensor(s)
        attn[row, width - len(s):] = 1
        a = samples[i].action_ids
        amask[row, k - len(a):] = 1.0
        targets[row, k - len(a):] = torch.tensor(a)
    positions = (attn.cumsum(-1) - 1).clamp_min(0)
    return MicroBatch(ids, attn, positions, amask, targets, list(index))


def action_logprobs(model, mb: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """log pi(a_k | prompt, a_<k) for the action tokens of each row: [B, K] (0 where masked)."""
    k = mb.action_targets.shape[1]
    # the forward runs where the model lives; the [B, K] result comes back to the CPU, where
    # every objective's per-turn tensors are built (the copy is differentiable)
    device = getattr(model, "device", None) or torch.device("cpu")
    # logits at position j predict token j+1: the K action tokens need the K positions before them
    out = model(input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device),
                position_ids=mb.position_ids.to(device), logits_to_keep=k + 1, use_cache=False)
    logits = out.logits[:, :-1, :].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, mb.action_targets.to(device).unsqueeze(-1)).squeeze(-1)
    return logp.cpu() * mb.action_mask


def pad_right_aligned(values: list[list[float]], mb: MicroBatch) -> torch.Tensor:
    """Per-sample per-token values laid out like ``mb.action_targets``."""
    out = torch.zeros_like(mb.action_mask)
    k = out.shape[1]
    for row, i in enumerate(mb.index):
        v = values[i]
        if v:
            out[row, k - len(v):] = torch.tensor(v, dtype=out.dtype)
    return out


ADDITIVE_STATS = frozenset({"loss", "pg_loss", "kl_ref", "nll", "distill_kl"})
LossFn = Callable[[MicroBatch, torch.Tensor, float], tuple[torch.Tensor, dict]]


def accumulate_step(model, optimizer, micro_batches: list[MicroBatch], loss_fn: LossFn, num_tokens: float,
                    temperature: float, grad_clip: float) -> dict:
    """One optimizer step over ``micro_batches``; skipped (and reported) if the loss is not finite."""
    optimizer.zero_grad(set_to_none=True)
    stats: dict[str, float] = {}
    total_loss = 0.0
    run_tokens = sum(mb.action_mask.sum().item() for mb in micro_batches)  # the turns run, not the skipped ones
    for mb in micro_batches:
        logp = action_logprobs(model, mb, temperature)
        loss, s = loss_fn(mb, logp, num_tokens)
        if not torch.isfinite(loss):
            optimizer.zero_grad(set_to_none=True)
            return {"skipped": 1.0, "loss": float("nan")}
        loss.backward()
        total_loss += loss.item()
        share = mb.action_mask.sum().item() / max(run_tokens, 1)
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


def save_checkpoint(model, tokenizer, path: str | Path, extra_state: dict | None = None,
                    extra_files: dict[str, str] | None = None) -> Path:
    """A Hugging Face model directory (safetensors), written to a temp sibling then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        write_model_files(model, tokenizer, tmp, extra_state=extra_state, extra_files=extra_files)
        commit_dir(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return path


def write_model_files(model, tokenizer, directory: Path, *, state_dict: dict | None = None,
                      extra_state: dict | None = None, extra_files: dict[str, str] | None = None) -> None:
    """``model`` (or ``state_dict`` in ``model``'s architecture) and ``tokenizer`` into ``directory``."""
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    if extra_state is not None:
        torch.save(extra_state, directory / "trainer_state.pt")
    for name, text in (extra_files or {}).items():
        (directory / name).write_text(text, encoding="utf-8")


def commit_dir(tmp: Path, path: Path) -> None:
    """Put the finished ``tmp`` in place of ``path``: the old version is moved aside first
    and removed last, so a crash leaves one whole version."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
    tmp.rename(path)
    if old is not None:
        shutil.rmtree(old)
