"""``serl annotate RUN``: the annotation of a run's rollouts (``method.annotation``), written
as ``annotations.jsonl`` and ``selection_report.json``.

**Resume.** The teacher's work is the expensive part. ``serl annotate`` scores it one
teacher micro-batch at a time -- exactly the micro-batches a single ``score`` call would
make, so the numbers are bit-identical -- and appends each batch's log-probs to
``annotations.journal.jsonl``, numbered across the pass's scoring calls (the weights', then
the teacher signal's). ``--resume`` after a kill reuses the journaled batches and scores
only the rest; everything else is recomputed (it is cheap and deterministic).
"""

from __future__ import annotations

from pathlib import Path

from serl_cli.algos.objectives import annotation_advantages
from serl_cli.artifacts import io, runlock
from serl_cli.artifacts.records import Annotation, Episode, Manifest
from serl_cli.artifacts.schema import (
    ANNOTATIONS_FILE,
    ROLLOUTS_FILE,
    SELECTION_REPORT_FILE,
    read_manifest,
    read_rollouts,
    rollouts_fingerprint,
    turn_samples,
    write_annotation_records,
)
from serl_cli.errors import SerlError
from serl_cli.method.annotation import AnnotateConfig, annotate_episodes, validate
from serl_cli.method.diagnostics.selection_report import selection_report
from serl_cli.training.scoring import score, score_units
from serl_cli.training.train_config import TrainConfig

JOURNAL_FILE = "annotations.journal.jsonl"


def journaled_scorer(journal: Path, done: list[dict], progress=None):
    """A :func:`score` that reuses the units in ``done`` and journals each one it scores,
    numbering them on from one call to the next; ``progress(turns scored, turns to score)``
    after each unit (a progress bar)."""
    first = [0]  # the journal number of the next call's first unit

    def scorer(model, tokenizer, items, temperature, micro_batch_tokens):
        out: list[list[float]] = [[] for _ in items]
        finished = 0
        units = score_units(tokenizer, items, micro_batch_tokens)
        start, first[0] = first[0], first[0] + len(units)
        for u, index in enumerate(units, start):
            if u < len(done):
                # one log-prob list per item, or the journal was not written by this scorer
                if done[u].get("items") != index or len(done[u].get("logprobs") or []) != len(index):
                    raise SerlError(
                        f"{journal}: teacher batch {u} covers other turns than this run's: "
                        f"pass --overwrite to annotate from scratch"
                    )
                logprobs = done[u]["logprobs"]
            else:
                logprobs = score(model, tokenizer, [items[i] for i in index], temperature, micro_batch_tokens)
                io.append_journal(journal, {"unit": u, "items": index, "logprobs": logprobs})
            for i, lp in zip(index, logprobs, strict=True):
                out[i] = lp
            finished += len(index)
            if progress is not None:
                progress(finished, len(items))
        return out

    return scorer


def _finished(run: Path, manifest: Manifest) -> dict | None:
    stage = manifest.stage("annotate")
    if not stage.done or not (run / ANNOTATIONS_FILE).is_file() or not (run / SELECTION_REPORT_FILE).is_file():
        return None
    if stage.get("rollouts_sha256") != rollouts_fingerprint(run):
        return None
    return {**stage.stats, "report": io.read_json(run / SELECTION_REPORT_FILE)}


def run_annotate(
    run_dir: str,
    cfg: AnnotateConfig,
    *,
    train: TrainConfig | None = None,
    overwrite: bool = False,
    resume: bool = False,
    progress=None,
) -> dict:
    """Annotate a run's rollouts for an update under ``train`` (its advantages sign the weights,
    as in the online loop; None: the default settings'); ``resume`` continues an interrupted
    pass from its journal (or returns the summary of a finished one)."""
    run = Path(run_dir)
    with runlock.run_lock(run):
        return _run_annotate(run, cfg, train or TrainConfig(), overwrite=overwrite, resume=resume, progress=progress)


def _run_annotate(
    run: Path, cfg: AnnotateConfig, train: TrainConfig, *, overwrite: bool, resume: bool, progress=None
) -> dict:
    from serl_cli.artifacts.schema import rollout_temperature
    from serl_cli.models.device import resolve
    from serl_cli.models.loading import load_for_inference, set_torch_threads

    manifest = read_manifest(run)
    validate(cfg)
    journal = run / JOURNAL_FILE
    finished = io.begin_resumable(
        run / ANNOTATIONS_FILE,
        journal,
        overwrite=overwrite,
        resume=resume,
        what="annotation",
        finished=lambda: _finished(run, manifest),
    )
    if finished is not None:
        return finished
    episodes = read_rollouts(run)
    if any(not t.behaviour_logprobs for e in episodes for t in e.turns):
        raise SerlError(f"{run}/{ROLLOUTS_FILE} has no behaviour log-probs (expert data?): annotate a model's rollouts")
    rollout_cfg = manifest.rollout_config
    teacher_name = cfg.teacher or rollout_cfg.get("model")
    if not teacher_name:
        raise SerlError(f"no teacher model: {run}/manifest.json names no rollout model; pass --set teacher=DIR")
    plain = io.to_plain(cfg)
    plain.pop("threads")
    header = {
        "stage": "annotate",
        "config": plain,
        "teacher": str(teacher_name),
        "rollouts_sha256": rollouts_fingerprint(run),
    }
    if resume and not overwrite and journal.exists():
        done = io.read_journal(journal, header)
    else:
        done = []
        io.start_journal(journal, header)
    io.mark_stage(run, "annotate", "running", resumed_from_unit=len(done))
    set_torch_threads(cfg.threads)
    # the teacher on cfg.device in cfg.dtype (a GPU: bf16 weights; a CPU: fp32 weights under autocast)
    model, tokenizer = load_for_inference(teacher_name, resolve(cfg.device, cfg.dtype))
    records, stats = annotate_episodes(
        episodes,
        cfg,
        model,
        tokenizer,
        env_cfg=rollout_cfg.get("env"),
        temperature=rollout_temperature(manifest),
        scorer=journaled_scorer(journal, done, progress),
        advantages=annotation_advantages(turn_samples(episodes), train),
        chat_template_kwargs=(rollout_cfg.get("prompt") or {}).get("chat_template_kwargs"),
        bare_replies=bool((rollout_cfg.get("prompt") or {}).get("bare_replies")),
    )
    result = write_annotations(run, records, episodes, cfg, stats)
    journal.unlink(missing_ok=True)
    return result


def write_annotations(
    run: Path, records: list[Annotation], episodes: list[Episode], cfg: AnnotateConfig, stats: dict
) -> dict:
    report = selection_report(records, episodes)
    report["teacher"] = stats
    write_annotation_records(run, records)
    io.write_json(run / SELECTION_REPORT_FILE, report)
    io.mark_stage(
        run, "annotate", "done", config=io.to_plain(cfg), rollouts_sha256=rollouts_fingerprint(run), stats=stats
    )
    return {**stats, "report": report}
