"""What SERL's weights do to one update, on one batch (issue 29 item 5): the mechanism figures.

If SERL with a teacher that reads does not beat GRPO, the cause is either the method's bounds
(the weights cannot move the update far enough) or a defect (they move it the wrong way).
On one annotated batch (its rollouts, its annotation records, the policy that made them):

* **weights**: the distribution of the SERL token weights on the action tokens of the selected
  turns (quantiles), and the fraction at the clip, ``|w' - 1| >= lambda c`` (a blended weight
  sits there exactly when the clip bound was hit);
* **mass moved**: ``sum |A (w' - 1)| / sum |A|`` over every action token, as the update's
  metrics count it (``algos.objectives``);
* **directions**: the gradients, with respect to the policy's parameters, of three losses on
  this batch at the policy itself (where PPO-clip's ratio is 1, so its gradient is the plain
  policy gradient): GRPO's ``-sum A log pi / N``, SERL's ``-sum w' A log pi / N`` (N: the
  batch's reply tokens), and SFT toward the expert's move, ``-mean log pi(expert reply)`` over
  the turns of failed rollouts that have an expert action. Reported: the cosines between
  SERL's and GRPO's, between SERL's and the SFT update, and between what SERL adds
  (SERL - GRPO) and the SFT update: a teacher that reads should make the added part point
  toward the expert (a positive cosine), and the bounds decide how large it is
  (``added_norm_ratio``: |SERL - GRPO| / |GRPO|; ``grad_norm_ratio``: |SERL| / |GRPO|, the gradient's
  size, which is not the step's: AdamW divides each coordinate by its running RMS).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from serl_cli.artifacts.records import Annotation, Episode
from serl_cli.method.reference_step import token_logprobs
from serl_cli.method.teacher_signal import expert_reply_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def weight_figures(records: list[Annotation], weight_clip: float, lam: float) -> dict:
    """The distribution of the weights on selected action tokens, the fraction at the clip, the mass moved."""
    w = [x for r in records if r.weights for x, m in zip(r.weights, r.action_mask, strict=True) if m]
    moved = total = 0.0
    for r in records:
        for x, m in zip(r.weights or [1.0] * len(r.action_mask), r.action_mask, strict=True):
            if m:
                moved, total = moved + abs(r.advantage) * abs(x - 1.0), total + abs(r.advantage)
    out: dict[str, Any] = {"weighted_tokens": len(w), "advantage_mass_moved": moved / total if total else 0.0}
    if w:
        q = np.percentile(w, [0, 5, 25, 50, 75, 95, 100]).tolist()
        out["weight_quantiles"] = dict(zip(("min", "p5", "q1", "median", "q3", "p95", "max"), q, strict=True))
        out["weight_mean"] = float(np.mean(w))
        bound = lam * weight_clip * (1 - 1e-6)
        out["at_clip_fraction"] = sum(lam > 0 and abs(x - 1.0) >= bound for x in w) / len(w)
        out["above_one_fraction"] = sum(x > 1.0 for x in w) / len(w)
    return out


def _flat_grad(loss: torch.Tensor, params: list[torch.nn.Parameter], retain: bool = False) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=retain)
    return torch.cat(
        [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params, strict=True)]
    )


def cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    a, b = a.double(), b.double()  # a float32 dot over a million parameters drifts past 1
    na, nb = a.norm().item(), b.norm().item()
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else None


def policy_gradients(
    model: Any, episodes: list[Episode], records: list[Annotation], temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(GRPO's, SERL's) loss gradients on the batch at the policy, flattened; ``records`` in turn order."""
    params = [p for p in model.parameters() if p.requires_grad]
    turns = [t for e in episodes for t in e.turns]
    n_tokens = sum(len(t.action_ids) for t in turns)
    grpo = torch.zeros(sum(p.numel() for p in params))
    serl = torch.zeros_like(grpo)
    for turn, r in zip(turns, records, strict=True):
        if not r.advantage:
            continue  # no gradient from a zero advantage, weighted or not
        logp = token_logprobs(model, turn.prompt_ids, turn.action_ids, temperature)
        w = torch.tensor(r.weights or [1.0] * len(turn.action_ids), dtype=logp.dtype)
        a = float(r.advantage)
        g_plain = _flat_grad(-(a * logp).sum() / n_tokens, params, retain=True)
        g_weighted = _flat_grad(-(w * a * logp).sum() / n_tokens, params)
        grpo += g_plain
        serl += g_weighted
    return grpo, serl


def expert_gradient(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    episodes: list[Episode],
    bare_replies: bool,
    temperature: float = 1.0,
) -> tuple[torch.Tensor | None, int]:
    """The SFT gradient toward the expert's move on the failed rollouts' turns that have one; None without any."""
    params = [p for p in model.parameters() if p.requires_grad]
    moves = [(t.prompt_ids, t.expert_action) for e in episodes if not e.success for t in e.turns if t.expert_action]
    if not moves:
        return None, 0
    total = torch.zeros(sum(p.numel() for p in params))
    for prompt_ids, move in moves:
        logp = token_logprobs(model, prompt_ids, expert_reply_ids(tokenizer, move, bare_replies))
        total += _flat_grad(-logp.sum() / len(moves), params)
    return total, len(moves)


def update_figures(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    episodes: list[Episode],
    records: list[Annotation],
    *,
    weight_clip: float,
    lam: float,
    bare_replies: bool,
) -> dict:
    """:func:`weight_figures` and the cosines between SERL's, GRPO's and the SFT-toward-the-expert updates."""
    out = weight_figures(records, weight_clip, lam)
    grpo, serl = policy_gradients(model, episodes, records)
    sft, n_sft = expert_gradient(model, tokenizer, episodes, bare_replies)
    added = serl - grpo
    out.update(
        {
            "cos_serl_grpo": cosine(serl, grpo),
            "added_norm_ratio": added.norm().item() / grpo.norm().item() if grpo.norm().item() > 0 else None,
            "grad_norm_ratio": serl.norm().item() / grpo.norm().item() if grpo.norm().item() > 0 else None,
            "sft_turns": n_sft,
        }
    )
    if sft is not None:
        out.update(
            {
                "cos_serl_sft": cosine(serl, sft),
                "cos_grpo_sft": cosine(grpo, sft),
                "cos_added_sft": cosine(added, sft),
            }
        )
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


def parameter_steps(checkpoints: list) -> list[float]:
    """The size of each step a run took, ``|theta_j - theta_(j-1)|`` over all parameters, from its
    consecutive checkpoints (model directories with ``model.safetensors``; the first is the start).
    What an update changes in the weights, which under AdamW is not proportional to the gradient's
    norm: a learning rate matched by this, not by ``grad_norm_ratio``, matches two arms' steps."""
    from safetensors.torch import load_file

    steps, previous = [], None
    for path in checkpoints:
        current = load_file(str(path) + "/model.safetensors")
        if previous is not None:
            if current.keys() != previous.keys():
                raise ValueError(f"{path} holds other parameters than the checkpoint before it")
            squared = sum(float((current[k].double() - previous[k].double()).pow(2).sum()) for k in current)
            steps.append(math.sqrt(squared))
        previous = current
    return steps
