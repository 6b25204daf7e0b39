"""One SERL update, top to bottom: the executable spec of what the pipeline does.

For one group of rollouts of a task (the G episodes ``serl rollout`` stored), this file goes
from rollouts to the loss in six steps, calling the same functions the staged pipeline
calls (``method.annotation``, ``algos.objectives``, ``training.learner``), with none of
its machinery: no files, no micro-batching, no resume, no teacher snapshots, no DeepSpeed.
A test (tests/test_reference_step.py) checks that the pipeline's loss and gradient on a
fixed batch equal this one's, so this file cannot drift from what serl trains.

    1. advantages   A_i = (R_i - mean(R)) / (std(R) + eps)                 (METHOD.md 6)
    2. hindsight    the feedback sources render a block per turn, cut whole (METHOD.md 3-4)
    3. placement    the rule picks the critical set S among turns          (METHOD.md 5)
    4. teacher      log pi_T(a_t | prompt_t + block_t), no gradient; not run
                    at all when lambda = 0                                 (METHOD.md 4)
    5. weights      w = clip(exp(sign(A) (log pi_T - log pi_old)), 1 +- c),
                    w' = (1 - lambda) + lambda w on the action tokens of S
                    (rlsd: on every reply token of S)                      (METHOD.md 6)
    6. loss         token-level PPO-clip on w' * A, / number of reply tokens

Step-granularity placement rules that select before scoring (``all``, the default,
``feedback``, ``random``); ``gap`` scores first and is left to the pipeline. Sources that
need the environment (``expert``) and replies without an ``<action>`` tag outside WebShop's
bare format are left to the pipeline too: this file builds no environment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from serl_cli.algos import core
from serl_cli.algos.serl import apply_placement, blend_weights, hindsight_weights, mixing_lambda
from serl_cli.artifacts.records import Episode
from serl_cli.method import feedback, placement
from serl_cli.method.action_mask import action_span_mask
from serl_cli.method.annotation import AnnotateConfig
from serl_cli.method.teacher import teacher_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def token_logprobs(model: Any, prompt_ids: list[int], reply_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log pi(reply_k | prompt, reply_<k) for one turn, [K]: one unpadded forward pass."""
    ids = torch.tensor([prompt_ids + reply_ids])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(reply_ids).unsqueeze(-1)).squeeze(-1)


def reference_step(
    policy: Any,
    teacher: Any,
    tokenizer: PreTrainedTokenizerBase,
    group: list[Episode],
    cfg: AnnotateConfig,
    *,
    clip_eps: float = 0.2,
    adv_eps: float = 1e-6,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The SERL loss of one group of rollouts under ``policy`` (differentiable), with the
    hindsight ``teacher`` (a frozen copy of the rollout policy) setting the token weights."""
    turns = [(ep, t) for ep in group for t in range(len(ep.turns))]

    # 1. advantages: the sign of every update comes from the task reward alone
    rewards = torch.tensor([ep.reward for ep in group], dtype=torch.float64)
    episode_adv = core.group_advantages(rewards, torch.zeros(len(group), dtype=torch.long), eps=adv_eps)
    adv = {id(ep): float(a) for ep, a in zip(group, episode_adv, strict=True)}

    # 2. hindsight: what the environment said, rendered for the teacher's context, cut as a whole
    sources = feedback.parse_sources(cfg.sources)
    cut = feedback.make_cutter(tokenizer, cfg.max_hindsight_tokens)
    blocks = []
    for ep, t in turns:
        ctx = feedback.TurnContext(episode=ep, turn=t, group=group, trajectory=cfg.trajectory)
        text, used, fired = feedback.hindsight_step(ctx, sources)
        blocks.append((cut(text) if text else None, used, fired))

    # 3. placement: the critical set S, chosen before the teacher is asked anything. A turn is
    # scorable with a block, a nonzero advantage and (serl) a parsed action to weight
    masks = [
        action_span_mask(tokenizer, ep.turns[t].action_ids, cfg.unparsed, spans=cfg.action_spans) for ep, t in turns
    ]
    scorable = [
        text is not None and adv[id(ep)] != 0 and (cfg.tokens == "reply" or any(m))
        for (ep, _), (text, _, _), m in zip(turns, blocks, masks, strict=True)
    ]
    infos = [
        placement.TurnInfo(k, bool(fired), None, text is not None, ok)
        for k, ((text, _, fired), ok) in enumerate(zip(blocks, scorable, strict=True))
    ]
    selected = placement.select(cfg.placement, infos, rho=cfg.rho, seed=cfg.seed)

    lam = mixing_lambda(cfg.update_step, cfg.mixing_lambda, cfg.lambda_decay_steps)
    pg_terms, reply_tokens = [], 0
    for (ep, t), (text, _, _), in_s, ok, mask in zip(turns, blocks, selected, scorable, masks, strict=True):
        step = ep.turns[t]
        prompt, reply = step.prompt_ids, step.action_ids
        logp_old = torch.tensor(step.behaviour_logprobs, dtype=torch.float64)
        a = torch.tensor(adv[id(ep)])
        reply_tokens += len(reply)

        # 4. teacher: the same network, the block spliced before the user message ends; at
        # lambda = 0 every weight is 1 and the teacher is not asked
        weights = torch.ones(len(reply), dtype=torch.float64)
        if in_s and ok and lam > 0:
            assert text is not None  # a scorable turn has a block
            with torch.no_grad():
                with_block = teacher_prompt(tokenizer, prompt, text)
                logp_teacher = token_logprobs(teacher, with_block, reply, temperature).double()

            # 5. weights: teacher-vs-student agreement, signed by A, clipped, blended, on the
            # parsed action's tokens (serl) or every reply token (rlsd)
            w = blend_weights(hindsight_weights(logp_teacher, logp_old, a, cfg.weight_clip), lam)
            where = [1] * len(reply) if cfg.tokens == "reply" else mask
            weights = apply_placement(w, torch.tensor(where, dtype=torch.bool))

        # 6. loss: PPO-clip on the reweighted advantage, summed over this turn's reply tokens
        logp = token_logprobs(policy, prompt, reply, temperature)
        ratio = torch.exp(logp - logp_old.float())
        adv_tokens = (weights * a).float()
        surrogate = torch.min(ratio * adv_tokens, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv_tokens)
        pg_terms.append(-surrogate.sum())
    return torch.stack(pg_terms).sum() / reply_tokens
