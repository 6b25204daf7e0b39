"""Annotation, the core of ``serl annotate``: hindsight blocks, the critical set, teacher scores, SERL weights.

For every stored turn: the chosen feedback sources (``method.feedback``) build the
hindsight block at the chosen granularity, cut as a whole to ``max_hindsight_tokens``; the
placement rule (``method.placement``) picks the critical set S -- by default every turn
with a block, as the authors do; the teacher (``method.teacher``) scores the student's reply
with the block in its prompt -- only the turns that need it: the selected ones, or for
``gap`` every turn with a block; and the selected turns' tokens get the weight of
METHOD.md 6 (``algos.serl``): the parsed action's tokens (``tokens="action"``, serl) or every
reply token (``tokens="reply"``, rlsd). One record per turn (``artifacts.records.Annotation``).
With lambda = 0 and no distillation wanting the teacher, the teacher is not run at all and
every weight is 1, as in the authors' trainer (recipe/serl/serl_ray_trainer.py:405-433,
verl/workers/actor/dp_actor.py:77-81).
Where the turns carry an expert action, the statistics also say whether the teacher moves
the student the right way (``method.teacher_signal``).
:func:`annotate_episodes` reads as these steps in order -- blocks, cut, select, score, weigh,
stats -- each a function below it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from serl_cli.algos.objectives import episode_advantages
from serl_cli.algos.serl import apply_placement, blend_weights, hindsight_weights, mixing_lambda
from serl_cli.artifacts.records import Annotation, Episode
from serl_cli.artifacts.schema import TurnSample, turn_samples
from serl_cli.errors import SerlError
from serl_cli.method import anchors as anchors_mod
from serl_cli.method import feedback as fb
from serl_cli.method import placement, teacher_signal
from serl_cli.method.action_mask import action_span_mask
from serl_cli.method.annotate_config import AnnotateConfig, validate
from serl_cli.method.cutting import cut_all
from serl_cli.method.teacher import teacher_prompts_for
from serl_cli.training.scoring import ScoreItem, score

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from serl_cli.rollout.prompts import ActionFormat

# a scorer: serl_cli.training.scoring.score's signature, the teacher's log-probs of each item's action tokens
Scorer = Callable[..., list[list[float]]]


def expert_trajectories(env_cfg: dict, episodes: list[Episode]) -> dict[int, list[dict]]:
    """The environment's expert episode for each task (the `expert` source: privileged oracle information)."""
    from serl_cli.rollout.policies import ExpertPolicy
    from serl_cli.rollout.runner import EpisodeSpec, run_episodes
    from serl_cli.rollout.worlds import EnvConfig, build_world, built_split

    env = EnvConfig(**env_cfg)
    world = build_world(env)
    tasks = sorted({e.task_id for e in episodes})
    records = run_episodes(
        world, built_split(env), [EpisodeSpec(task_id=t) for t in tasks], ExpertPolicy(), max_turns=env.max_turns
    )
    return {
        r.task_id: [{"observation": t.observation, "action": t.action, "state_key": t.state_key} for t in r.turns]
        for r in records
    }


def teacher_prompts(
    records: list[Annotation],
    prompt_ids: list[list[int]],
    tokenizer: PreTrainedTokenizerBase,
    keys: Iterable[int],
    chat_template_kwargs: dict | None = None,
) -> dict[int, list[int]]:
    """The teacher's prompt of each record in ``keys``: the student's prompt (``prompt_ids``, in
    record order) with the record's block spliced in. Built once per annotation: the teacher
    scores the student's reply on it, and the teacher signal the expert's reply."""
    keys = list(keys)
    blocks = [records[k].hindsight or "" for k in keys]
    built = teacher_prompts_for(tokenizer, [prompt_ids[k] for k in keys], blocks, chat_template_kwargs)
    return dict(zip(keys, built, strict=True))


def action_format(env_cfg: dict | None) -> ActionFormat:
    """The environment's action format (which untagged replies are a bare action); WebShop's without one."""
    from serl_cli.rollout.prompts import DEFAULT_ACTION_FORMAT, action_format_of
    from serl_cli.rollout.worlds import EnvConfig, build_world

    return action_format_of(build_world(EnvConfig(**env_cfg))) if env_cfg else DEFAULT_ACTION_FORMAT


def action_masks(
    tokenizer: PreTrainedTokenizerBase,
    episodes: list[Episode],
    unparsed: str,
    env_cfg: dict | None,
    spans: str = "last",
) -> tuple[list[list[int]], int]:
    """The parsed action's tokens of every turn, in turn order, and how many replies had no
    parseable action. The environment is built (for its bare-action format) only if some
    reply has no ``<action>`` tag and ``spans`` is serl's (the authors' needs no format)."""
    from serl_cli.rollout.prompts import ACTION_TAG_RE

    turns = [t for e in episodes for t in e.turns]
    tagged = all(ACTION_TAG_RE.search(t.action_text or "") for t in turns)
    fmt = None if spans == "authors" or tagged else action_format(env_cfg)
    # a reply's mask depends on its tokens alone, and replies repeat (a Sokoban batch has a handful)
    by_reply: dict[tuple, list[int]] = {}
    for t in turns:
        key = tuple(t.action_ids)
        if key not in by_reply:
            by_reply[key] = action_span_mask(tokenizer, t.action_ids, "none", fmt, spans)
    masks = [list(by_reply[tuple(t.action_ids)]) for t in turns]
    failed = [k for k, m in enumerate(masks) if not any(m)]
    if unparsed != "none":
        for k in failed:
            masks[k] = action_span_mask(tokenizer, turns[k].action_ids, unparsed, fmt, spans)
    return masks, len(failed)


def teacher_wanted(cfg: AnnotateConfig) -> bool:
    """Whether the teacher runs for update ``cfg.update_step``: the weights are 1 at lambda = 0,
    so it is skipped unless its log-probs are wanted for themselves (``skip_zero_advantage``
    off). Lambda never rises again (``algos.serl.mixing_lambda``), so once this is False it is
    False for every later update too: the online loop then drops its teacher for good."""
    return mixing_lambda(cfg.update_step, cfg.mixing_lambda, cfg.lambda_decay_steps) > 0 or not cfg.skip_zero_advantage


def annotate_episodes(
    episodes: list[Episode],
    cfg: AnnotateConfig,
    teacher_model: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    env_cfg: dict | None,
    temperature: float = 1.0,
    scorer: Scorer = score,
    advantages: list[float] | None = None,
    chat_template_kwargs: dict | None = None,
    bare_replies: bool = False,
) -> tuple[list[Annotation], dict]:
    """Annotation records for every turn, and statistics of the pass (teacher work).
    ``scorer`` has :func:`serl_cli.training.scoring.score`'s signature (e.g.
    :func:`serl_cli.stages.annotate.journaled_scorer`, or the online loop's, divided over its
    processes); every teacher forward pass goes through it, the teacher signal's included.
    Everything else is a pure function of the batch, so processes that each run it on the
    whole batch with such a scorer agree with one process.
    ``advantages``: the update's advantage per turn, in turn order, whose sign sets each weight
    (the authors sign by the final advantage, invalid-action penalty included:
    verl/trainer/ppo/core_algos.py:466); default: the plain episode GRPO advantage.
    ``chat_template_kwargs``: those the rollouts' prompts were rendered with (``prompt.chat_template_kwargs``),
    for the teacher's prompts (``method.teacher.teacher_prompt``); ``bare_replies``: whether they asked for
    bare replies (``prompt.bare_replies``), the form the teacher signal scores the expert's reply in."""
    spec = validate(cfg)
    evidence = gather_evidence(episodes, cfg, spec, env_cfg)
    samples = turn_samples(episodes)
    advantages = turn_advantages(samples, advantages)
    masks, parse_failures = action_masks(tokenizer, episodes, cfg.unparsed, env_cfg, cfg.action_spans)
    lam = mixing_lambda(cfg.update_step, cfg.mixing_lambda, cfg.lambda_decay_steps)
    use_teacher = teacher_wanted(cfg)

    # 1. blocks: what the sources say of each turn, at the chosen granularity, uncut
    blocks = hindsight_blocks(episodes, cfg, spec, evidence)
    records = unscored_records(episodes, blocks, masks, advantages)

    # 2. cut: the whole block, not each source, as the authors cap the whole teacher prompt
    cut_blocks(records, [text for text, _, _ in blocks], tokenizer, cfg.max_hindsight_tokens)

    # 3. select: first where the rule allows it, so the teacher scores only the turns that need it
    scores_first = placement.needs_teacher_before_selection(cfg.placement)
    if not scores_first:
        select_turns(records, cfg)
    to_score = turns_to_score(records, cfg, scores_first) if use_teacher else []

    # 4. score: the teacher's log-probs of the student's reply, the block in its prompt
    work = score_turns(
        records, samples, to_score, teacher_model, tokenizer, cfg, temperature, scorer, chat_template_kwargs
    )
    if scores_first:  # gap: the rule reads the scores it has just been given
        select_turns(records, cfg)

    # 5. weigh: the selected, scored turns get METHOD.md 6's weights; the rest keep weight 1
    weigh_turns(records, samples, episodes, cfg, lam)

    # 6. stats: the teacher's work, and whether it moves the student the right way
    stats = pass_stats(records, work, lam, use_teacher, parse_failures)
    if cfg.teacher_signal:
        how = teacher_signal.SpanScoring(
            teacher_model,
            tokenizer,
            temperature,
            cfg.micro_batch_tokens,
            bare_replies,
            action_format(env_cfg) if bare_replies else None,
            scorer=scorer,
            known=work.known(),
        )
        signal = teacher_signal.measure(records, episodes, work.prompts, how)
        if signal is not None:
            stats["teacher_signal"] = signal
    return records, stats


@dataclass
class Evidence:
    """What a turn's block is built from beyond its own rollout: its group's rollouts, their
    anchor states (``anchor`` granularity only), the environment's expert episode by task (the
    ``expert`` and ``shuffled`` sources rendered in full only; the aligned rendering reads each
    turn's own ``expert_action``)."""

    groups: dict[tuple, list[Episode]]
    anchors: dict[tuple, dict[tuple[int, int], int]]
    experts: dict[int, list[dict]]


def gather_evidence(
    episodes: list[Episode], cfg: AnnotateConfig, spec: list[list[str]], env_cfg: dict | None
) -> Evidence:
    needs_expert = fb.uses_expert_trajectory(spec, cfg.trajectory) and env_cfg
    experts = expert_trajectories(env_cfg, episodes) if needs_expert and env_cfg else {}
    groups: dict[tuple, list[Episode]] = {}
    for e in episodes:
        groups.setdefault(e.group_key, []).append(e)
    anchors = (
        {k: anchors_mod.anchor_groups(g, cfg.anchor_similarity) for k, g in groups.items()}
        if cfg.granularity == "anchor"
        else {}
    )
    return Evidence(groups, anchors, experts)


def turn_advantages(samples: list[TurnSample], advantages: list[float] | None) -> list[float]:
    """The advantage that signs each turn's weights: the caller's, one per turn, or the plain episode GRPO one."""
    if advantages is None:
        return episode_advantages(samples, 1e-6).tolist()
    if len(advantages) != len(samples):
        raise SerlError(f"annotate: {len(advantages)} advantages for {len(samples)} turns")
    return advantages


def hindsight_blocks(
    episodes: list[Episode], cfg: AnnotateConfig, spec: list[list[str]], evidence: Evidence
) -> list[tuple[str | None, list[str], list[str]]]:
    """(block, sources used, sources fired) of every turn, in turn order; the block uncut, None where empty."""
    out = []
    for ep in episodes:
        key = ep.group_key
        for t_idx in range(len(ep.turns)):
            ctx = fb.TurnContext(
                episode=ep,
                turn=t_idx,
                group=evidence.groups[key],
                expert=evidence.experts.get(ep.task_id),
                trajectory=cfg.trajectory,
                seed=cfg.seed,
            )
            if cfg.granularity == "anchor":
                text, used, fired = anchors_mod.hindsight_anchor(ctx, spec, evidence.anchors[key])
            else:
                text, used, fired = fb.hindsight_step(ctx, spec)
            out.append((text or None, used, fired))
    return out


def unscored_records(
    episodes: list[Episode],
    blocks: list[tuple[str | None, list[str], list[str]]],
    masks: list[list[int]],
    advantages: list[float],
) -> list[Annotation]:
    """One record per turn, in turn order: its sources, mask and advantage; not yet selected,
    cut, scored or weighted."""
    turns = [(e_idx, ep, t_idx) for e_idx, ep in enumerate(episodes) for t_idx in range(len(ep.turns))]
    return [
        Annotation(
            episode=e_idx,
            task_id=ep.task_id,
            group_id=ep.group_id,
            rollout_index=ep.rollout_index,
            turn=t_idx,
            selected=False,
            sources=used,
            fired=fired,
            hindsight=None,  # the block, once cut
            action_mask=mask,
            teacher_logprobs=None,
            weights=None,
            advantage=advantage,
            log_ratio_mean=None,
            distill=False,
        )
        for (e_idx, ep, t_idx), (_, used, fired), mask, advantage in zip(turns, blocks, masks, advantages, strict=True)
    ]


def cut_blocks(
    records: list[Annotation], blocks: list[str | None], tokenizer: PreTrainedTokenizerBase, max_tokens: int
) -> None:
    """Each record's block cut to ``max_tokens``, in one tokenizer call for the batch."""
    with_block = [k for k, b in enumerate(blocks) if b is not None]
    cut = cut_all(tokenizer, max_tokens, [blocks[k] or "" for k in with_block])
    for k, text in zip(with_block, cut, strict=True):
        records[k].hindsight = text or None


def scorable(r: Annotation, cfg: AnnotateConfig) -> bool:
    """Selected, would the teacher score it? A block, and -- where the teacher serves the weights
    alone -- a nonzero advantage and some token to weight."""
    if r.hindsight is None:
        return False
    return not cfg.skip_zero_advantage or (r.advantage != 0 and (cfg.tokens == "reply" or any(r.action_mask)))


def select_turns(records: list[Annotation], cfg: AnnotateConfig) -> None:
    """Mark the critical set S of the placement rule on the records."""
    infos = [
        placement.TurnInfo(k, bool(r.fired), r.log_ratio_mean, r.hindsight is not None, scorable(r, cfg))
        for k, r in enumerate(records)
    ]
    for r, chosen in zip(records, placement.select(cfg.placement, infos, rho=cfg.rho, seed=cfg.seed), strict=True):
        r.selected = bool(chosen)


def turns_to_score(records: list[Annotation], cfg: AnnotateConfig, scores_first: bool) -> list[int]:
    """The records the teacher scores: every one with a block where the rule reads the scores
    (``gap``), else the selected scorable ones. With no teacher wanted, none: no teacher prompt,
    no forward pass (serl_ray_trainer.py:405-433)."""
    if scores_first:
        return [k for k, r in enumerate(records) if r.hindsight is not None]
    return [k for k, r in enumerate(records) if r.selected and scorable(r, cfg)]


@dataclass
class TeacherWork:
    """What the teacher did: each scored record's prompt, the items it scored, their log-probs, the time taken."""

    prompts: dict[int, list[int]]
    items: list[ScoreItem]
    scored: list[list[float]]
    seconds: float

    def known(self) -> dict[tuple[tuple[int, ...], tuple[int, ...]], list[float]]:
        """The scores by (prompt ids, reply ids): the teacher signal does not score them again."""
        return {
            (tuple(it.prompt_ids), tuple(it.action_ids)): lp for it, lp in zip(self.items, self.scored, strict=True)
        }


def score_turns(
    records: list[Annotation],
    samples: list[TurnSample],
    to_score: list[int],
    teacher_model: Any,
    tokenizer: PreTrainedTokenizerBase,
    cfg: AnnotateConfig,
    temperature: float,
    scorer: Scorer,
    chat_template_kwargs: dict | None,
) -> TeacherWork:
    """The teacher's log-probs of the reply of each record in ``to_score``, with the record's
    block in its prompt, and their mean log-ratio to the student's on the action's tokens."""
    t0 = time.perf_counter()
    prompts = teacher_prompts(records, [s.prompt_ids for s in samples], tokenizer, to_score, chat_template_kwargs)
    items = [ScoreItem(prompts[k], samples[k].action_ids) for k in to_score]
    scored = scorer(teacher_model, tokenizer, items, temperature, cfg.micro_batch_tokens) if items else []
    for k, lp in zip(to_score, scored, strict=True):
        records[k].teacher_logprobs = lp
        records[k].log_ratio_mean = mean_log_ratio(lp, samples[k].behaviour_logprobs, records[k].action_mask)
    return TeacherWork(prompts, items, scored, time.perf_counter() - t0)


def mean_log_ratio(teacher: list[float], old: list[float], mask: list[int]) -> float:
    """Mean of log pi_T - log pi_old over the action's tokens (``mask``); over every reply
    token where the mask marks none."""
    diffs = [a - b for a, b, m in zip(teacher, old, mask, strict=True) if m] or [
        a - b for a, b in zip(teacher, old, strict=True)
    ]
    return sum(diffs) / len(diffs) if diffs else 0.0


def weigh_turns(
    records: list[Annotation], samples: list[TurnSample], episodes: list[Episode], cfg: AnnotateConfig, lam: float
) -> None:
    """METHOD.md 6's weights on every selected, scored record: signed by its advantage,
    clipped, blended by ``lam``, on the parsed action's tokens (serl) or every reply token
    (rlsd); a failed rollout's turn also carries the distillation term."""
    for k, r in enumerate(records):
        if not r.selected or r.teacher_logprobs is None:
            continue
        lp_t = torch.tensor(r.teacher_logprobs, dtype=torch.float64)
        lp_old = torch.tensor(samples[k].behaviour_logprobs, dtype=torch.float64)
        w = blend_weights(hindsight_weights(lp_t, lp_old, torch.tensor(r.advantage), cfg.weight_clip), lam)
        where = (
            torch.ones(len(w), dtype=torch.bool)
            if cfg.tokens == "reply"
            else torch.tensor(r.action_mask, dtype=torch.bool)
        )
        r.weights = apply_placement(w, where).tolist()
        r.distill = not episodes[r.episode].success


def pass_stats(
    records: list[Annotation], work: TeacherWork, lam: float, use_teacher: bool, parse_failures: int
) -> dict[str, Any]:
    """The pass's statistics, as the stage records them: the critical set's size and the teacher's work."""
    return {
        "turns": len(records),
        "selected": sum(r.selected for r in records),
        "teacher_turns_scored": len(work.items),
        "teacher_tokens_scored": sum(len(it.prompt_ids) + len(it.action_ids) for it in work.items),
        "teacher_action_tokens": sum(len(it.action_ids) for it in work.items),
        "teacher_s": round(work.seconds, 3),
        "lambda": lam,
        "teacher_skipped": not use_teacher,
        "turns_with_block": sum(r.hindsight is not None for r in records),
        "action_parse_failures": parse_failures,
    }
