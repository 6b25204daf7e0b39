"""Log-probs of chosen tokens, and the policy's entropy, from a model's logits, a slice of positions at a time.

``log_softmax`` over a whole ``[B, K, V]`` batch of logits keeps an fp32 copy of it for the
backward pass, and the entropy two more: at 16k positions and Qwen's 152k vocabulary that is
10 GB a copy. Here the forward pass works through :data:`CHUNK_ELEMENTS` logits at a time and
keeps only the logits themselves (the model's output, in its own dtype); the backward pass
recomputes each slice's softmax and writes its gradient into one tensor the size of the logits.
So the extra memory is a few slices' worth, whatever the micro-batch and the vocabulary.

The gradients are the closed forms of the same functions: for ``lp = log_softmax(z)``,
``z = logits / T``, ``d lp[a] / dz = onehot(a) - p`` and, for the entropy
``H = -sum(p * lp)``, ``dH / dz = -p * (lp + H)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, overload

import torch

from serl_cli.training.memory import LOGIT_SLICE_ELEMENTS

CHUNK_ELEMENTS = LOGIT_SLICE_ELEMENTS  # logits per slice: 32 MB in fp32 (about 55 positions of a 152k vocabulary)


def positions_per_chunk(vocab: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, chunk_elements // max(vocab, 1))


def slices(batch: int, length: int, step: int) -> Iterator[tuple[slice, slice]]:
    """(rows, positions) slices of ``batch`` rows x ``length`` positions holding at most ``step``
    positions each: several whole rows at a time where a row is shorter than ``step``, else
    ``step`` positions of one row."""
    if length >= step:
        for b in range(batch):
            for j in range(0, length, step):
                yield slice(b, b + 1), slice(j, min(j + step, length))
        return
    rows = max(1, step // max(length, 1))
    for b in range(0, batch, rows):
        yield slice(b, min(b + rows, batch)), slice(0, length)


class TokenLogprobs(torch.autograd.Function):
    """``(log_softmax(logits[:, :K] / T)[targets], entropy)``, both ``[B, K]`` fp32, for logits
    ``[B, S, V]`` with ``S >= K`` (positions from K on get no gradient); ``entropy`` is None
    unless asked for."""

    @staticmethod
    # ctx: the context autograd makes, which keeps what is set on it for backward: Any
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, step: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length = targets.shape
        logp = torch.empty((batch, length), dtype=torch.float32, device=logits.device)
        ent = torch.empty_like(logp) if with_entropy else None
        for rows, cols in slices(batch, length, step):
            lp = torch.log_softmax(logits[rows, cols].float() / temperature, dim=-1)
            logp[rows, cols] = lp.gather(-1, targets[rows, cols].unsqueeze(-1)).squeeze(-1)
            if ent is not None:
                ent[rows, cols] = -(lp.exp() * lp).sum(-1)
        ctx.save_for_backward(logits, targets, ent)
        ctx.temperature, ctx.step = temperature, step
        return logp, ent

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None, None]:
        logits, targets, ent = ctx.saved_tensors
        batch, length = targets.shape
        if grad_logp is None:  # only the entropy is in the loss
            grad_logp = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits)
        grad[:, length:] = 0  # positions past the K scored ones (the model's last) feed nothing
        for rows, cols in slices(batch, length, ctx.step):
            lp = torch.log_softmax(logits[rows, cols].float() / ctx.temperature, dim=-1)
            p = lp.exp()
            g = grad_logp[rows, cols].unsqueeze(-1)
            gz = -p * g
            gz.scatter_add_(-1, targets[rows, cols].unsqueeze(-1), g)
            if ent is not None and grad_ent is not None:
                gz -= p * (lp + ent[rows, cols].unsqueeze(-1)) * grad_ent[rows, cols].unsqueeze(-1)
            grad[rows, cols] = gz / ctx.temperature
        return grad, None, None, None, None


@overload
def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = ..., entropy: Literal[False] = ...
) -> torch.Tensor: ...
@overload
def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = ..., *, entropy: Literal[True]
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = ..., entropy: bool = ...
) -> Any: ...  # entropy not known statically: either of the above
def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log pi(targets) at the first ``K = targets.shape[1]`` positions of ``logits`` ``[B, S, V]``
    (S >= K) under ``softmax(logits / temperature)``: ``[B, K]`` fp32; with ``entropy`` also the
    entropy at each position, ``(logp, entropy)``. Differentiable in ``logits``."""
    step = positions_per_chunk(logits.shape[-1])
    logp, ent = TokenLogprobs.apply(logits, targets, float(temperature), entropy, step)
    return (logp, ent) if entropy else logp
