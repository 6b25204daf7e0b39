"""``serl train RUN --algo ...``: one update of a policy on a run's stored rollouts.

The update itself is :class:`serl_cli.training.learner.Learner`'s; this stage adds the run's
bookkeeping: the run lock, resume, the metrics and timings journals, the checkpoint.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from serl_cli.algos.objectives import get_objective
from serl_cli.algos.registry import objective
from serl_cli.artifacts import io, runlock
from serl_cli.artifacts.records import Episode, StageRecord, check_token_ids
from serl_cli.artifacts.schema import (
    METRICS_FILE,
    ROLLOUTS_FILE,
    read_manifest,
    read_metrics,
    read_rollouts,
    rollout_temperature,
    rollouts_fingerprint,
)
from serl_cli.errors import SerlError
from serl_cli.method.feedback import parse_sources
from serl_cli.method.sft.hindsight import examples_for_run
from serl_cli.method.sft.reading import is_reading, parse_reading, reading_examples_for_run
from serl_cli.models.shapes import vocabulary as model_vocabulary
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.stages.resume_settings import without_changeable
from serl_cli.training.backends import is_main_process
from serl_cli.training.learner import Learner, training_episodes
from serl_cli.training.train_config import TrainConfig, check_train_config

UPDATE_RECORD = "serl_update.json"  # in a single update's checkpoint: what made it, and its metrics


def checkpoint_of(run: Path, cfg: TrainConfig) -> Path:
    """Where the update's checkpoint goes: ``train.checkpoint`` (``--out``), else ``RUN/checkpoint``."""
    return Path(cfg.checkpoint) if cfg.checkpoint else run / "checkpoint"


def writes_into_run(run: Path, checkpoint: Path) -> bool:
    """Whether the update writes into ``run`` (its checkpoint lies inside it): then it is the run's
    writer, holds its lock and keeps its books there (the manifest's ``train:ALGO``, ``metrics.jsonl``,
    ``timings.jsonl``). Otherwise it only *reads* the run: it locks and writes its checkpoint alone,
    whose :data:`UPDATE_RECORD` holds its metrics, so any number of updates read one run at once."""
    run, checkpoint = Path(os.path.abspath(run)), Path(os.path.abspath(checkpoint))
    return checkpoint == run or run in checkpoint.parents


def books_dir(run_dir: str, cfg: TrainConfig) -> Path:
    """Where the update's records go: the run it writes into, else its own checkpoint."""
    run = Path(run_dir)
    checkpoint = checkpoint_of(run, cfg)
    return run if writes_into_run(run, checkpoint) else checkpoint


def train_on_run(
    run_dir: str, cfg: TrainConfig, *, overwrite: bool = False, resume: bool = False, progress=None
) -> dict:
    """One update on a run's rollouts, under the lock of what it writes (:func:`writes_into_run`).
    The update is the unit of work: a killed one reruns from the start (the checkpoint is written
    atomically and the metrics lines of an unfinished attempt are dropped); ``resume`` returns a
    finished update's metrics without redoing it. A checkpoint another training wrote is never
    replaced without ``overwrite``. ``progress(done, total)``: the update's micro-batches
    (:meth:`Learner.update`). Under torchrun / the deepspeed launcher every process calls it:
    all of them run the update and the save (their collectives need every process), and the
    main one alone keeps the books (the lock, the manifest, the metrics journals)."""
    run = Path(run_dir)
    if not is_main_process():
        return _train_on_run(run, cfg, overwrite=overwrite, resume=resume, main=False)
    checkpoint = checkpoint_of(run, cfg)
    with runlock.run_lock(run if writes_into_run(run, checkpoint) else checkpoint):
        return _train_on_run(run, cfg, overwrite=overwrite, resume=resume, progress=progress)


def rollout_in_half(rollout_cfg: dict) -> bool:
    """Whether the hf engine of a ``serl rollout`` ran in half precision: its ``device``/``dtype``
    resolved on this machine; a GPU setting this machine cannot resolve counts as half (pi_old is
    then recomputed, which costs one forward pass and is never wrong)."""
    from serl_cli.models.device import resolve

    try:
        return resolve(rollout_cfg.get("device", "auto"), rollout_cfg.get("dtype", "auto")).half
    except SerlError:
        return True


def check_hindsight_sft(cfg: TrainConfig) -> None:
    """``train.hindsight_sft``, checked before any model loads: SFT only, known sources."""
    if cfg.hindsight_sft is None:
        return
    if not objective(cfg.algo).imitation:
        raise SerlError(f"train.hindsight_sft adds SFT examples: it goes with --algo sft, not {cfg.algo}")
    if is_reading(cfg.hindsight_sft):
        parse_reading(cfg.hindsight_sft)
    else:
        parse_sources(cfg.hindsight_sft)


def hindsight_sft_examples(episodes: list[Episode], cfg: TrainConfig, tokenizer, rollout_cfg: dict) -> list[Episode]:
    """With ``train.hindsight_sft``, the SFT data's teacher-prompt examples: reading examples for a
    ``"reading: ..."`` spec (``method.sft.reading``), else hindsight examples (``method.sft.hindsight``)."""
    if cfg.hindsight_sft is None:
        return []
    prompt = rollout_cfg.get("prompt") or {}
    build = examples_for_run
    if is_reading(cfg.hindsight_sft):
        build = functools.partial(reading_examples_for_run, seed=cfg.seed)  # each example's kind is drawn
    return build(
        episodes,
        tokenizer,
        cfg.hindsight_sft,
        rollout_cfg.get("env"),
        bare_replies=bool(prompt.get("bare_replies")),
        chat_template_kwargs=prompt.get("chat_template_kwargs"),
    )


def update_identity(run: Path, cfg: TrainConfig, model_name: str | None) -> dict:
    """What makes two single updates the same one: their settings (bar those a resume may change:
    :data:`~serl_cli.stages.resume_settings.RESUMABLE_CHANGES`), the starting policy, the rollouts."""
    train = {**io.to_plain(cfg), "model": model_name}
    train.pop("checkpoint")
    rollouts = rollouts_fingerprint(run) if (run / ROLLOUTS_FILE).is_file() else None
    return {"train": without_changeable(train, "train."), "rollouts_sha256": rollouts}


def read_update_record(checkpoint: Path) -> dict | None:
    """The :data:`UPDATE_RECORD` of a checkpoint; None where there is none (another kind of
    checkpoint, an online run's policy, or one from before serl kept the record)."""
    path = checkpoint / UPDATE_RECORD
    if not path.is_file():
        return None
    record = io.read_json(path)
    return record if isinstance(record, dict) and isinstance(record.get("train"), dict) else None


def check_checkpoint_is_ours(checkpoint: Path, record: dict | None, identity: dict, resume: bool) -> dict:
    """A checkpoint already at ``checkpoint``: refused unless it is this very update's and
    ``resume`` keeps it (then its ``record`` is returned). The way out never replaces another
    training's checkpoint silently."""
    elsewhere = "pass --out DIR to write this update elsewhere, or --overwrite to replace it"
    if record is None:
        raise SerlError(
            f"a checkpoint already exists at {checkpoint} and no single update of this run wrote it "
            f"(it has no {UPDATE_RECORD}): {elsewhere}"
        )
    diff = io.first_difference({k: record.get(k) for k in identity}, identity)
    if diff is not None:
        raise SerlError(
            f"a checkpoint already exists at {checkpoint}, written by another update "
            f"({io.difference_text(*diff)}): {elsewhere}"
        )
    if not resume:
        raise SerlError(
            f"a checkpoint of this same update already exists at {checkpoint}: pass --resume to keep it, "
            f"or --overwrite to train again"
        )
    return record


def _train_on_run(
    run: Path, cfg: TrainConfig, *, overwrite: bool, resume: bool, progress=None, main: bool = True
) -> dict:
    manifest = read_manifest(run)
    check_train_config(cfg)  # before the manifest says "running": a refused setting changes nothing on disk
    check_hindsight_sft(cfg)
    stage_name = f"train:{cfg.algo}"
    checkpoint = checkpoint_of(run, cfg)
    books = writes_into_run(run, checkpoint)  # else a reader of run: nothing is written into it
    stage = manifest.stage(stage_name) if books else StageRecord(stage_name, {})  # a reader: no entry of its own
    metrics_path, timings_path = run / METRICS_FILE, run / "timings.jsonl"
    rollout_cfg = manifest.rollout_config
    model_name = cfg.model or rollout_cfg.get("model")
    identity = update_identity(run, cfg, model_name)
    if checkpoint.exists() and not overwrite:
        record = check_checkpoint_is_ours(checkpoint, read_update_record(checkpoint), identity, resume)
        io.check_digests(checkpoint, record.get("weights_sha256"), "this update")
        if not books:  # the record is written with the weights: the update finished
            return record["metrics"]
        if stage.done:
            records = read_metrics(metrics_path)
            return dict(records[stage.get("metrics_line", len(records) - 1)])
        # killed between its checkpoint and its books: run again (the same update, the same result)
    episodes = training_episodes(read_rollouts(run), cfg, run)
    if not model_name:
        raise SerlError(f"no model to train: {run}/manifest.json names none; pass --model")
    vocabulary = model_vocabulary(model_name)
    if vocabulary is not None:  # before anything is written (the update checks again, on the loaded model)
        check_token_ids(episodes, vocabulary, str(run / ROLLOUTS_FILE))
    cfg.model = model_name
    annotations, meta = None, None
    if get_objective(cfg.algo).needs_annotations:
        from serl_cli.artifacts.schema import read_annotations

        annotations = read_annotations(run)
        meta = manifest.stage("annotate").entry
    if main and books and stage.status == "running":  # an earlier attempt was killed: drop what it wrote
        io.truncate_jsonl(metrics_path, stage.get("metrics_line", 0))
        io.truncate_jsonl(timings_path, stage.get("timings_line", 0))
    line, timings_line = (io.count_jsonl(metrics_path), io.count_jsonl(timings_path)) if books else (0, 0)
    if main and books:
        io.mark_stage(run, stage_name, "running", metrics_line=line, timings_line=timings_line)
    learner = Learner(model_name, cfg)
    examples = hindsight_sft_examples(episodes, cfg, learner.tokenizer, rollout_cfg)
    # the engine that generated the rollouts: on vLLM's, pi_old is recomputed by default (recompute_logp_old: null)
    metrics = learner.update(
        episodes + examples,
        1.0 if objective(cfg.algo).imitation else rollout_temperature(manifest),
        annotations,
        meta,
        engine=rollout_cfg.get("engine", "hf"),
        progress=progress,
        rollout_half=rollout_in_half(rollout_cfg),
    )
    if cfg.hindsight_sft is not None:
        metrics["hindsight_examples"] = sum(len(e.turns) for e in examples)
    timing = metrics.pop("timing")  # wall-clock figures apart, so metrics.jsonl is deterministic
    record = {**identity, "stage": stage_name, "rollouts": str(run), "metrics": metrics, "timing": timing}

    def add_record(staging: Path) -> None:  # into the checkpoint, so it is there exactly when the weights are
        if main:  # with the hash of each file beside it: a resume that keeps the update checks them
            io.write_json(staging / UPDATE_RECORD, {**record, "weights_sha256": io.digest_files(staging)})

    # a full disk here is one clear error; the old checkpoint, if any, is still in place
    prompt = PromptConfig(**rollout_cfg["prompt"]) if "prompt" in rollout_cfg else None
    learner.save(checkpoint, prompt=prompt, extra=add_record)
    if not main or not books:
        return metrics
    io.append_jsonl(metrics_path, metrics)
    io.append_jsonl(timings_path, {"update": line, "algo": cfg.algo, **timing})
    io.mark_stage(run, stage_name, "done", config=io.to_plain(cfg), checkpoint=str(checkpoint), metrics_line=line)
    return metrics
