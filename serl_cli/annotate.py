"""``serl annotate RUN``: hindsight blocks, the critical set, teacher scores and SERL weights.

For every stored turn: the chosen feedback sources (``serl_cli.feedback``) build the
hindsight block at the chosen granularity; the placement rule (``serl_cli.placement``)
picks the critical set S; the teacher (``serl_cli.teacher``) scores the student's action
tokens with the block in its prompt -- only the turns that need it: the selected ones, or
for ``gap`` every turn with a block; and the selected turns' action tokens get the weight
of METHOD.md 6 (``serl_cli.algos.serl``). Writes ``annotations.jsonl`` (one record per
turn, ``schema.ANNOTATION_KEYS``) and ``selection_report.json``.

**Resume.** The teacher's work is the expensive part. ``serl annotate`` scores it one
teacher micro-batch at a time -- exactly the micro-batches a single ``score`` call would
make, so the numbers are bit-identical -- and appends each batch's log-probs to
``annotations.journal.jsonl``. ``--resume`` after a kill reuses the journaled batches and
scores only the rest; everything else is recomputed (it is cheap and deterministic).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from serl_cli import anchors as anchors_mod
from serl_cli import feedback as fb
from serl_cli import io, placement, runlock
from serl_cli.algos.serl import apply_placement, blend_weights, hindsight_weights, mixing_lambda
from serl_cli.errors import SerlError
from serl_cli.objectives import episode_advantages
from serl_cli.schema import ANNOTATIONS_FILE, ROLLOUTS_FILE, SELECTION_REPORT_FILE, read_rollouts, turn_samples
from serl_cli.selection_report import selection_report
from serl_cli.teacher import ScoreItem, action_token_mask, block_ids, score, teacher_prompt_ids

GRANULARITIES = ("step", "anchor")
JOURNAL_FILE = "annotations.journal.jsonl"


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


def rollouts_fingerprint(run: Path) -> str:
    return hashlib.sha256((run / ROLLOUTS_FILE).read_bytes()).hexdigest()[:16]


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
    from serl_cli.policies import ExpertPolicy
    from serl_cli.runner import EpisodeSpec, run_episodes
    from serl_cli.settings import EnvConfig, build_world

    env = EnvConfig(**env_cfg)
    world = build_world(env)
    tasks = sorted({e["task_id"] for e in episodes})
    records = run_episodes(world, env.split, [EpisodeSpec(task_id=t) for t in tasks], ExpertPolicy(), max_turns=env.max_turns)
    return {r["task_id"]: [{"observation": t["observation"], "action": t["action"], "state_key": t["state_key"]}
                           for t in r["turns"]] for r in records}


def annotate_episodes(episodes: list[dict], cfg: AnnotateConfig, teacher_model, tokenizer, *, env_cfg: dict | None,
                      temperature: float = 1.0, scorer=score) -> tuple[list[dict], dict]:
    """Annotation records for every turn, and statistics of the pass (teacher work).
    ``scorer`` has :func:`serl_cli.teacher.score`'s signature (:func:`journaled_scorer`)."""
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
                            "fired": fired, "hindsight": text, "action_mask": action_token_mask(tokenizer, turn["action_ids"]),
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


def score_units(tokenizer, items: list[ScoreItem], micro_batch_tokens: int) -> list[list[int]]:
    """The teacher micro-batches :func:`score` makes for ``items``, as lists of item indices.
    Scoring one unit's items alone packs them into that same single micro-batch."""
    from serl_cli.trainer import make_micro_batches

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    order = sorted(range(len(items)), key=lambda i: len(items[i].prompt_ids) + len(items[i].action_ids))
    return [mb.index for mb in make_micro_batches(items, order, micro_batch_tokens, pad)]


def journaled_scorer(journal: Path, done: list[dict]):
    """A :func:`score` that reuses the units in ``done`` and journals each one it scores."""

    def scorer(model, tokenizer, items, temperature, micro_batch_tokens):
        out: list[list[float]] = [[] for _ in items]
        for u, index in enumerate(score_units(tokenizer, items, micro_batch_tokens)):
            if u < len(done):
                if done[u].get("items") != index:
                    raise SerlError(f"{journal}: teacher batch {u} covers other turns than this run's: "
                                    f"pass --overwrite to annotate from scratch")
                logprobs = done[u]["logprobs"]
            else:
                logprobs = score(model, tokenizer, [items[i] for i in index], temperature, micro_batch_tokens)
                io.append_journal(journal, {"unit": u, "items": index, "logprobs": logprobs})
            for i, lp in zip(index, logprobs):
                out[i] = lp
        return out

    return scorer


def _finished(run: Path, manifest: dict) -> dict | None:
    stage = manifest.get("stages", {}).get("annotate", {})
    if stage.get("status") != "done" or not (run / ANNOTATIONS_FILE).is_file() or not (run / SELECTION_REPORT_FILE).is_file():
        return None
    if stage.get("rollouts_sha256") != rollouts_fingerprint(run):
        return None
    return {**stage.get("stats", {}), "report": io.read_json(run / SELECTION_REPORT_FILE)}


def run_annotate(run_dir: str, cfg: AnnotateConfig, *, overwrite: bool = False, resume: bool = False) -> dict:
    """Annotate a run's rollouts; ``resume`` continues an interrupted pass from its journal
    (or returns the summary of a finished one)."""
    run = Path(run_dir)
    with runlock.run_lock(run):
        return _run_annotate(run, cfg, overwrite=overwrite, resume=resume)


def _run_annotate(run: Path, cfg: AnnotateConfig, *, overwrite: bool, resume: bool) -> dict:
    from serl_cli.model import load_model, set_torch_threads
    from serl_cli.train import rollout_temperature

    manifest = io.load_manifest(run)
    validate(cfg)
    journal = run / JOURNAL_FILE
    finished = io.begin_resumable(run / ANNOTATIONS_FILE, journal, overwrite=overwrite, resume=resume,
                                  what="annotation", finished=lambda: _finished(run, manifest))
    if finished is not None:
        return finished
    episodes = read_rollouts(run)
    if any(not t["behaviour_logprobs"] for e in episodes for t in e["turns"]):
        raise SerlError(f"{run}/{ROLLOUTS_FILE} has no behaviour log-probs (expert data?): annotate a model's rollouts")
    rollout_cfg = manifest.get("stages", {}).get("rollout", {}).get("config", {})
    teacher_name = cfg.teacher or rollout_cfg.get("model")
    if not teacher_name:
        raise SerlError(f"no teacher model: {run}/manifest.json names no rollout model; pass --set teacher=DIR")
    plain = io.to_plain(cfg)
    plain.pop("threads")
    header = {"stage": "annotate", "config": plain, "teacher": str(teacher_name), "rollouts_sha256": rollouts_fingerprint(run)}
    if resume and not overwrite and journal.exists():
        done = io.read_journal(journal, header)
    else:
        done = []
        io.start_journal(journal, header)
    io.mark_stage(run, "annotate", "running", resumed_from_unit=len(done))
    set_torch_threads(cfg.threads)
    model, tokenizer = load_model(teacher_name)
    records, stats = annotate_episodes(episodes, cfg, model, tokenizer, env_cfg=rollout_cfg.get("env"),
                                       temperature=rollout_temperature(manifest), scorer=journaled_scorer(journal, done))
    result = write_annotations(run, records, episodes, cfg, stats)
    journal.unlink(missing_ok=True)
    return result


def write_annotations(run: Path, records: list[dict], episodes: list[dict], cfg: AnnotateConfig, stats: dict) -> dict:
    report = selection_report(records, episodes)
    report["teacher"] = stats
    io.write_jsonl(run / ANNOTATIONS_FILE, records)
    io.write_json(run / SELECTION_REPORT_FILE, report)
    io.mark_stage(run, "annotate", "done", config=io.to_plain(cfg), rollouts_sha256=rollouts_fingerprint(run), stats=stats)
    return {**stats, "report": report}


def read_annotations(run_dir: str | Path) -> list[dict]:
    """Annotations of a run, checked to belong to its current rollouts."""
    from serl_cli.schema import ANNOTATION_KEYS

    run = Path(run_dir)
    manifest = io.load_manifest(run)
    path = run / ANNOTATIONS_FILE
    if not path.is_file():
        raise SerlError(f"{run} has no annotations: run `serl annotate {run}` first")
    stage = manifest.get("stages", {}).get("annotate", {})
    if stage.get("status") != "done":
        raise SerlError(f"the annotation of {run} did not finish: run `serl annotate {run} --resume` first")
    made_for = stage.get("rollouts_sha256")
    if made_for != rollouts_fingerprint(run):
        raise SerlError(f"{path} was made from other rollouts than {run}/{ROLLOUTS_FILE}: annotate this run again")
    return list(io.iter_jsonl(path, required=ANNOTATION_KEYS))
