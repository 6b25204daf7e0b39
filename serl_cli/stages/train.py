"""``serl train RUN --algo ...``: one update of a policy on a run's stored rollouts.

The update itself is :class:`serl_cli.training.learner.Learner`'s; this stage adds the run's
bookkeeping: the run lock, resume, the metrics and timings journals, the checkpoint.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from serl_cli.algos.objectives import get_objective
from serl_cli.artifacts import io, runlock
from serl_cli.artifacts.records import Episode
from serl_cli.artifacts.schema import read_rollouts, rollout_temperature
from serl_cli.errors import SerlError
from serl_cli.method.feedback import parse_sources
from serl_cli.method.hindsight_sft import examples_for_run
from serl_cli.method.reading_sft import is_reading, parse_reading, reading_examples_for_run
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.training.backends import is_main_process
from serl_cli.training.learner import Learner, training_episodes
from serl_cli.training.train_config import TrainConfig, check_train_config


def train_on_run(
    run_dir: str, cfg: TrainConfig, *, overwrite: bool = False, resume: bool = False, progress=None
) -> dict:
    """One update on a run's rollouts, under the run's lock. The update is the unit of work:
    a killed one reruns from the start (the checkpoint is written atomically and the
    metrics lines of an unfinished attempt are dropped); ``resume`` returns a finished
    update's metrics without redoing it. ``progress(done, total)``: the update's micro-batches
    (:meth:`Learner.update`). Under torchrun / the deepspeed launcher every process calls it:
    all of them run the update and the save (their collectives need every process), and the
    main one alone keeps the run's books (the lock, the manifest, the metrics journals)."""
    run = Path(run_dir)
    if not is_main_process():
        return _train_on_run(run, cfg, overwrite=overwrite, resume=resume, main=False)
    with runlock.run_lock(run):
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
    if cfg.algo != "sft":
        raise SerlError(f"train.hindsight_sft adds SFT examples: it goes with --algo sft, not {cfg.algo}")
    if is_reading(cfg.hindsight_sft):
        parse_reading(cfg.hindsight_sft)
    else:
        parse_sources(cfg.hindsight_sft)


def hindsight_sft_examples(episodes: list[Episode], cfg: TrainConfig, tokenizer, rollout_cfg: dict) -> list[Episode]:
    """With ``train.hindsight_sft``, the SFT data's teacher-prompt examples: reading examples for a
    ``"reading: ..."`` spec (``method.reading_sft``), else hindsight examples (``method.hindsight_sft``)."""
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


def _comparable(cfg: TrainConfig) -> dict:
    plain = io.to_plain(cfg)
    plain.pop("threads")
    return plain


def _train_on_run(
    run: Path, cfg: TrainConfig, *, overwrite: bool, resume: bool, progress=None, main: bool = True
) -> dict:
    manifest = io.load_manifest(run)
    check_train_config(cfg)  # before the manifest says "running": a refused setting changes nothing on disk
    check_hindsight_sft(cfg)
    stage_name = f"train:{cfg.algo}"
    stage = manifest["stages"].get(stage_name, {})
    checkpoint = Path(cfg.checkpoint) if cfg.checkpoint else run / "checkpoint"
    metrics_path, timings_path = run / "metrics.jsonl", run / "timings.jsonl"
    rollout_cfg = manifest.get("stages", {}).get("rollout", {}).get("config", {})
    model_name = cfg.model or rollout_cfg.get("model")
    if resume and not overwrite:
        if stage.get("status") == "done" and (checkpoint / "config.json").is_file():
            stored = {k: v for k, v in (stage.get("config") or {}).items() if k != "threads"}
            if stored != json.loads(json.dumps({**_comparable(cfg), "model": model_name})):
                raise SerlError(f"{run} finished {stage_name} with other settings: pass --overwrite to train again")
            records = list(io.iter_jsonl(metrics_path))
            return records[stage.get("metrics_line", len(records) - 1)]
    else:
        io.prepare_output(checkpoint, overwrite=overwrite, what="a checkpoint", resumable=True)
    episodes = training_episodes(read_rollouts(run), cfg, run)
    if not model_name:
        raise SerlError(f"no model to train: {run}/manifest.json names none; pass --model")
    cfg.model = model_name
    annotations, meta = None, None
    if get_objective(cfg.algo).needs_annotations:
        from serl_cli.artifacts.schema import read_annotations

        annotations = read_annotations(run)
        meta = manifest["stages"]["annotate"]
    if main and stage.get("status") == "running":  # an earlier attempt was killed: forget what it may have written
        io.truncate_jsonl(metrics_path, stage.get("metrics_line", 0))
        io.truncate_jsonl(timings_path, stage.get("timings_line", 0))
    line, timings_line = io.count_jsonl(metrics_path), io.count_jsonl(timings_path)
    if main:
        io.mark_stage(run, stage_name, "running", metrics_line=line, timings_line=timings_line)
    learner = Learner(model_name, cfg)
    examples = hindsight_sft_examples(episodes, cfg, learner.tokenizer, rollout_cfg)
    # the engine that generated the rollouts: on vLLM's, pi_old is recomputed by default (recompute_logp_old: null)
    metrics = learner.update(
        episodes + examples,
        1.0 if cfg.algo == "sft" else rollout_temperature(manifest),
        annotations,
        meta,
        engine=rollout_cfg.get("engine", "hf"),
        progress=progress,
        rollout_half=rollout_in_half(rollout_cfg),
    )
    if cfg.hindsight_sft is not None:
        metrics["hindsight_examples"] = sum(len(e.turns) for e in examples)
    timing = metrics.pop("timing")  # wall-clock figures apart, so metrics.jsonl is deterministic
    # a full disk here is one clear error; the old checkpoint, if any, is still in place
    learner.save(checkpoint, prompt=PromptConfig(**rollout_cfg["prompt"]) if "prompt" in rollout_cfg else None)
    if not main:
        return metrics
    io.append_jsonl(metrics_path, metrics)
    io.append_jsonl(timings_path, {"update": line, "algo": cfg.algo, **timing})
    io.mark_stage(run, stage_name, "done", config=io.to_plain(cfg), checkpoint=str(checkpoint), metrics_line=line)
    return metrics
