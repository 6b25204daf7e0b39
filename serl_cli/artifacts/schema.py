"""Artifact schemas in one place: what each JSONL record holds, and how it is read back.

A run directory (``serl rollout --out RUN``)::

    RUN/manifest.json       serl version, git commit, command, resolved config, seeds,
                            stage status, artifact schema version
    RUN/rollout.yaml        the resolved rollout config
    RUN/rollouts.jsonl      one record per episode, each with its turns: artifacts.records.Episode, Turn
    RUN/annotations.jsonl   one record per turn (serl annotate): artifacts.records.Annotation
    RUN/checkpoint/         a Hugging Face model directory (serl train), with serl_update.json:
                            what made it (settings, the rollouts' sha256) and its metrics
    RUN/metrics.jsonl       one record per update (serl train): artifacts.records.Metrics

Token ids are stored exactly as generated and never rebuilt from text: ``prompt_ids`` is
the chat-templated prompt the policy saw, ``action_ids`` what it generated (ending in the
end-of-turn token when it stopped on its own) and ``behaviour_logprobs`` the sampling
policy's log-probability of each action token.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from serl_cli.artifacts import io, runlock
from serl_cli.artifacts.records import ANNOTATION_KEYS, ROLLOUT_KEYS, Annotation, Episode, Manifest, Metrics  # noqa: F401 (ANNOTATION_KEYS: re-exported)
from serl_cli.errors import SerlError

ROLLOUTS_FILE = "rollouts.jsonl"


def read_rollouts(run_dir: str | Path, *, need_tokens: bool = True) -> list[Episode]:
    """Episodes of a run, checked: schema version, keys, types, token/log-prob alignment (``Episode.from_dict``)."""
    run_dir = Path(run_dir)
    io.load_manifest(run_dir)
    path = io.stored(run_dir / ROLLOUTS_FILE)
    if not path.is_file():
        holder = runlock.writer(run_dir)
        if holder is not None:
            raise SerlError(f"the rollout of {run_dir} is running now, in {holder}: wait for it to finish")
        raise SerlError(
            f"{run_dir} holds no rollouts ({ROLLOUTS_FILE} missing): run `serl rollout --out {run_dir}` first"
        )
    records = list(io.iter_jsonl(path, required=ROLLOUT_KEYS))
    if not records:
        raise SerlError(f"{path} holds no episodes")
    return [Episode.from_dict(d, f"{path}:{n}", need_tokens=need_tokens) for n, d in enumerate(records, 1)]


def write_rollouts(run_dir: str | Path, episodes: list[Episode]) -> None:
    """``RUN/rollouts.jsonl``: one record per episode, written at once (atomically)."""
    io.write_jsonl(Path(run_dir) / ROLLOUTS_FILE, (e.to_dict() for e in episodes))


@dataclass
class TurnSample:
    """One turn as a training sample: the prompt it saw, the tokens it wrote, its episode's place."""

    episode: int  # index of the episode in the run
    turn: int
    group_key: tuple  # (task_id, group_id): the GRPO group
    prompt_ids: list[int]
    action_ids: list[int]
    behaviour_logprobs: list[float]
    episode_reward: float
    success: bool
    state_key: str
    turn_reward: float
    off_expert: bool = False  # a noisy expert's exploration move: it reaches a state, it is no SFT target
    invalid: bool = False  # the action was invalid (Turn.invalid_action): the invalid-action penalty's target
    faulted: bool = False  # the episode was ended by an environment fault (crash, timeout): it teaches nothing
    observation: str = ""  # the raw observation the turn acted on (GiGPO's anchor key train.gigpo_anchor observation)
    engine_logprobs: list[float] | None = None  # the engine's log-probs (pi_behav) where the trainer recomputed pi_old


def turn_samples(episodes: list[Episode]) -> list[TurnSample]:
    out = []
    for e, ep in enumerate(episodes):
        for t in ep.turns:
            out.append(
                TurnSample(
                    episode=e,
                    turn=t.turn,
                    group_key=ep.group_key,
                    prompt_ids=t.prompt_ids,
                    action_ids=t.action_ids,
                    behaviour_logprobs=t.behaviour_logprobs,
                    episode_reward=float(ep.reward),
                    success=bool(ep.success),
                    state_key=t.state_key,
                    turn_reward=float(t.reward),
                    off_expert=bool(t.off_expert),
                    invalid=t.invalid_action,
                    faulted=bool(ep.error),
                    observation=t.observation,
                    engine_logprobs=t.engine_logprobs,
                )
            )
    return out


# -- annotations (serl annotate) ------------------------------------------------------------
ANNOTATIONS_FILE = "annotations.jsonl"
SELECTION_REPORT_FILE = "selection_report.json"
# One record per turn, in rollouts.jsonl order (episode, then turn): artifacts.records.Annotation


def read_manifest(run_dir: str | Path) -> Manifest:
    """A run's ``manifest.json``, checked (``io.load_manifest``: a run directory, this schema version)."""
    return Manifest.from_dict(io.load_manifest(run_dir), f"{run_dir}/manifest.json")


def rollout_temperature(manifest: Manifest) -> float:
    """Behaviour log-probs were taken at the rollout's temperature; greedy ones at 1."""
    t = float(manifest.rollout_config.get("sampling", {}).get("temperature", 1.0))
    return t if t > 0 else 1.0


def rollouts_fingerprint(run: Path) -> str:
    return hashlib.sha256(io.read_stored_bytes(run / ROLLOUTS_FILE)).hexdigest()[:16]


def iter_annotations(path: Path) -> Iterator[Annotation]:
    """The records of an annotations file, each checked (``Annotation.from_dict``; errors name ``path:line``)."""
    for n, d in enumerate(io.iter_jsonl(path), 1):
        yield Annotation.from_dict(d, f"{io.stored(path)}:{n}")


def write_annotation_records(run_dir: str | Path, annotations: list[Annotation]) -> None:
    """``RUN/annotations.jsonl``: one record per turn, written at once (atomically)."""
    io.write_jsonl(Path(run_dir) / ANNOTATIONS_FILE, (a.to_dict() for a in annotations))


def read_annotations(run_dir: str | Path) -> list[Annotation]:
    """Annotations of a run, checked to belong to its current rollouts."""

    run = Path(run_dir)
    stage = read_manifest(run).stage("annotate")
    path = io.stored(run / ANNOTATIONS_FILE)
    if not path.is_file():
        raise SerlError(f"{run} has no annotations: run `serl annotate {run}` first")
    if not stage.done:
        holder = runlock.writer(run)
        if holder is not None:
            raise SerlError(f"the annotation of {run} is running now, in {holder}: wait for it to finish")
        raise SerlError(f"the annotation of {run} did not finish: run `serl annotate {run} --resume` first")
    made_for = stage.get("rollouts_sha256")
    if made_for != rollouts_fingerprint(run):
        raise SerlError(f"{path} was made from other rollouts than {run}/{ROLLOUTS_FILE}: annotate this run again")
    return list(iter_annotations(path))


# -- metrics (serl train, the online loop) ----------------------------------------------------
METRICS_FILE = "metrics.jsonl"
_COUNTERS = ("update", "iteration", "env_steps")  # what a reader orders and sums the lines by


def read_metrics(path: str | Path) -> list[Metrics]:
    """The lines of a metrics file, each a JSON object whose counters are integers where present."""
    path = Path(path)
    out = []
    try:
        for n, d in enumerate(io.iter_jsonl(path), 1):
            for key in _COUNTERS:
                if key in d and type(d[key]) is not int:
                    raise SerlError(f"{io.stored(path)}:{n}: {key} must be an integer, got {json.dumps(d[key])[:60]}")
            out.append(cast(Metrics, d))
    except SerlError as e:
        if "truncated last line" not in str(e):
            raise
        raise SerlError(
            f"{e}; serl writes this file whole, so it was cut afterwards (a copy, a full disk): delete the cut last "
            "line to read the rest"
        ) from None
    return out


def append_metrics(path: str | Path, metrics: Metrics) -> None:
    """Add one update's line (atomically: a crash leaves the old file whole)."""
    io.append_jsonl(path, dict(metrics))
