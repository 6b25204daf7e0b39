"""Annotation, the core of ``serl annotate``: hindsight blocks, the critical set, teacher scores, SERL weights.

For every stored turn: the chosen feedback sources (``method.feedback``) build the
hindsight block at the chosen granularity; the placement rule (``method.placement``)
picks the critical set S; the teacher (``method.teacher``) scores the student's action
tokens with the block in its prompt -- only the turns that need it: the selected ones, or
for ``gap`` every turn with a block; and the selected turns' action tokens get the weight
of METHOD.md 6 (``algos.serl``). One record per turn (``artifacts.schema.ANNOTATION_KEYS``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from serl_cli.algos.objectives import episode_advantages
from serl_cli.algos.serl import apply_placement, blend_weights, hindsight_weights, mixing_lambda
from serl_cli.artifacts.schema import turn_samples
from serl_cli.errors import SerlError
from serl_cli.method import anchors as anchors_mod
from serl_cli.method import feedback as fb
from serl_cli.method import placement
from serl_cli.method.teacher import ScoreItem, action_span_mask, block_ids, score, teacher_prompt_ids

GRANULARITIES = ("step", "anchor")



@dataclass
class AnnotateConfig:
    sources: str = "ref|error"  # combine with ",", fall back with "|" (METHOD.md 3)
    granularity: str = "step"  # step | anchor
    placement: str = "feedback"  # feedback | gap | all | random
    rho: float = 0.25  # `gap`: fraction of turns selected
    anchor_similarity: float | None = None  # `anchor`: also pool observations at least this similar
    ref_mode: str = "group"  # group (a successful sibling, else the expert) | expert
    max_feedback_tokens: int = 96  # per source, cut cleanly
    teacher: str | None = None  # teacher model; default: the policy that made the rollouts
    skip_zero_advantage: bool = True  # a turn with advantage 0 keeps weight 1 whatever the teacher says: don't score it (sdpo needs false)
    teacher_sync_interval: int = 10  # online loop: the teacher is the policy snapshot of every N-th update; 1 = the rollout policy
    weight_clip: float = 0.2  # c
    mixing_lambda: float = 0.5  # lambda at update 0
    lambda_decay_steps: int = 50  # 0 = no decay
    update_step: int = 0  # the update these annotations feed (lambda schedule)
    seed: int = 0  # `random` placement
    threads: int | None = None
    micro_batch_tokens: int = 16384



def validate(cfg: AnnotateConfig) -> list[list[str]]:
    spec = fb.parse_sources(cfg.sources)
    if cfg.granularity not in GRANULARITIES:
        raise SerlError(f"unknown granularity {cfg.granularity!r}: choose one of {', '.join(GRANULARITIES)}")
    placement.check_rule(cfg.placement, rho=cfg.rho)
    if cfg.ref_mode not in ("group", "expert"):
        raise SerlError(f"unknown ref_mode {cfg.ref_mode!r}: choose group or expert")
    return spec



def expert_trajectories(env_cfg: dict, episodes: list[dict]) -> dict[int, list[dict]]:
    """The environment's expert episode for each task (the `ref` source's fallback)."""
    from serl_cli.rollout.policies import ExpertPolicy
    from serl_cli.rollout.runner import EpisodeSpec, run_episodes
    from serl_cli.rollout.worlds import EnvConfig, build_world

    env = EnvConfig(**env_cfg)
    world = build_world(env)
    tasks = sorted({e["task_id"] for e in episodes})
    records = run_episodes(world, env.split, [EpisodeSpec(task_id=t) for t in tasks], ExpertPolicy(), max_turns=env.max_turns)
    return {r["task_id"]: [{"observation": t["observation"], "action": t["action"], "state_key": t["state_key"]}
                           for t in r["turns"]] for r in records}



def annotate_episodes(episodes: list[dict], cfg: AnnotateConfig, teacher_model, tokenizer, *, env_cfg: dict | None,
                      temperature: float = 1.0, scorer=score) -> tuple[list[dict], dict]:
    """Annotation records for every turn, and statistics of the pass (teacher work).
    ``scorer`` has :func:`serl_cli.method.teacher.score`'s signature (e.g. :func:`serl_cli.stages.annotate.journaled_scorer`)."""
    spec = validate(cfg)
    uses_ref = any("ref" in alt for alt in spec)
    experts = expert_trajectories(env_cfg, episodes) if uses_ref and env_cfg else {}
    groups: dict[tuple, list[dict]] = {}
    for e in episodes:
        groups.setdefault((e["task_id"], e["group_id"]), []).append(e)
    anchors = {k: anchors_mod.anchor_groups(g, cfg.anchor_similarity) for k, g in groups.items()} if cfg.granularity == "anchor" else {}
    cut = fb.make_cutter(tokenizer, cfg.max_feedback_tokens)
    samples = turn_samples(episodes)
    advantages = episode_advantages(samples, 1e-6).tolist()

    records = []
    i = 0
    for e_idx, ep in enumerate(episodes):
        key = (ep["task_id"], ep["group_id"])
        for t_idx, turn in enumerate(ep["turns"]):
            ctx = fb.TurnContext(episode=ep, turn=t_idx, group=groups[key], expert=experts.get(ep["task_id"]), cut=cut,
                                 ref_mode=cfg.ref_mode)
            if cfg.granularity == "anchor":
                text, used, fired = anchors_mod.hindsight_anchor(ctx, spec, anchors[key])
            else:
                text, used, fired = fb.hindsight_step(ctx, spec)
            records.append({"episode": e_idx, "task_id": ep["task_id"], "group_id": ep["group_id"],
                            "rollout_index": ep["rollout_index"], "turn": t_idx, "selected": False, "sources": used,
                            "fired": fired, "hindsight": text, "action_mask": action_span_mask(tokenizer, turn["action_ids"]),
                            "teacher_logprobs": None, "weights": None, "advantage": advantages[i],
                            "log_ratio_mean": None, "distill": False})
            i += 1

    # Select first where the rule allows it, so the teacher scores only the turns that need it.
    need_scores_first = placement.needs_teacher_before_selection(cfg.placement)
    to_score = [k for k, r in enumerate(records) if r["hindsight"] is not None] if need_scores_first else None
    if not need_scores_first:
        chosen = placement.select(cfg.placement, [placement.TurnInfo(k, bool(r["fired"]), None) for k, r in enumerate(records)],
                                  rho=cfg.rho, seed=cfg.seed)
        for r, c in zip(records, chosen):
            r["selected"] = bool(c)
        to_score = [k for k, r in enumerate(records) if r["selected"] and r["hindsight"] is not None]
    if cfg.skip_zero_advantage and not need_scores_first:
        to_score = [k for k in to_score if records[k]["advantage"] != 0]

    t0 = time.perf_counter()
    eot = tokenizer.eos_token_id
    items = [ScoreItem(teacher_prompt_ids(samples[k].prompt_ids, block_ids(tokenizer, records[k]["hindsight"]), eot),
                       samples[k].action_ids) for k in to_score]
    scored = scorer(teacher_model, tokenizer, items, temperature, cfg.micro_batch_tokens)
    for k, lp in zip(to_score, scored):
        old = samples[k].behaviour_logprobs
        records[k]["teacher_logprobs"] = lp
        mask = records[k]["action_mask"]
        diffs = [a - b for a, b, m in zip(lp, old, mask) if m] or [a - b for a, b in zip(lp, old)]
        records[k]["log_ratio_mean"] = sum(diffs) / len(diffs) if diffs else 0.0
    teacher_s = time.perf_counter() - t0

    if need_scores_first:
        chosen = placement.select(cfg.placement, [placement.TurnInfo(k, bool(r["fired"]), r["log_ratio_mean"])
                                                  for k, r in enumerate(records)], rho=cfg.rho, seed=cfg.seed)
        for r, c in zip(records, chosen):
            r["selected"] = bool(c)

    lam = mixing_lambda(cfg.update_step, cfg.mixing_lambda, cfg.lambda_decay_steps)
    for k, r in enumerate(records):
        if not r["selected"] or r["teacher_logprobs"] is None:
            continue
        lp_t = torch.tensor(r["teacher_logprobs"], dtype=torch.float64)
        lp_old = torch.tensor(samples[k].behaviour_logprobs, dtype=torch.float64)
        w = blend_weights(hindsight_weights(lp_t, lp_old, torch.tensor(r["advantage"]), cfg.weight_clip), lam)
        r["weights"] = apply_placement(w, torch.tensor(r["action_mask"], dtype=torch.bool)).tolist()
        r["distill"] = not episodes[r["episode"]]["success"]
    stats = {"turns": len(records), "selected": sum(r["selected"] for r in records), "teacher_turns_scored": len(items),
             "teacher_tokens_scored": sum(len(it.prompt_ids) + len(it.action_ids) for it in items),
             "teacher_action_tokens": sum(len(it.action_ids) for it in items), "teacher_s": round(teacher_s, 3),
             "lambda": lam}
    return records, stats
